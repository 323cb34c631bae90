"""Server-sent events framing for OpenAI streams: `data: {json}\n\n` per chunk, `data: [DONE]\n\n` last.

Also the inverse (`iter_sse_data`) for clients and tests that read a stream line by line.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"


def encode_event(chunk: BaseModel | str) -> str:
    """One SSE event for a pydantic chunk (None fields kept: OpenAI clients expect `usage: null`)."""
    payload = chunk if isinstance(chunk, str) else chunk.model_dump_json()
    return f"data: {payload}\n\n"


async def with_done(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Encode every chunk, then the `[DONE]` terminator."""
    async for chunk in chunks:
        yield encode_event(chunk)
    yield DONE


def iter_sse_data(lines: Iterable[str]) -> list[str]:
    """The `data:` payloads of an SSE text stream in order, `[DONE]` included."""
    return [line[len("data:"):].strip() for line in lines if line.startswith("data:")]
