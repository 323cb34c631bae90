"""Checkpoint load benchmark: load time and peak resident memory of `build_model` on a generated ~2 GB checkpoint,
against reading the same files (`cat > /dev/null`, page cache warm).

The checkpoint is a `pdcluster_k3` directory (engine tensor names, fp32, sharded with model.safetensors.index.json)
of a scaled-up kimi-k3.1-mini; it is generated once into --dir (kept between runs). Each measurement runs in a
fresh process: `cat` of every shard (best of --rounds, after one warming read), and `build_model` of the
checkpoint (best of --rounds) in two modes (`MODES`: as served, where tensors stored as the parameters want them
are mapped, and copying every tensor), whose peak RSS (VmHWM) is reported whole and above the same process's RSS
after importing torch (the interpreter's own). Headline: peak RSS / weight bytes as served (goal <= 1.2); the
table and JSON also give load rate / read rate (goal >= 0.5).

    python benchmarks/load.py [--dir /tmp/pdcluster-load-ckpt] [--gb 2] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/ (the script's folder, first on the path) holds an engine.py that would shadow the engine package
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT / "benchmarks")]

SHARD_BYTES = 512 << 20


def scaled_config(gb: float):  # noqa: ANN201
    """kimi-k3.1-mini widened until its fp32 weights are about `gb` GB."""
    from engine.model.config import get_preset

    base = dataclasses.replace(get_preset("kimi-k3.1-mini"), name="load-bench", d_model=1024, vocab_size=32768,
                               moe_latent_dim=512, moe_intermediate=512, shared_intermediate=1024,
                               dense_intermediate=4096, q_lora_rank=256, kv_lora_rank=128)
    per_expert = 3 * 512 * 512 * 4
    fixed = _param_bytes(dataclasses.replace(base, num_experts=8, num_experts_per_tok=4))
    moe_layers = base.num_layers - base.first_dense_layers
    experts = max(8, int((gb * 1e9 - fixed) / (per_expert * moe_layers)) // 8 * 8 + 8)
    return dataclasses.replace(base, num_experts=experts).validate()


def _param_bytes(cfg) -> int:  # noqa: ANN001
    import torch

    from engine.model.model import KimiModel

    with torch.device("meta"):
        model = KimiModel(cfg)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def generate(directory: Path, gb: float) -> None:
    """Write the checkpoint (random weights, tensor by tensor into shards) unless it is already there."""
    import torch
    from safetensors.torch import save_file

    from engine.model.checkpoint import OUR_MODEL_TYPE
    from engine.model.model import KimiModel

    if (directory / "model.safetensors.index.json").is_file():
        return
    directory.mkdir(parents=True, exist_ok=True)
    cfg = scaled_config(gb)
    with torch.device("meta"):
        shapes = [(name, p.shape) for name, p in KimiModel(cfg).named_parameters()]
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, size, index = {}, {}, 0, 0

    def flush() -> None:
        nonlocal shard, size, index
        if shard:
            index += 1
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(directory / name))
            weight_map.update({t: name for t in shard})
            shard, size = {}, 0

    for name, shape in shapes:
        tensor = torch.randn(shape, generator=gen) * 0.02
        shard[name] = tensor
        size += tensor.numel() * 4
        if size >= SHARD_BYTES:
            flush()
    flush()
    fields = json.loads(cfg.to_json())
    fields.pop("checkpoint")
    (directory / "config.json").write_text(json.dumps({"model_type": OUR_MODEL_TYPE, **fields}, indent=2))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


LOAD_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[2])
import torch
from engine.model.config import resolve_model
from engine.model.model import KimiModel
from engine.model.weights import build_model, load_checkpoint

def hwm():  # VmHWM: this process's own peak (ru_maxrss would carry the parent's over the fork)
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))

base = hwm()
cfg = resolve_model(sys.argv[1])
start = time.perf_counter()
if sys.argv[3] == "zero-copy":
    model = build_model(cfg)
else:
    model = KimiModel(cfg)
    load_checkpoint(model, cfg.checkpoint, zero_copy=False)
seconds = time.perf_counter() - start
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"seconds": seconds, "peak_rss": hwm(), "base_rss": base, "weight_bytes": weights}))
"""
MODES = ("zero-copy", "copy")
"""zero-copy: build_model as served (tensors stored as the CPU parameters want them become mapped storage);
copy: every tensor copied into allocated parameters (the path of converted, sliced or device tensors)."""


def measure_load(directory: Path, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(directory), str(ROOT), mode], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_read(files: list[Path]) -> float:
    start = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("/tmp/pdcluster-load-ckpt"))
    p.add_argument("--gb", type=float, default=2.0, help="approximate checkpoint size in GB (default 2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from engine.model.checkpoint import weight_files

    generate(args.dir, args.gb)
    files = weight_files(args.dir)
    file_bytes = sum(f.stat().st_size for f in files)
    measure_read(files)  # warm the page cache
    reads, loads = [], {mode: [] for mode in MODES}
    for _ in range(args.rounds):  # interleaved, so both see the same neighbours on a shared machine
        reads.append(measure_read(files))
        for mode in MODES:
            loads[mode].append(measure_load(args.dir, mode))
    read_s = min(reads)
    rows = [("checkpoint files", f"{len(files)} shards, {file_bytes / 1e9:.3f} GB"),
            ("read (cat > /dev/null, warm)", f"{read_s:.3f} s = {file_bytes / read_s / 1e9:.2f} GB/s")]
    summary = {}
    for mode in MODES:
        best = min(loads[mode], key=lambda r: r["seconds"])
        weights, peak = best["weight_bytes"], max(r["peak_rss"] for r in loads[mode])
        base = min(r["base_rss"] for r in loads[mode])
        summary[mode] = {"load_s": [r["seconds"] for r in loads[mode]], "rate_over_read": read_s / best["seconds"],
                         "peak_rss": peak, "rss_after_torch_import": base, "peak_over_weights": peak / weights,
                         "weight_bytes": weights}
        rows += [(f"{mode}: load (build_model)", f"{best['seconds']:.3f} s = "
                  f"{file_bytes / best['seconds'] / 1e9:.2f} GB/s = {read_s / best['seconds']:.2f} x read (goal >= 0.5)"),
                 (f"{mode}: peak RSS", f"{peak / 1e9:.3f} GB = {peak / weights:.2f} x the {weights / 1e9:.3f} GB of "
                  f"weights (goal <= 1.2); {base / 1e9:.3f} GB after importing torch, "
                  f"{(peak - base) / weights:.2f} x above it")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    served = summary["zero-copy"]
    headline = {"metric": "load_peak_rss_over_weight_bytes", "value": round(served["peak_over_weights"], 3),
                "goal": 1.2}
    print("\nheadline:", json.dumps(headline))
    if args.json:
        args.json.write_text(json.dumps({
            "headline": headline,
            "load_rate_over_read_rate": {"value": round(served["rate_over_read"], 3), "goal": 0.5},
            "file_bytes": file_bytes, "read_s": reads, "modes": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
