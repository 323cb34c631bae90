"""How router/relay.py `relay` ends a stream when the client's side stops reading."""

from __future__ import annotations

import asyncio
import time

from router.relay import StreamAccounting, relay

TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


class _Upstream:
    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


async def _d_stream(after_done: asyncio.Event):
    """D's stream: two token chunks and [DONE], then a pause before it ends (its connection's close)."""
    yield TOKEN
    yield DONE
    await after_done.wait()


async def _relay_until(stop_after: bytes) -> tuple[list[bytes], list[str], _Upstream]:
    """Read the relay until a chunk containing `stop_after`, then leave as a client that hung up: the task
    waiting on the next chunk is cancelled (the server's reaction to a closed connection)."""
    ended: list[str] = []
    resp, after_done = _Upstream(), asyncio.Event()
    acct = StreamAccounting(started=time.monotonic())
    gen = relay(resp, _d_stream(after_done), TOKEN, acct, 60.0, ended.append)
    got: list[bytes] = []

    async def read() -> None:
        async for chunk in gen:
            got.append(chunk)

    task = asyncio.create_task(read())
    while not any(stop_after in c for c in got):
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)  # the reader is now waiting on D's close
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await gen.aclose()
    return got, ended, resp


def test_a_client_that_leaves_after_done_ends_the_stream_ok() -> None:
    """[DONE] relayed, then the client hangs up while D's stream is still closing: the stream ended cleanly
    ("ok": the turn's session record and latency metrics are kept), not "cancelled"; D's response is closed."""
    got, ended, resp = asyncio.run(_relay_until(DONE))
    assert got[-1] == DONE and ended == ["ok"] and resp.closed


def test_a_client_that_leaves_before_done_cancels_the_stream() -> None:
    """The client hangs up after the first token, before [DONE] reached it: "cancelled"."""
    async def run() -> list[str]:
        ended: list[str] = []
        resp = _Upstream()
        acct = StreamAccounting(started=time.monotonic())
        never = asyncio.Event()

        async def d_stream():
            await never.wait()
            yield DONE

        gen = relay(resp, d_stream(), TOKEN, acct, 60.0, ended.append)
        first = await anext(gen)
        assert first == TOKEN
        task = asyncio.create_task(anext(gen))
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, StopAsyncIteration):
            pass
        await gen.aclose()
        return ended

    assert asyncio.run(run()) == ["cancelled"]
