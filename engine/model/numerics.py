"""Batch-invariant numerics shared by every op: padded row blocks, row-block linears, norms, FP8 and Hadamard.

Invariants (what makes every op batch-invariant):
- Every token-wise GEMM runs on a [num_rows, K] input with num_rows a multiple of ROW_BLOCK (16). Measured with
  MKL on one thread: for M >= 16 rows (K <= 512) every row of x @ W^T comes out bit-identical whatever M, the
  row's position and its neighbours; below that MKL takes small-M/GEMV paths with another summation order. So a
  token's hidden state does not depend on which other tokens share its batch. `check_row_invariance` re-checks
  this for given weights (tests run it on every weight of the model).
- Element-wise transcendentals run on tensors whose element count is a multiple of the AVX-512 width, so no
  element falls into a scalar tail loop: with row counts padded to 16 this holds for every width.
- FP8 (e4m3fn) values are stored as raw uint8 bytes; `fp8_to_float` restores them exactly.
- Device: ops create their tensors with torch's default device; `device_scope(device)` makes that the model's
  device for the duration of a forward pass (a no-op on CPU, so the CPU path is untouched).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

ROW_BLOCK = 16
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


def device_scope(device: torch.device | str) -> AbstractContextManager:
    """Factory calls without an explicit device (torch.zeros, arange, tensor, ...) land on `device` inside this
    scope. CPU: a no-op (nothing is intercepted, numerics and speed stay exactly as they were)."""
    device = torch.device(device)
    return nullcontext() if device.type == "cpu" else torch.device(device)


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def pad_to(x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Zero-pad dim 0 of `x` to exactly `num_rows` rows (no copy when already that long)."""
    if x.shape[0] == num_rows:
        return x
    out = x.new_zeros((num_rows,) + tuple(x.shape[1:]))
    out[: x.shape[0]] = x
    return out


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
        assert x.shape[0] % ROW_BLOCK == 0, f"RowLinear needs rows padded to {ROW_BLOCK}, got {x.shape[0]}"
        return x @ self.weight.t()


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


def check_row_invariance(weight: torch.Tensor, max_rows: int = 80, seed: int = 0) -> list[int]:
    """Row counts M (multiples of ROW_BLOCK up to max_rows) for which x[:M] @ W^T differs from the same rows
    computed inside a larger GEMM, or after permuting them. Empty means batch-invariant for this weight."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * max_rows, weight.shape[1], generator=gen)
    full = x @ weight.t()
    bad = []
    for rows in range(ROW_BLOCK, max_rows + 1, ROW_BLOCK):
        perm = torch.randperm(rows, generator=gen)
        if not torch.equal(x[:rows] @ weight.t(), full[:rows]) or not torch.equal(
            x[:rows][perm] @ weight.t(), full[:rows][perm]
        ):
            bad.append(rows)
    return bad


@dataclass(frozen=True)
class Rotary:
    """A rotary embedding's frequencies: plain RoPE (`factor` 1) or YaRN context extension (`factor` > 1: each
    frequency blends its extrapolated value theta^(-2i/r) and its interpolated value / factor along a linear ramp
    over the dims whose wavelengths fit between `beta_fast` and `beta_slow` rotations of `original_context`), and
    the factor cos and sin are multiplied by."""

    theta: float = 10000.0
    factor: float = 1.0
    original_context: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0

    def inv_freq(self, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[dim/2] inverse frequencies."""
        base = self.theta ** (torch.arange(0, dim, 2, dtype=dtype) / dim)
        if self.factor == 1.0:
            return 1.0 / base

        def ramp_dim(rotations: float) -> float:  # the dim whose wavelength makes `rotations` turns
            return dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low = max(math.floor(ramp_dim(self.beta_fast)), 0)
        high = min(math.ceil(ramp_dim(self.beta_slow)), dim - 1)
        span = (high - low) or 0.001
        ramp = ((torch.arange(dim // 2, dtype=dtype) - low) / span).clamp(0, 1)  # 0: extrapolate, 1: interpolate
        return (1.0 / (self.factor * base)) * ramp + (1.0 / base) * (1 - ramp)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_angles(positions: torch.Tensor, dim: int, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, dim/2] of positions [N] (fp32), times the rotary's attention factor."""
    angles = positions.to(torch.float32).unsqueeze(-1) * rotary.inv_freq(dim)
    return angles.cos() * rotary.attention_factor, angles.sin() * rotary.attention_factor


def apply_rope(x: torch.Tensor, positions: torch.Tensor, style: str, rotary: Rotary) -> torch.Tensor:
    """Rotary embedding of x [N, ..., r] at positions [N]. "interleaved" rotates pairs (x_2i, x_2i+1) and returns
    them de-interleaved ([rotated evens | rotated odds]: dot products between two rotated vectors are those of
    the interleaved layout, as DeepSeek's MLA computes them); "half" rotates pairs (x_i, x_{i+r/2}); "none"
    returns x."""
    if style == "none":
        return x
    cos, sin = rope_angles(positions, x.shape[-1], rotary)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def naive_rope(x: torch.Tensor, positions: torch.Tensor, style: str, rotary: Rotary) -> torch.Tensor:
    """Reference: each pair as a complex number times attention_factor * e^(i * angle), float64, pairs put back
    where `apply_rope` puts them."""
    if style == "none":
        return x
    r = x.shape[-1]
    pairs = [(2 * i, 2 * i + 1) if style == "interleaved" else (i, i + r // 2) for i in range(r // 2)]
    inv_freq = rotary.inv_freq(r, torch.float64)
    out = torch.empty(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        for i, (lo, hi) in enumerate(pairs):
            angle = float(positions[n]) * float(inv_freq[i])
            turn = complex(math.cos(angle), math.sin(angle)) * rotary.attention_factor
            z = torch.complex(x[n, ..., lo].double(), x[n, ..., hi].double()) * turn
            out[n, ..., i], out[n, ..., i + r // 2] = z.real, z.imag
    return out.to(torch.float32)


def cache_encode(x: torch.Tensor, fmt: str, scale: float) -> torch.Tensor:
    """Rows [..., C] -> the cached bytes: fp8 (static `scale`, [..., C] uint8) or fp32 (exact, [..., 4C])."""
    if fmt == "fp8":
        return fp8_quantize_static(x, scale)
    return x.to(torch.float32).contiguous().view(torch.uint8)


def cache_decode(raw: torch.Tensor, fmt: str, scale: float) -> torch.Tensor:
    """Cached bytes -> float32 values (the inverse of `cache_encode`; fp8 values times `scale`)."""
    if fmt == "fp8":
        return fp8_to_float(raw) * scale
    return raw.contiguous().view(torch.float32)
