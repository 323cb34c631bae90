"""`gemv`: y = x @ W^T for a few rows of x (a decode step's batch up to `GEMV_MAX_ROWS`), bf16 weights read once.

At batch 1-8 every linear of a decode step is a matrix-vector product: its time is the time to stream the weight
matrix [N, K] from HBM once. Library GEMMs pick GEMM tiles for these shapes; this kernel is made for them: a
program owns BN output features and a slice of K and streams its [BN, K-slice] weight tile in BK-wide chunks
(contiguous rows, coalesced, no K masks: K is a whole number of chunks). One row sums the products along K in
registers; two to eight rows are padded to 16 and multiplied on tensor cores; both accumulate in fp32. With
several K slices (matrices with few output features: too few programs otherwise) each slice stores its
partial sums and the last slice of a feature block to finish adds them in slice order and writes the output:
one kernel per linear, and results that do not depend on scheduling (a graphed step equals its eager step
bit for bit). The output is rounded once to the weight's dtype, as F.linear rounds.

`gemv` is a torch custom op (`pdcluster::gemv`): torch.compile keeps it as one opaque call inside the compiled
segments (engine/fast/decoder.py) and CUDA graphs capture it like any kernel. The slice counters are one
zeroed buffer per device, shared by calls: calls on one stream only (as a decode step runs). `naive_gemv` is
its reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.fast.backend import interpreter_active, launch_tuning
from engine.fast.dot import bf16_rne, mm

GEMV_MAX_ROWS = 8
"""Batches up to this many rows take `gemv`; larger ones are GEMMs (F.linear)."""
BM = 16  # rows padded to one tensor-core tile (batches of 2-8)


def _tuning(text: str) -> dict[str, int]:
    """The launch parameters: defaults, overridden by `PDCLUSTER_GEMV_TUNE` ("one_bn=32,warps=8": what
    benchmarks/gemv_sweep.py finds best on a new GPU; unknown names are an error)."""
    defaults = {"one_bn": 8, "one_bk": 512, "one_per_sm": 2, "dot_per_sm": 2, "warps": 4, "stages": 4}
    return launch_tuning("PDCLUSTER_GEMV_TUNE", defaults, text)


TUNE = _tuning(os.environ.get("PDCLUSTER_GEMV_TUNE", ""))
INTERPRETED_FEATURES = 256
"""Features per program of a one-row call under the Triton interpreter (~10 ms of Python per program): a feature's
sum runs over the same K chunks and slices in the same order whatever the block of features, so the result is
the same bits with the K slices `plan` chose for the real block."""
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, part_ptr, out_ptr, count_ptr, M, N, k_per_split, x_stride, w_stride,
                 SPLITS: tl.constexpr, ONE_ROW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 INTERPRET: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    w_rows = w_ptr + rn[:, None].to(tl.int64) * w_stride
    k_first = split * k_per_split
    rm = tl.arange(0, BM)
    if ONE_ROW:  # one row: products summed along K in registers, one reduction at the end
        acc1 = tl.full([BN, BK], 0.0, tl.float32)
        for k0 in range(k_first, k_first + k_per_split, BK):
            rk = k0 + tl.arange(0, BK)
            w = tl.load(w_rows + rk[None, :], mask=nmask[:, None], other=0.0)
            xk = bf16_rne(tl.load(x_ptr + rk)).to(tl.float32)  # F.linear's rounding of its input
            acc1 += w.to(tl.float32) * xk[None, :]
        acc = tl.sum(acc1, axis=1)[None, :]  # [1, BN]
        rows = tl.arange(0, 1)
    else:  # 2-8 rows padded to BM: tensor-core dots
        acc = tl.full([BM, BN], 0.0, tl.float32)
        for k0 in range(k_first, k_first + k_per_split, BK):
            rk = k0 + tl.arange(0, BK)
            w = tl.load(w_rows + rk[None, :], mask=nmask[:, None], other=0.0)  # [BN, BK]
            x = tl.load(x_ptr + rm[:, None] * x_stride + rk[None, :], mask=rm[:, None] < M, other=0.0)
            acc += mm(bf16_rne(x), tl.trans(w), INTERPRET)
        rows = rm
    mask = (rows[:, None] < M) & nmask[None, :]
    if SPLITS == 1:
        tl.store(out_ptr + rows[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Each K slice stores its partial sums; the last slice of this block of features to finish (a counter
        # per block) adds them in slice order, so the result does not depend on which slice ran when, and
        # resets the counter for the next call.
        tl.store(part_ptr + (split * M + rows[:, None]).to(tl.int64) * N + rn[None, :], acc, mask=mask)
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLITS - 1:
            total = tl.full(acc.shape, 0.0, tl.float32)
            for s in tl.static_range(SPLITS):
                total += tl.load(part_ptr + (s * M + rows[:, None]).to(tl.int64) * N + rn[None, :], mask=mask,
                                 other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + rows[:, None] * N + rn[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def plan(rows: int, n: int, k: int, num_sms: int = 132) -> tuple[int, int, int]:
    """(BN, BK, K slices) of a call (defaults in `TUNE`): 8 features per program for one row (64 with
    tensor-core dots), 512-wide K chunks for one row where K allows (else 256, 128; 128 with dots), and the
    fewest K slices (each a whole number of chunks) giving about two programs per SM: enough loads in flight
    to stream the matrix at HBM speed. The one-row defaults won a sweep of 72 settings on the whole graphed
    decode step (one H200; benchmarks/RESULTS.md, 2026-12-04)."""
    one = rows == 1
    bn = TUNE["one_bn"] if one else 64
    want = (TUNE["one_per_sm"] if one else TUNE["dot_per_sm"]) * num_sms
    blocks = triton.cdiv(n, bn)
    for bk in ((TUNE["one_bk"], 256, 128) if one else (128,)):
        if k % bk:
            continue
        chunks = k // bk
        for splits in range(1, min(chunks, 64) + 1):
            if chunks % splits == 0 and (blocks * splits >= want or splits == min(chunks, 64)):
                return bn, bk, splits
    raise ValueError(f"gemv needs K a multiple of 128, got {k}")


def supports(k: int) -> bool:
    """Whether `gemv` takes a K of this size (whole 128-wide chunks)."""
    return k % 128 == 0


def _counters(device: torch.device, blocks: int) -> torch.Tensor:
    """Zeroed per-block arrival counters (each call leaves them zero again); kernels of one stream share them."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < blocks:
        have = _COUNTERS[device] = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
    return have


