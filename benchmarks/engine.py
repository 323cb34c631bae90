"""Reference engine speed on this CPU: prefill tokens/s by prompt length, decode step time by batch size.

    python benchmarks/engine.py [--model kimi-k3.1-mini] [--prefill 1024 4096 16384] [--batches 1 8 32]
                                [--context 1024] [--steps 5] [--json PATH]

Prefill runs one request through `KimiModel.prefill` into the row pool (the engine's path). Decode runs
`KimiModel.decode` on B requests whose rows hold a `--context`-token prefill (copied row by row from one
prefilled request: the step cost does not depend on the values) and reports the median step time.
One torch thread (as the engine's rank processes). Headline: seconds of the 4K-token prefill (goal < 5 s).
"process CPU" is this process's CPU time: on a shared machine it tracks the unloaded wall time better.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# This file is named engine.py: drop its own folder from sys.path so `engine` is the package, not this script.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from engine.cache import RowPool, RowSequenceCache  # noqa: E402
from engine.model.config import get_preset  # noqa: E402
from engine.model.weights import build_model  # noqa: E402
from engine.layout import plan_layout  # noqa: E402

GOAL_PREFILL_4K_S = 5.0
GOAL_DECODE_B1_MS = 50.0


def bench_prefill(model, cfg, length: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    pool = RowPool(plan_layout(cfg), cfg, sum(plan_layout(cfg).rows_per_request(length)))
    cache = RowSequenceCache(pool, pool.allocate_request(length))
    tokens = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length))
    started, cpu = time.perf_counter(), time.process_time()
    model.prefill(tokens, cache)
    return time.perf_counter() - started, time.process_time() - cpu


def bench_decode(model, cfg, batch: int, context: int, steps: int) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    layout = plan_layout(cfg)
    per_request = sum(layout.rows_per_request(context + steps + 1))
    pool = RowPool(layout, cfg, per_request * batch)
    tables = [pool.allocate_request(context + steps + 1) for _ in range(batch)]
    tokens = torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(0))
    model.prefill(tokens, RowSequenceCache(pool, tables[0]))
    for table in tables[1:]:
        for src, dst in zip(tables[0].row_ids, table.row_ids):
            pool.buffer[dst] = pool.buffer[src]
    caches = [RowSequenceCache(pool, t) for t in tables]
    times = []
    for step in range(steps):
        started, cpu = time.perf_counter(), time.process_time()
        model.decode(torch.full((batch,), 65), [context + step] * batch, caches)
        times.append((time.perf_counter() - started, time.process_time() - cpu))
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kimi-k3.1-mini")
    p.add_argument("--prefill", type=int, nargs="*", default=[1024, 4096, 16384])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=1024, help="tokens of context per request when decoding")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = get_preset(args.model)
    model = build_model(cfg)
    rows, results = [], {"model": args.model, "threads": 1, "prefill": {}, "decode": {}}
    with torch.no_grad():
        model.prefill(torch.randint(0, 256, (64,)), RowSequenceCache(*_tiny_pool(cfg)))  # warm-up
        for length in args.prefill:
            seconds, cpu = bench_prefill(model, cfg, length)
            results["prefill"][str(length)] = {"seconds": round(seconds, 4), "cpu_seconds": round(cpu, 4),
                                               "tokens_per_s": round(length / seconds, 1)}
            rows.append((f"prefill {length} tokens", f"{seconds:.3f} s", f"{cpu:.3f} s", f"{length / seconds:,.0f} tok/s"))
        for batch in args.batches:
            times = bench_decode(model, cfg, batch, args.context, args.steps)
            kept = times[1:] if len(times) > 1 else times
            median = statistics.median(t for t, _ in kept)
            cpu = statistics.median(c for _, c in kept)
            results["decode"][str(batch)] = {"step_ms": round(median * 1e3, 2), "cpu_ms": round(cpu * 1e3, 2),
                                             "context": args.context, "tokens_per_s": round(batch / median, 1)}
            rows.append((f"decode batch {batch} (ctx {args.context})", f"{median * 1e3:.1f} ms/step",
                         f"{cpu * 1e3:.1f} ms/step", f"{batch / median:,.0f} tok/s"))
    print(f"{'case':<32} {'wall':>14} {'process CPU':>14} {'throughput':>14}")
    for case, wall, cpu_time, thr in rows:
        print(f"{case:<32} {wall:>14} {cpu_time:>14} {thr:>14}")
    prefill_4k = results["prefill"].get("4096", {}).get("seconds")
    results["headline"] = {"metric": "prefill_4096_tokens_seconds", "value": prefill_4k, "goal": GOAL_PREFILL_4K_S}
    results["goals"] = {"prefill_4096_s": GOAL_PREFILL_4K_S, "decode_batch1_ms": GOAL_DECODE_B1_MS}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _tiny_pool(cfg):  # type: ignore[no-untyped-def]
    pool = RowPool(plan_layout(cfg), cfg, 4)
    return pool, pool.allocate_request(64)


if __name__ == "__main__":
    raise SystemExit(main())
