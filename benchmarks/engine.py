"""Engine speed. CPU (default): the reference engine's prefill tokens/s by prompt length and decode step time by
batch size. `--device cuda`: decode step time of the fast path and the reference path on one GPU per
(model, context, batch), with bytes/FLOPs per step and the HBM-roofline fraction (benchmarks/gpu_decode.py), and
with `--prefill-lengths` prefill time per (model, prompt length) with FLOPs, bytes and the fraction of the bf16
matmul peak (benchmarks/gpu_prefill.py; `--batches` with no value skips the decode cells).

    python benchmarks/engine.py [--model kimi-k3.1-mini] [--prefill 1024 4096 16384] [--batches 1 8 32]
                                [--context 1024] [--steps 5] [--json PATH]
    python benchmarks/engine.py --device cuda --kernels fast reference \
        --models benchmarks/k31_scaled.json benchmarks/k31_pro_rank.json \
        --contexts 8192 32768 131072 --batches 1 8 32 [--steps 10] [--ref-steps 2] [--json PATH]

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

import torch

from engine.cache import RowPool, RowSequenceCache
from engine.layout import plan_layout
from engine.model.config import get_preset
from engine.model.weights import build_model

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
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--kernels", nargs="+", default=["fast", "reference"], choices=["fast", "reference"],
                   help="cuda: kernel sets to time (the speed-up needs both)")
    p.add_argument("--models", nargs="+", default=["benchmarks/k31_scaled.json", "benchmarks/k31_pro_rank.json"],
                   help="cuda: presets or ModelConfig JSON files")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072], help="cuda: cached tokens")
    p.add_argument("--ref-steps", type=int, default=2, help="cuda: timed reference steps per cell")
    p.add_argument("--prefill-lengths", type=int, nargs="*", default=[],
                   help="cuda: prompt lengths of the prefill cells (benchmarks/gpu_prefill.py), e.g. 4096 32768 131072")
    p.add_argument("--ref-max-prefill", type=int, default=32768, help="cuda: longest prompt the reference prefills")
    p.add_argument("--prefill-repeats", type=int, default=2, help="cuda: timed fast prefills per cell")
    p.add_argument("--no-compile", action="store_true",
                   help="cuda: skip the fast+compile+graph decode run and the fast+compile prefill run "
                        "(torch.compile of the fast path's torch segments)")
    args = p.parse_args(argv)
    if args.device == "cuda":
        return main_cuda(args)
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


def main_cuda(args) -> int:  # type: ignore[no-untyped-def]
    import importlib.util

    from engine.model.config import preset_or_file

    spec = importlib.util.spec_from_file_location("gpu_decode", Path(__file__).with_name("gpu_decode.py"))
    gpu = importlib.util.module_from_spec(spec)
    sys.modules["gpu_decode"] = gpu  # dataclasses look their module up there
    spec.loader.exec_module(gpu)
    copy_bandwidth_gbps, matmul_tflops, run_cells = gpu.copy_bandwidth_gbps, gpu.matmul_tflops, gpu.run_cells
    spec = importlib.util.spec_from_file_location("gpu_prefill", Path(__file__).with_name("gpu_prefill.py"))
    gpu_prefill = importlib.util.module_from_spec(spec)
    sys.modules["gpu_prefill"] = gpu_prefill
    spec.loader.exec_module(gpu_prefill)
    prefill_cells = []

    device = torch.device("cuda")
    log = lambda text: print(text, file=sys.stderr, flush=True)
    copy_gbps, tflops = copy_bandwidth_gbps(device), matmul_tflops(device)
    log(f"copy bandwidth {copy_gbps:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s")
    cells = []
    for name in args.models:
        cfg = preset_or_file(name)
        model = build_model(cfg, device=device)
        with torch.no_grad():
            cells += run_cells(cfg, model, args.contexts, args.batches, args.kernels, max(args.steps, 3),
                               args.ref_steps, device, log, compile_segments=not args.no_compile)
            if args.prefill_lengths:
                prefill_cells += gpu_prefill.run_prefill_cells(cfg, model, args.prefill_lengths, args.kernels,
                                                               args.prefill_repeats, args.ref_max_prefill, device, log,
                                                               compile_segments=not args.no_compile)
        del model
        torch.cuda.empty_cache()
    ref = {(c.model, c.context, c.batch): c.step_ms for c in cells if c.kernels == "reference"}
    print(f"{torch.cuda.get_device_name(device)}: copy {copy_gbps:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s")
    print("| model | context | batch | kernels | ms/step | MB/step | GFLOP/step | HBM roofline | bf16 peak | "
          "speed-up vs reference |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for c in cells:
        base = ref.get((c.model, c.context, c.batch))
        speedup = base / c.step_ms if base is not None and c.kernels != "reference" else None
        rows.append({"model": c.model, "context": c.context, "batch": c.batch, "kernels": c.kernels,
                     "step_ms": round(c.step_ms, 4), "bytes_per_step": c.bytes_per_step,
                     "flops_per_step": c.flops_per_step, "hbm_roofline_fraction": round(c.hbm_fraction(copy_gbps), 4),
                     "bf16_peak_fraction": round(c.matmul_fraction(tflops), 5),
                     "speedup_vs_reference": None if speedup is None else round(speedup, 1)})
        print(f"| {c.model} | {c.context} | {c.batch} | {c.kernels} | {c.step_ms:.3f} | {c.bytes_per_step / 1e6:.0f} | "
              f"{c.flops_per_step / 1e9:.1f} | {c.hbm_fraction(copy_gbps):.1%} | {c.matmul_fraction(tflops):.2%} | "
              f"{'' if speedup is None else f'{speedup:.1f}x'} |")
    head = [r for r in rows if r["model"] == "kimi-k3.1-pro-rank" and r["kernels"] != "reference"
            and r["batch"] == 32 and r["context"] == 131072]
    head = sorted(head, key=lambda r: -r["hbm_roofline_fraction"])
    results = {"headline": {"metric": "decode_hbm_roofline_fraction_b32_128k",
                            "value": head[0]["hbm_roofline_fraction"] if head else None, "goal": 0.5},
               "device": torch.cuda.get_device_name(device), "copy_gbps": round(copy_gbps, 1),
               "bf16_tflops": round(tflops, 1), "cells": rows}
    if prefill_cells:
        results["prefill_cells"] = gpu_prefill.print_prefill_table(prefill_cells, copy_gbps, tflops)
        best = [r["bf16_peak_fraction"] for r in results["prefill_cells"] if r["model"] == "kimi-k3.1-pro-rank"
                and r["tokens"] == 32768 and r["kernels"] != "reference"]
        results["prefill_headline"] = {"metric": "prefill_bf16_peak_fraction_32k",
                                       "value": max(best) if best else None, "goal": 0.3}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _tiny_pool(cfg):  # type: ignore[no-untyped-def]
    pool = RowPool(plan_layout(cfg), cfg, 4)
    return pool, pool.allocate_request(64)


if __name__ == "__main__":
    raise SystemExit(main())
