"""A light fake vLLM-protocol engine for router benchmarks: raw asyncio + httptools, no framework.

One process serves any number of instances (one port each). Every instance answers `GET /health`,
`GET /v1/models`, `GET /metrics` (with `vllm:cache_config_info`, so routers pair P with D), `GET /stats`
(completion legs and render calls served) and `POST /v1/completions` / `/v1/chat/completions`:
- a P leg (`kv_transfer_params.do_remote_decode`): a JSON answer with handoff `kv_transfer_params`;
- a D leg: `max_tokens` tokens (at most `--max-tokens`) as one JSON answer, or, when `stream` is set, as
  one SSE event per token (each written in its own event-loop turn) and `data: [DONE]`.
`POST .../render` (vllm-router's cache-aware policy renders every prompt on P and D before the legs) is
counted apart and answered like a P leg. Keep-alive HTTP/1.1; chunked encoding for streams. Used by benchmarks/router.py and tests/router.

    python -m tests.router.wire_fake --ports 9001 9002 [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio

import httptools
import orjson

MODEL = "fake-model"
METRICS = (b'# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16",cache_dtype="auto",'
           b'num_gpu_blocks="1000",engine="0"} 1.0\n# TYPE vllm:num_requests_running gauge\n'
           b'vllm:num_requests_running{model_name="fake-model"} 0.0\n')
MODELS = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 32768}]})


def response(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    reason = b"OK" if status == 200 else b"Error"
    return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (status, reason, content_type,
                                                                                   len(body))) + body


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FakeEngine(asyncio.Protocol):
    """One client connection to a fake instance."""

    def __init__(self, name: str, max_tokens: int, stats: dict[str, int]) -> None:
        self.name = name
        self.stats = stats
        self.max_tokens = max_tokens
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.request_id = b"r"
        self.queue: list[tuple[bytes, bytes, bytes]] = []
        self.busy = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.body, self.request_id = b"", [], b"r"

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-request-id":
            self.request_id = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.queue.append((self.parser.get_method(), self.url, b"".join(self.body)))
        if not self.busy:
            self.busy = True
            asyncio.ensure_future(self.serve_queue())

    async def serve_queue(self) -> None:
        while self.queue and not self.transport.is_closing():
            method, url, body = self.queue.pop(0)
            await self.answer(method, url, body)
        self.busy = False

    async def answer(self, method: bytes, url: bytes, body: bytes) -> None:
        write = self.transport.write
        if method == b"GET":
            if url == b"/metrics":
                write(response(200, METRICS, b"text/plain; version=0.0.4"))
            elif url == b"/stats":
                write(response(200, orjson.dumps(self.stats)))
            elif url == b"/v1/models":
                write(response(200, MODELS))
            else:
                write(response(200 if url == b"/health" else 404, b"{}"))
            return
        request = orjson.loads(body) if body else {}
        self.stats["render" if url.endswith(b"/render") else "requests"] += 1
        chat = url.endswith(b"chat/completions")
        if (request.get("kv_transfer_params") or {}).get("do_remote_decode") or url.endswith(b"/render"):
            handoff = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
                       "remote_engine_id": f"engine-{self.name}", "remote_request_id": self.request_id.decode(),
                       "remote_host": "localhost", "remote_port": 5600, "tp_size": 1}
            choice = {"index": 0, "text": "x", "finish_reason": "length"}
            write(response(200, orjson.dumps({"id": "p", "object": "text_completion", "choices": [choice],
                                              "usage": {"prompt_tokens": 100, "completion_tokens": 1},
                                              "kv_transfer_params": handoff})))
            return
        num_tokens = min(int(request.get("max_tokens") or 16), self.max_tokens)
        if not request.get("stream"):
            text = "".join(f"t{i} " for i in range(num_tokens))
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else \
                {"index": 0, "text": text}
            write(response(200, orjson.dumps({"id": "d", "choices": [{**choice, "finish_reason": "length"}],
                                              "usage": {"prompt_tokens": 100, "completion_tokens": num_tokens,
                                                        "total_tokens": 100 + num_tokens}})))
            return
        write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(num_tokens):
            choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
            write(chunk(b"data: " + orjson.dumps({"id": "d", "choices": [choice]}) + b"\n\n"))
            await asyncio.sleep(0)
            if self.transport.is_closing():
                return
        write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


async def serve(ports: list[int], max_tokens: int, host: str = "127.0.0.1") -> None:
    loop = asyncio.get_running_loop()
    stats = [{"requests": 0, "render": 0} for _ in ports]
    servers = [await loop.create_server(lambda i=i: FakeEngine(f"fake{i}", max_tokens, stats[i]), host, port,
                                        backlog=1024) for i, port in enumerate(ports)]
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", type=int, nargs="+", required=True)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    import uvloop  # noqa: PLC0415

    uvloop.run(serve(args.ports, args.max_tokens))


if __name__ == "__main__":
    main()
