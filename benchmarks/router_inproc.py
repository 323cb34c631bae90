"""The router's own work per request, without sockets: `service.serve` over an upstream that answers at once.

Starts the fake engines (tests/router/wire_fake.py) so that the app's first health round registers a P and a D
instance, then replaces the app's upstream pool with one that returns canned P and D answers, and times
`service.serve` + the reply's head + its end-of-request bookkeeping (`Reply.sent`) for N requests of the
router benchmark's body. What it prints excludes the event loop's I/O, parsing of the client's HTTP and the
upstream client: it is the cost of validation, placement, the two legs' bookkeeping, metrics and sessions.

    python benchmarks/router_inproc.py [--requests 20000] [--warmup 300] [--profile]
For a count that does not depend on the machine's load, run it under valgrind at two sizes and take the
difference (instructions per request):
    valgrind --tool=cachegrind --cache-sim=no python benchmarks/router_inproc.py --requests 200
    valgrind --tool=cachegrind --cache-sim=no python benchmarks/router_inproc.py --requests 600
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import pstats
import subprocess
import sys
import time
from pathlib import Path

import orjson
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from router.app import create_app  # noqa: E402
from router.server import RouterServer  # noqa: E402
from router.service import serve  # noqa: E402
from router.settings import Settings  # noqa: E402

P_ANSWER = orjson.dumps({
    "id": "p", "object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 100, "completion_tokens": 1},
    "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
                           "remote_engine_id": "engine-p", "remote_request_id": "r", "remote_host": "localhost",
                           "remote_port": 5600, "tp_size": 1}})
D_ANSWER = orjson.dumps({
    "id": "d", "choices": [{"index": 0, "text": " ".join(f"t{i}" for i in range(16)), "finish_reason": "length"}],
    "usage": {"prompt_tokens": 100, "completion_tokens": 16, "total_tokens": 116}})


class InstantResponse:
    def __init__(self, content: bytes) -> None:
        self.status_code, self.headers, self.content = 200, {"content-type": "application/json"}, content

    async def aread(self) -> bytes:
        return self.content

    async def aclose(self) -> None:
        pass


class InstantUpstream:
    def __init__(self, prefill_url: str) -> None:
        self.prefill_url = prefill_url

    async def send(self, url: str, path: str, body: bytes, headers) -> InstantResponse:
        return InstantResponse(P_ANSWER if url == self.prefill_url else D_ANSWER)


def benchmark_body() -> bytes:
    spec = importlib.util.spec_from_file_location("router_load", ROOT / "benchmarks" / "router_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.body(16, False)


async def run(args, p_url: str, d_url: str) -> None:
    app = create_app(Settings(prefill_urls=[p_url], decode_urls=[d_url], engine="vllm"))
    async with app.router.lifespan_context(app):
        state = app.state.router
        state.upstream = InstantUpstream(p_url)
        server = RouterServer(app)
        raw = benchmark_body()
        headers = {"content-length": str(len(raw))}

        async def one() -> None:
            reply = await serve(state, "completions", headers, raw, time.monotonic())
            if reply.status != 200:
                raise SystemExit(f"the router answered {reply.status}: {reply.body[:300]!r}")
            server.head(reply, True, len(reply.body))
            reply.sent()

        for _ in range(args.warmup):
            await one()
        profile = cProfile.Profile() if args.profile else None
        if profile:
            profile.enable()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(args.requests):
            await one()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if profile:
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        print(f"{args.requests} requests: {1e6 * wall / args.requests:.1f} us wall, "
              f"{1e6 * cpu / args.requests:.1f} us CPU per request")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--port", type=int, default=18700, help="first of the two fake engines' ports")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed requests (top 25 by self time)")
    args = parser.parse_args()
    fakes = subprocess.Popen([sys.executable, "-m", "tests.router.wire_fake", "--ports", str(args.port),
                              str(args.port + 1)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        if fakes.stdout.readline().strip() != "ready":
            raise SystemExit("the fake engines did not start")
        uvloop.run(run(args, f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{args.port + 1}"))
    finally:
        fakes.terminate()
        fakes.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
