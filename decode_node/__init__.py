"""Decode node: FastAPI server plus rank processes decoding in a TP or DCP pool; SSE streaming."""
