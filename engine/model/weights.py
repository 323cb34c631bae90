"""Weights: seeded random init (identical in every process, no files), safetensors save/load, checkpoint
directories (`load_checkpoint`, `save_checkpoint`), `build_model`.

Init rules (parameters visited in sorted-name order with one torch.Generator, so a seed fixes every value):
matrices ~ N(0, (init_std_scale / sqrt(fan_in))^2) with fan_in the last dim; the embedding ~ N(0, 1); norm
weights 1 and biases 0; KDA A_log 0 and dt_bias -3 (mild decay, g ~ -0.25); conv taps ~ N(0, 1/width);
router correction bias ~ U(-0.05, 0.05).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.api import DEFAULT_SEED
from engine.model.checkpoint import OUR_MODEL_TYPE, CheckpointError
from engine.model.config import ModelConfig
from engine.model.loader import fp8_block_size, load_pieces, scan
from engine.model.model import KimiModel
from engine.model.names import engine_pieces, mtp_tensors, public_pieces
from engine.model.shards import WHOLE, ShardSpec, TensorSplit


INIT_CHUNK = 1 << 20
"""Elements drawn per step when a rank fills its shard of a tensor (a multiple of 16, see `_draw_shard`)."""


def init_weights(model: KimiModel, seed: int = DEFAULT_SEED) -> None:
    """Seeded random init (module docstring). A rank's shard (`model.splits`) gets exactly its rows of the whole
    model's values: every tensor's draws are made in full, in the same order, but a sharded one in chunks of which
    only the rank's rows are kept (`_draw_shard`), so no full copy of it is ever allocated."""
    gen = torch.Generator().manual_seed(seed)
    scale = model.cfg.init_std_scale
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            split = model.splits[name]
            shape = split.full_shape
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "correction_bias":
                draw, finish = torch.rand, lambda t: t * 0.1 - 0.05
            elif leaf == "A_log" or leaf == "bias":
                param.zero_()
                continue
            elif leaf == "dt_bias":
                param.fill_(-3.0)
                continue
            elif param.dim() == 1:
                param.fill_(1.0)
                continue
            elif leaf == "conv_weight":
                draw, finish = torch.randn, lambda t, w=shape[-1]: t / math.sqrt(w)
            elif leaf == "embed":
                draw, finish = torch.randn, lambda t: t
            else:
                draw, finish = torch.randn, lambda t, w=shape[-1]: t * (scale / math.sqrt(w))
            if split.is_sharded:
                _draw_shard(param, split, lambda n: finish(draw(n, generator=gen)))
            else:
                param.copy_(finish(draw(shape, generator=gen)))


def _draw_shard(param: torch.Tensor, split: TensorSplit, draw: Callable[[int], torch.Tensor]) -> None:
    """Fill `param` (this rank's rows of a tensor of `split.full_shape`) with its rows of what one `draw` of the
    whole tensor would give, drawing the whole tensor's values in chunks of INIT_CHUNK and keeping the rank's.
    Exact: torch's CPU generators fill a tensor front to back (randn turns each aligned 16 values into normals
    and redraws the last 16 when the size is not a multiple of 16), so chunks that are multiples of 16, the
    last one at least 16 long, continue one stream; tests/engine/test_shards.py checks slices against whole
    draws."""
    total = math.prod(split.full_shape)
    row = math.prod(split.full_shape[1:])
    flat = param.view(-1)
    runs, at = [], 0
    for lo, hi in split.rows:
        runs.append((lo * row, hi * row, at))
        at += (hi - lo) * row
    pos = 0
    while pos < total:
        take = min(INIT_CHUNK, total - pos)
        if total - pos - take < 16:
            take = total - pos
        values = draw(take)
        for lo, hi, dst in runs:
            a, b = max(lo, pos), min(hi, pos + take)
            if a < b:
                flat[dst + a - lo: dst + b - lo].copy_(values[a - pos: b - pos])
        pos += take


def save_weights(model: KimiModel, path: str | Path) -> None:
    tensors = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    save_file(tensors, str(path), metadata={"config": model.cfg.to_json()})


def load_weights(model: KimiModel, path: str | Path) -> None:
    """Fill every parameter from a safetensors file of the whole model (`save_weights`); a rank's shard reads only
    its rows of each tensor."""
    params = dict(model.named_parameters())
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        missing = sorted(set(params) - names)
        unexpected = sorted(names - set(params))
        if missing or unexpected:
            raise ValueError(f"weights file {path} does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, param in params.items():
                split = model.splits[name]
                stored = f.get_slice(name)
                if tuple(stored.get_shape()) != split.full_shape:
                    raise ValueError(f"weights file {path}: {name} has shape {tuple(stored.get_shape())}, "
                                     f"expected {split.full_shape}")
                at = 0
                for lo, hi in split.rows:
                    param[at:at + hi - lo].copy_(stored[lo:hi])
                    at += hi - lo


def load_checkpoint(model: KimiModel, directory: str | Path, zero_copy: bool = True) -> None:
    """Fill every parameter of `model` from the checkpoint directory (engine/model/loader.py: planned and checked
    first, then read tensor by tensor from memory-mapped files into the parameters; `zero_copy` False copies
    even tensors that could be mapped)."""
    raw = json.loads((Path(directory) / "config.json").read_text())
    entries = scan(directory)
    if raw.get("model_type") == OUR_MODEL_TYPE:
        pieces, skipped = engine_pieces(model), set()
    else:
        pieces = public_pieces(model, entries)
        skipped = mtp_tensors(entries, model.cfg.num_layers, int(raw.get("num_nextn_predict_layers") or 0))
    load_pieces(model, pieces, entries, skipped, fp8_block_size(raw.get("quantization_config")), zero_copy)


def save_checkpoint(model: KimiModel, directory: str | Path) -> Path:
    """Write `model` as a `pdcluster_k3` checkpoint directory (config.json with every ModelConfig field,
    model.safetensors in engine names); returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fields = json.loads(model.cfg.to_json())
    fields.pop("checkpoint")
    (directory / "config.json").write_text(json.dumps({"model_type": OUR_MODEL_TYPE, **fields}, indent=2))
    tensors = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def build_model(cfg: ModelConfig, seed: int = DEFAULT_SEED, weights: str | Path | None = None,
                device: torch.device | str = "cpu", shard: ShardSpec = WHOLE) -> KimiModel:
    """A ready model, or with `shard` one rank's shard of it (engine/model/shards.py: only its rows of every
    sharded tensor are ever allocated). `cfg.checkpoint` set: built on `device` without init and filled from the
    checkpoint (seed unused). Otherwise random init from `seed`, then `weights` (safetensors) when given, moved to
    `device`: init and load run on the CPU (one CPU generator), so a seed gives the same values on every device."""
    if cfg.checkpoint is not None:
        if weights is not None:
            raise CheckpointError(f"weights file {weights} given with checkpoint {cfg.checkpoint}: choose one")
        with torch.device(device):
            model = KimiModel(cfg, shard)
        load_checkpoint(model, cfg.checkpoint)
        return model.eval()
    with torch.device("cpu"):
        model = KimiModel(cfg, shard)
        init_weights(model, seed)
        if weights is not None:
            load_weights(model, weights)
    if torch.device(device).type != "cpu":
        model = model.to(device)
    return model.eval()
