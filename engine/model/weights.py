"""Weights: seeded random init (identical in every process, no files), safetensors save/load, `build_model`.

Init rules (parameters visited in sorted-name order with one torch.Generator, so a seed fixes every value):
matrices ~ N(0, (init_std_scale / sqrt(fan_in))^2) with fan_in the last dim; the embedding ~ N(0, 1); norm
weights 1 and biases 0; KDA A_log 0 and dt_bias -3 (mild decay, g ~ -0.25); conv taps ~ N(0, 1/width);
router correction bias ~ U(-0.05, 0.05).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.api import DEFAULT_SEED
from engine.model.config import ModelConfig
from engine.model.model import KimiModel


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


def build_model(cfg: ModelConfig, seed: int = DEFAULT_SEED, weights: str | Path | None = None,
                device: torch.device | str = "cpu") -> KimiModel:
    """A ready model: random init from `seed`, then `weights` (safetensors) when given, moved to `device`.

    Init and load always run on the CPU (one CPU generator), so a seed gives the same values on every device."""
    with torch.device("cpu"):
        model = KimiModel(cfg)
        init_weights(model, seed)
        if weights is not None:
            load_weights(model, weights)
    if torch.device(device).type != "cpu":
        model = model.to(device)
    return model.eval()
