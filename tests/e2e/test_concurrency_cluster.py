"""32 concurrent streaming sessions through the router complete without error, two of them are checked
against the oracle, and every node's rows return to their idle count (no leaked rows)."""

from __future__ import annotations

import asyncio
import time

import pytest

pytestmark = pytest.mark.e2e

NUM_SESSIONS = 32
MAX_TOKENS = 8


def _prompt(index: int) -> str:
    return f"Session {index:02d} asks the cluster to summarise the build log of job {index * 7919 % 1000}."


async def _one(client, model: str, index: int) -> tuple[str, str | None, int]:
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": _prompt(index)}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_headers={"X-Session-ID": f"concurrent-{index}"})
    text, finish, tokens = [], None, 0
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(text), finish, tokens


async def _all(cluster) -> list:
    client = cluster.async_client()
    try:
        return await asyncio.gather(*(_one(client, cluster.model, i) for i in range(NUM_SESSIONS)),
                                    return_exceptions=True)
    finally:
        await client.close()


def test_32_concurrent_streaming_sessions(cluster):
    idle = cluster.idle_snapshot()
    started = time.monotonic()
    results = asyncio.run(asyncio.wait_for(_all(cluster), timeout=600))
    elapsed = time.monotonic() - started
    errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of {NUM_SESSIONS} sessions failed, first: {errors[0]!r}"
    for index, (text, finish, tokens) in enumerate(results):
        assert finish in ("stop", "length") and 1 <= tokens <= MAX_TOKENS, (index, finish, tokens)
    for index in (0, NUM_SESSIONS - 1):
        expected = cluster.oracle_chat([{"role": "user", "content": _prompt(index)}], MAX_TOKENS)
        assert results[index][0] == expected.text, f"session {index} differs from the oracle"
        assert results[index][2] == len(expected.token_ids), f"session {index} differs from the oracle"
    cluster.wait_back_to(idle)
    print(f"{NUM_SESSIONS} concurrent streaming sessions in {elapsed:.1f} s")
