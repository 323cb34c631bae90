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

import torch
from safetensors.torch import load_file, save_file

from engine.api import DEFAULT_SEED
from engine.model.checkpoint import OUR_MODEL_TYPE, CheckpointError
from engine.model.config import ModelConfig
from engine.model.loader import fp8_block_size, load_pieces, scan
from engine.model.model import KimiModel
from engine.model.names import engine_pieces, mtp_tensors, public_pieces


def init_weights(model: KimiModel, seed: int = DEFAULT_SEED) -> None:
    gen = torch.Generator().manual_seed(seed)
    scale = model.cfg.init_std_scale
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "correction_bias":
                param.copy_(torch.rand(param.shape, generator=gen) * 0.1 - 0.05)
            elif leaf == "A_log" or leaf == "bias":
                param.zero_()
            elif leaf == "dt_bias":
                param.fill_(-3.0)
            elif param.dim() == 1:
                param.fill_(1.0)
            elif leaf == "conv_weight":
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))
            elif leaf == "embed":
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * (scale / math.sqrt(param.shape[-1])))


def save_weights(model: KimiModel, path: str | Path) -> None:
    tensors = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    save_file(tensors, str(path), metadata={"config": model.cfg.to_json()})


def load_weights(model: KimiModel, path: str | Path) -> None:
    tensors = load_file(str(path))
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(f"weights file {path} does not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, param in params.items():
            if tensors[name].shape != param.shape:
                raise ValueError(f"weights file {path}: {name} has shape {tuple(tensors[name].shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.copy_(tensors[name])


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
                device: torch.device | str = "cpu") -> KimiModel:
    """A ready model. `cfg.checkpoint` set: built on `device` without init and filled from the checkpoint (seed
    unused). Otherwise random init from `seed`, then `weights` (safetensors) when given, moved to `device`:
    init and load run on the CPU (one CPU generator), so a seed gives the same values on every device."""
    if cfg.checkpoint is not None:
        if weights is not None:
            raise CheckpointError(f"weights file {weights} given with checkpoint {cfg.checkpoint}: choose one")
        with torch.device(device):
            model = KimiModel(cfg)
        load_checkpoint(model, cfg.checkpoint)
        return model.eval()
    with torch.device("cpu"):
        model = KimiModel(cfg)
        init_weights(model, seed)
        if weights is not None:
            load_weights(model, weights)
    if torch.device(device).type != "cpu":
        model = model.to(device)
    return model.eval()
