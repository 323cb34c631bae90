"""Prefill node: FastAPI server plus W rank processes running the token-sharded prefill."""
