"""Where the GPU time of one graphed decode step goes, per kernel, and how fast each linear streams its weight.

A `FastDecoder(compile=True)` step of `--batch` requests at `--context` cached tokens is captured as a CUDA graph
(as `benchmarks/engine.py`'s fast+compile+graph row) and `--replays` replays run under torch.profiler (CUPTI
sees the kernels inside a graph). The table groups kernels by name: launches and GPU microseconds per step,
sorted by time; below it the step's kernel count, GPU busy time (the sum of kernel times) and span (first
kernel start to last kernel end), medians over the replays. With `--linears` every distinct weight shape of
the step's linears is also timed alone (`gemv` for up to 8 rows, else F.linear) in a CUDA graph that walks
enough copies of the matrix to leave L2 cold, giving the GB/s each shape reaches against the copy bandwidth
measured in the same run. Each `--variant "module.NAME=int,..."` (module constants, e.g.
"engine.fast.mla.MIN_SPLIT_KEYS=64" or "engine.fast.expert_gemv.TUNE.gu_bi=2" for a key of a TUNE dict) is
captured again with those values and profiled the same way, after the plain tree: the table then has one
column per variant, and every variant's replay time (median of --replays unprofiled replays) is printed.
    python benchmarks/profile_step.py [--model benchmarks/k31_pro_rank.json] [--context 32768] [--batch 1]
                                      [--replays 10] [--linears] [--variant SPEC ...] [--json PATH]
Headline: profile_step_gpu_busy_us (lower is better; goal: below the 1,500 us bound of a b1 step).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import importlib.util
import json
import statistics
import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.fast.decoder import FastDecoder, gemv_kernels  # noqa: E402
from engine.fast.gemv import GEMV_MAX_ROWS, gemv  # noqa: E402
from engine.fast.graphs import GraphedDecode  # noqa: E402
from engine.layout import plan_layout  # noqa: E402
from engine.model.config import preset_or_file  # noqa: E402
from engine.model.weights import build_model  # noqa: E402


def _gpu_decode():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gpu_decode", Path(__file__).with_name("gpu_decode.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_decode"] = module
    spec.loader.exec_module(module)
    return module


def _kernel_events(prof) -> list:  # type: ignore[no-untyped-def]
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and e.device_time > 0 and "Memcpy" not in e.name and "Memset" not in e.name),
                  key=lambda e: e.time_range.start)


def profile_replays(runner: GraphedDecode, replays: int) -> tuple[list[dict], dict]:
    """Per-kernel-name rows (launches and us per step) and the step's totals (medians over the replays)."""
    from torch.profiler import ProfilerActivity, profile

    steps = []
    for _ in range(replays):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.graph.replay()
            torch.cuda.synchronize()
        steps.append(_kernel_events(prof))
    steps = [s for s in steps if s]
    if not steps:
        raise SystemExit("the profiler saw no kernels in the graph replays (CUPTI unavailable?)")
    per_name: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)
    for events in steps:
        by = collections.Counter()
        count = collections.Counter()
        for e in events:
            by[e.name] += e.device_time
            count[e.name] += 1
        for name in by:
            per_name[name].append((count[name], by[name]))
    rows = [{"kernel": name, "launches": statistics.median(c for c, _ in vals),
             "us": statistics.median(t for _, t in vals)} for name, vals in per_name.items()]
    rows.sort(key=lambda r: -r["us"])
    totals = {
        "kernels": statistics.median(len(s) for s in steps),
        "busy_us": statistics.median(sum(e.device_time for e in s) for s in steps),
        "span_us": statistics.median(s[-1].time_range.end - s[0].time_range.start for s in steps),
    }
    return rows, totals


@contextlib.contextmanager
def overrides(spec: str):  # type: ignore[no-untyped-def]
    """Set module constants (or keys of module-level dicts) named in `spec` for the block, then restore them."""
    undo = []
    try:
        for item in filter(None, (part.strip() for part in spec.split(","))):
            path, _, value = item.partition("=")
            parts = path.split(".")
            for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
                try:
                    target = importlib.import_module(".".join(parts[:cut]))
                    break
                except ImportError:
                    continue
            else:
                raise SystemExit(f"--variant {item!r}: no module in {path!r}")
            names = parts[cut:]
            for name in names[:-1]:
                target = getattr(target, name)
            key, new = names[-1], int(value)
            if isinstance(target, dict):
                if key not in target:
                    raise SystemExit(f"--variant {item!r}: {key!r} is not one of {sorted(target)}")
                undo.append((target.__setitem__, key, target[key]))
                target[key] = new
            else:
                if not hasattr(target, key):
                    raise SystemExit(f"--variant {item!r}: {target.__name__} has no {key}")
                undo.append((lambda k, v, t=target: setattr(t, k, v), key, getattr(target, key)))
                setattr(target, key, new)
        yield
    finally:
        for setter, key, old in reversed(undo):
            setter(key, old)


