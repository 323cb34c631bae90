"""Batch-invariant numerics shared by every op: padded row blocks, row-block linears, norms, FP8 and Hadamard.

Invariants (research/model.md section 6, recipe R1-R9):
- Every token-wise GEMM runs on a [num_rows, K] input whose row count is a multiple of ROW_BLOCK (64). MKL then
  computes each row with the same kernel whatever its neighbours or position, so a token's hidden state does not
  depend on which other tokens share its batch. (A 1-row GEMM takes a GEMV path with another summation order;
  padding avoids it.) `pad_rows` pads with zeros; callers slice the padding off at the end.
- Element-wise transcendentals run on tensors whose element count is a multiple of the AVX-512 width, so no
  element falls into a scalar tail loop (R8): with row counts padded to 64 this holds for every width.
- FP8 (e4m3fn) values are stored as raw uint8 bytes; `fp8_to_float` restores them exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ROW_BLOCK = 64
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def pad_rows(x: torch.Tensor, multiple: int = ROW_BLOCK) -> torch.Tensor:
    """Zero-pad dim 0 of `x` to a multiple of `multiple` rows (no copy when already aligned)."""
    num_rows = x.shape[0]
    padded = round_up(max(num_rows, 1), multiple)
    if padded == num_rows:
        return x
    out = x.new_zeros((padded,) + tuple(x.shape[1:]))
    out[:num_rows] = x
    return out


class RowLinear(nn.Module):
    """y = x @ W^T on row blocks of ROW_BLOCK rows. Weight layout [out, in] as nn.Linear; no bias."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.shape[0]
        assert num_rows % ROW_BLOCK == 0, f"RowLinear needs rows padded to {ROW_BLOCK}, got {num_rows}"
        lead = x.shape[1:-1]
        flat = x.reshape(num_rows // ROW_BLOCK, -1, self.in_features)
        out = flat @ self.weight.t()
        return out.reshape((num_rows,) + tuple(lead) + (self.out_features,))


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight


def fp8_quantize_static(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-tensor static-scale FP8: bytes of e4m3(clamp(x / scale)). Returns uint8 with x's shape."""
    scaled = (x / scale).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(FP8_DTYPE).view(torch.uint8)


def fp8_to_float(raw: torch.Tensor) -> torch.Tensor:
    """uint8 bytes of e4m3fn values -> float32 (exact)."""
    return raw.view(FP8_DTYPE).to(torch.float32)


def fp8_quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One fp32 scale per vector along the last dim: s = max(|x|, 1e-4) / 448, q = e4m3(x / s).

    Returns (uint8 bytes [..., D], scale float32 [...]). amax is a max reduction, hence exact and order-free.
    """
    amax = x.abs().amax(-1).clamp_min(1e-4)
    scale = amax / FP8_MAX
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
    return q, scale


def hadamard_matrix(dim: int) -> torch.Tensor:
    """Sylvester Hadamard matrix [dim, dim] (dim a power of two) times dim^-1/2, float32."""
    assert dim & (dim - 1) == 0, "Hadamard size must be a power of two"
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(dim)).to(torch.float32)
