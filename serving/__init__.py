"""Pieces every HTTP server here shares: OpenAI error JSON, request/response schemas, SSE helpers."""