def time_linears(decoder: FastDecoder, batch: int, device: torch.device, copy_gbps: float) -> list[dict]:
    """Each distinct weight shape of the step's linears timed alone, L2 cold (see the module doc)."""
    shapes = collections.Counter()
    for layer in decoder.layers:
        for group in (layer.mixer, layer.ffn):
            for value in group.values():
                for t in (value if isinstance(value, tuple) else (value,)):
                    if isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype == torch.bfloat16 \
                            and t.shape[1] % 128 == 0:
                        shapes[tuple(t.shape)] += 1
    shapes[tuple(decoder.lm_head.shape)] += 1
    rows = []
    for (n, k), uses in sorted(shapes.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[1]):
        nbytes = n * k * 2
        copies = max(2, -(-(256 << 20) // nbytes))
        weights = [torch.randn(n, k, device=device).to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn(batch, k, device=device)
        fn = gemv if batch <= GEMV_MAX_ROWS else (lambda a, w: F.linear(a.to(w.dtype), w))
        with gemv_kernels():
            for w in weights[:2]:
                fn(x, w)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for w in weights:
                    fn(x, w)
        times = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / copies)
        us = statistics.median(times)
        rows.append({"shape": [n, k], "uses_per_step": uses, "mb": nbytes / 1e6, "us": us,
                     "gbps": nbytes / us / 1e3, "copy_fraction": nbytes / us / 1e3 / copy_gbps})
        del weights, graph
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="benchmarks/k31_pro_rank.json")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--top", type=int, default=40, help="kernel names printed")
    p.add_argument("--linears", action="store_true", help="also time every linear's weight shape alone")
    p.add_argument("--variant", action="append", default=[], help="module constants to set for another capture")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_step needs a CUDA device")
    gpu = _gpu_decode()
    device = torch.device("cuda")
    cfg = preset_or_file(args.model)
    model = build_model(cfg, device=device)
    layout = plan_layout(cfg)
    batch, context = args.batch, args.context
    with torch.no_grad():
        decoder = FastDecoder(model, layout, compile=True)
        bench = gpu.GraphedStepBench(decoder, cfg, batch, context, device)
        results = []
        for spec in ["", *args.variant]:
            with overrides(spec):
                runner = bench.capture()
                torch.cuda.synchronize()
                rows, totals = profile_replays(runner, args.replays)
                totals["replay_ms"] = bench.replay_ms(runner, 3 * args.replays)
                totals["finite"] = bool(torch.isfinite(runner.logits).all())
                results.append({"variant": spec or "(tree)", "rows": rows, "totals": totals})
                del runner
        copy_gbps = gpu.copy_bandwidth_gbps(device) if args.linears else None
        linears = time_linears(decoder, batch, device, copy_gbps) if args.linears else []
    name = torch.cuda.get_device_name(device)
    print(f"{name}: {cfg.name}, batch {batch}, context {context}, graphed compiled step, median of "
          f"{args.replays} profiled replays")
    names = sorted({r["kernel"] for res in results for r in res["rows"]},
                   key=lambda n: -max(next((r["us"] for r in res["rows"] if r["kernel"] == n), 0.0) for res in results))
    for i, res in enumerate(results):
        print(f"[{i}] {res['variant']}")
    print("  ".join(f"[{i}] us  n" for i in range(len(results))) + "  kernel")
    for name in names[: args.top]:
        cells = []
        for res in results:
            r = next((r for r in res["rows"] if r["kernel"] == name), None)
            cells.append(f"{r['us']:7.1f} {r['launches']:3.0f}" if r else f"{'-':>7} {'':3}")
        print("  ".join(cells) + f"  {name[:100]}")
    for i, res in enumerate(results):
        t = res["totals"]
        print(f"[{i}] kernels/step {t['kernels']:.0f}, GPU busy {t['busy_us']:.1f} us, span {t['span_us']:.1f} us, "
              f"replay {t['replay_ms']:.3f} ms, finite {t['finite']}  ({res['variant']})")
    if linears:
        print(f"\nlinears alone (copy bandwidth {copy_gbps:.0f} GB/s in this run):")
        print(f"{'shape':>14} {'uses':>5} {'MB':>7} {'us':>7} {'GB/s':>6} {'of copy':>7}")
        for r in linears:
            print(f"{'x'.join(map(str, r['shape'])):>14} {r['uses_per_step']:5d} {r['mb']:7.1f} {r['us']:7.1f} "
                  f"{r['gbps']:6.0f} {r['copy_fraction']:7.1%}")
    if args.json:
        args.json.write_text(json.dumps({
            "headline": {"metric": "profile_step_gpu_busy_us", "value": results[0]["totals"]["busy_us"],
                         "goal": "below 1500 us (the b1 step bound)"},
            "device": name, "model": cfg.name, "batch": batch, "context": context, "results": results,
            "copy_gbps": copy_gbps, "linears": linears}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
