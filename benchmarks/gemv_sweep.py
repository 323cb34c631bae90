"""Sweep the launch parameters of a decode step's weight-streaming kernels on a whole decode step, one GPU.

`--kernel gemv` (default): the one-row `gemv` parameters (engine/fast/gemv.py `TUNE`: BN x BK x programs per SM
x warps x stages); `--kernel expert-gate-up` / `expert-down`: the two routed-expert kernels of few-token steps
(engine/fast/expert_gemv.py `TUNE`: rows per program x K chunk x warps x stages).
A `FastDecoder(compile=True)` step of `--batch` requests at `--context` cached tokens is captured as a CUDA graph
once per setting (the segments are compiled once: the kernels read `TUNE` when they launch, so a new capture
takes the new launch parameters) and replayed; the table gives the median replay per setting, the default
measured first and last. The best setting is what `PDCLUSTER_GEMV_TUNE` / `PDCLUSTER_EXPERT_TUNE` should say
on this GPU (it is written to `--best PATH` in that form).
    python benchmarks/gemv_sweep.py [--kernel gemv|expert-gate-up|expert-down] [--model ...k31_pro_rank.json]
                                    [--context 32768] [--batch 1] [--replays 25] [--budget-s 150]
                                    [--best best.txt] [--json PATH]
Headline: gemv_sweep_best_step_ms (lower is better; goal: below the default's).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import engine.fast.expert_gemv as expert_module  # noqa: E402
import engine.fast.gemv as gemv_module  # noqa: E402
from engine.fast.decoder import FastDecoder  # noqa: E402
from engine.layout import plan_layout  # noqa: E402
from engine.model.config import preset_or_file  # noqa: E402
from engine.model.weights import build_model  # noqa: E402

KERNELS = {
    "gemv": (gemv_module.TUNE, {"one_bn": (16, 32, 8), "one_bk": (256, 512), "one_per_sm": (2, 4, 8),
                                "warps": (4, 8), "stages": (3, 4)}),
    "expert-gate-up": (expert_module.TUNE, {"gu_bi": (1, 2, 4, 8), "gu_bk": (256, 512, 1024), "gu_warps": (2, 4),
                                            "gu_stages": (2, 4)}),
    "expert-down": (expert_module.TUNE, {"dn_bl": (4, 8, 16, 32), "dn_bk": (128, 256), "dn_warps": (2, 4),
                                         "dn_stages": (2, 4)}),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", choices=sorted(KERNELS), default="gemv")
    p.add_argument("--model", default="benchmarks/k31_pro_rank.json")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--replays", type=int, default=25)
    p.add_argument("--budget-s", type=float, default=150.0, help="stop trying new settings after this long")
    p.add_argument("--best", type=Path, help="write the best setting here, as PDCLUSTER_GEMV_TUNE takes it")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gemv_sweep needs a CUDA device")
    spec = importlib.util.spec_from_file_location("gpu_decode", Path(__file__).with_name("gpu_decode.py"))
    gpu = importlib.util.module_from_spec(spec)
    sys.modules["gpu_decode"] = gpu
    spec.loader.exec_module(gpu)
    device = torch.device("cuda")
    cfg = preset_or_file(args.model)
    model = build_model(cfg, device=device)
    layout = plan_layout(cfg)
    batch, context = args.batch, args.context
    table, grid = KERNELS[args.kernel]
    default = dict(table)
    rows: list[dict] = []
    with torch.no_grad():
        bench = gpu.GraphedStepBench(FastDecoder(model, layout, compile=True), cfg, batch, context, device)

        def replay_ms(tune: dict) -> tuple[float, bool]:
            table.clear()
            table.update(tune)
            runner = bench.capture()
            ms = bench.replay_ms(runner, args.replays)
            finite = bool(torch.isfinite(runner.logits).all())
            del runner
            return ms, finite

        started = time.time()
        first_ms, _ = replay_ms(default)
        for values in itertools.product(*grid.values()):
            if time.time() - started > args.budget_s:
                break
            tune = dict(default, **dict(zip(grid, values)))
            ms, finite = replay_ms(tune)
            rows.append({"tune": tune, "ms": ms, "finite": finite})
            print(f"{ms:8.3f} ms  finite={finite}  " + " ".join(f"{k}={tune[k]}" for k in grid), flush=True)
        last_ms, _ = replay_ms(default)
        table.clear()
        table.update(default)
    good = sorted((r for r in rows if r["finite"]), key=lambda r: r["ms"])
    if not good:
        raise SystemExit("no setting gave finite logits")
    best = good[0]
    text = ",".join(f"{k}={v}" for k, v in best["tune"].items())
    print(f"{torch.cuda.get_device_name(device)}: {cfg.name}, batch {batch}, context {context}, {args.kernel}")
    print(f"default {first_ms:.3f} / {last_ms:.3f} ms (first / last); best {best['ms']:.3f} ms: {text}")
    if args.best:
        args.best.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({
            "headline": {"metric": "gemv_sweep_best_step_ms", "value": best["ms"],
                         "goal": f"below the default's {min(first_ms, last_ms):.3f} ms"},
            "device": torch.cuda.get_device_name(device), "kernel": args.kernel, "model": cfg.name, "batch": batch,
            "context": context,
            "default": {"tune": default, "first_ms": first_ms, "last_ms": last_ms}, "settings": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