def _launch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    rows, k = x.shape
    n = w.shape[0]
    bn, bk, splits = plan(rows, n, k)
    if rows == 1 and interpreter_active():
        bn = max(bn, INTERPRETED_FEATURES)
    blocks = triton.cdiv(n, bn)
    out = torch.empty(rows, n, dtype=w.dtype, device=x.device)
    part = torch.empty(splits if splits > 1 else 0, rows, n, dtype=torch.float32, device=x.device)
    _gemv_kernel[(blocks, splits)](
        x, w, part, out, _counters(x.device, blocks), rows, n, k // splits, x.stride(0), w.stride(0),
        SPLITS=splits, ONE_ROW=rows == 1, BM=BM, BN=bn, BK=bk, INTERPRET=interpreter_active(),
        num_warps=TUNE["warps"], num_stages=TUNE["stages"],
    )
    return out


@torch.library.custom_op("pdcluster::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS; fp32 or bf16, its rows may be strided), w [N, K] bf16 (rows contiguous)
    -> x @ w^T [M, N] bf16: x rounded to bf16 as it is loaded (no copy kernel), fp32 accumulation, one
    rounding at the end, as F.linear(x.to(w.dtype), w)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.shape[0] > GEMV_MAX_ROWS \
            or not supports(x.shape[1]):
        raise ValueError(f"gemv takes x [M <= {GEMV_MAX_ROWS}, K (a multiple of 128)] and w [N, K], got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    if w.stride(1) != 1 or w.dtype != torch.bfloat16:
        raise ValueError(f"gemv needs a bf16 weight with contiguous rows, got {w.dtype} strides {w.stride()}")
    if x.stride(1) != 1:
        x = x.contiguous()
    return _launch(x, w)


@gemv.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0], dtype=w.dtype)


def naive_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference: the bf16 operands' products summed in float64, rounded once to w's dtype."""
    return (x.to(w.dtype).double() @ w.double().t()).to(w.dtype)
