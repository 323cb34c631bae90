"""Router overhead: client-seen TTFT and E2E through the PD router vs straight to the decode node.

Fake vLLM-protocol nodes (tests/router/fakes.py) under real uvicorn on 127.0.0.1, so the numbers are the
router's own cost (two legs, relay, accounting), not a model's. Side by side in one run:
  direct   client -> decode node (one leg, streaming)
  router   client -> router -> prefill (max_tokens=1) -> decode (streaming relay)
    python benchmarks/router.py [--requests 200] [--concurrency 8] [--tokens 16] [--json out.json]
Headline: added p50 TTFT in milliseconds (router minus direct; includes the P leg round trip).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from router.app import create_app  # noqa: E402
from router.config import InstanceSpec, PoolSpec, RouterConfig  # noqa: E402
from router.settings import Settings  # noqa: E402
from tests.router.fakes import FakeNode  # noqa: E402
from tests.router.servers import uvicorn_server  # noqa: E402


async def drive(url: str, num_requests: int, concurrency: int, num_tokens: int) -> tuple[list[float], list[float]]:
    ttfts, e2es = [], []
    sem = asyncio.Semaphore(concurrency)
    body = {"model": "fake-model", "prompt": "benchmark prompt " * 20, "max_tokens": num_tokens, "stream": True}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        async def one() -> None:
            async with sem:
                start = time.perf_counter()
                first = None
                async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter()
                ttfts.append((first or time.perf_counter()) - start)
                e2es.append(time.perf_counter() - start)

        await asyncio.gather(*(one() for _ in range(num_requests)))
    return ttfts, e2es


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode", num_tokens=args.tokens)
    with ExitStack() as stack:
        urls = {n.name: stack.enter_context(uvicorn_server(n.app())) for n in (p, d)}
        config = RouterConfig(pools=[PoolSpec(name="default")], instances=[
            InstanceSpec(name=n.name, role=n.role, url=urls[n.name], engine="vllm") for n in (p, d)])
        router = stack.enter_context(uvicorn_server(create_app(
            Settings(health_interval_s=3600.0, disagg_min_uncached_tokens=1), config=config)))
        rows = {}
        for label, url in (("direct", urls["d0"]), ("router", router)):
            asyncio.run(drive(url, 10, args.concurrency, args.tokens))  # warm-up
            start = time.perf_counter()
            ttfts, e2es = asyncio.run(drive(url, args.requests, args.concurrency, args.tokens))
            rows[label] = {"req_per_s": args.requests / (time.perf_counter() - start),
                           "ttft_p50_ms": pct(ttfts, 0.5), "ttft_p99_ms": pct(ttfts, 0.99),
                           "e2e_p50_ms": pct(e2es, 0.5), "e2e_mean_ms": statistics.mean(e2es) * 1000.0}
    print(f"{'path':<8} {'req/s':>8} {'TTFT p50':>10} {'TTFT p99':>10} {'E2E p50':>10}")
    for label, row in rows.items():
        print(f"{label:<8} {row['req_per_s']:>8.1f} {row['ttft_p50_ms']:>8.1f}ms {row['ttft_p99_ms']:>8.1f}ms "
              f"{row['e2e_p50_ms']:>8.1f}ms")
    added = rows["router"]["ttft_p50_ms"] - rows["direct"]["ttft_p50_ms"]
    print(f"router adds {added:.1f} ms p50 TTFT (P leg round trip + relay), "
          f"throughput ratio router/direct {rows['router']['req_per_s'] / rows['direct']['req_per_s']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"headline": {"metric": "router_added_ttft_p50_ms", "value": added,
                                                      "goal": "< 10 ms on an idle host"},
                                         "rows": rows, "args": vars(args) | {"json": str(args.json)}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
