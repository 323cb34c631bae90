"""Routed experts of a decode step with few tokens: each (token, slot) pair multiplies its own expert's
matrices, read in place from the stacked expert weights (no gathered copy of them).

`expert_gemv(z, ids, w1, w3, w2)`: z [B, lat] bf16, ids [B, k] expert ids, w1/w3 [E, inter, lat], w2
[E, lat, inter] (bf16) -> out [B, k, lat] bf16 with
    out[b, s] = W2[e] (SiLU(W1[e] z_b) * W3[e] z_b),   e = ids[b, s]
as two kernels: gate/up (one program per (pair, block of BI intermediate rows), both matrices in one pass over
z) and down (one program per (pair, block of BL output rows)). Products accumulate in fp32 and the hidden
vector is rounded to bf16 once (the torch form rounds each GEMM output and the SiLU product to bf16). This is
the decode path when B * k < E (engine/fast/decoder.py); with more pairs every expert is read anyway and the
batched GEMMs over all experts serve better.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.fast.backend import interpreter_active, launch_tuning
from engine.fast.dot import bf16_rne

TUNE = launch_tuning("PDCLUSTER_EXPERT_TUNE", {
    "gu_bi": 1, "gu_bk": 1024, "gu_warps": 4, "gu_stages": 2,  # gate/up: rows per program, K chunk, launch
    "dn_bl": 16, "dn_bk": 128, "dn_warps": 4, "dn_stages": 3,  # down: output rows per program, K chunk, launch
}, os.environ.get("PDCLUSTER_EXPERT_TUNE", ""))
"""Launch parameters; `PDCLUSTER_EXPERT_TUNE` overrides them by name. The gate/up defaults won a sweep of 48
settings (`benchmarks/gemv_sweep.py --kernel expert-gate-up`, the whole graphed pro-rank b1 / 32K step on one
H200): 1.430 ms against 1.468-1.480 ms for the previous 8 rows x 512 (benchmarks/RESULTS.md, 2026-12-04)."""
INTERPRETED_ROWS = 64
"""Rows per program of both kernels under the Triton interpreter, which pays ~10 ms of Python per program: each
row's sum runs over the same K chunks in the same order whatever the rows per program, so the outputs are the
same bits and a CPU test's decode step runs a few dozen programs instead of thousands."""


@triton.jit
def _gate_up_kernel(z_ptr, ids_ptr, w1_ptr, w3_ptr, h_ptr, top_k, inter, lat,
                    BI: tl.constexpr, BK: tl.constexpr):
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BI + tl.arange(0, BI)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    token = pair // top_k
    base = expert * inter * lat + rows[:, None].to(tl.int64) * lat
    acc1 = tl.full([BI], 0.0, tl.float32)
    acc3 = tl.full([BI], 0.0, tl.float32)
    for k0 in range(0, lat, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < lat
        z = tl.load(z_ptr + token * lat + k, mask=kmask, other=0.0).to(tl.float32)
        mask = (rows[:, None] < inter) & kmask[None, :]
        w1 = tl.load(w1_ptr + base + k[None, :], mask=mask, other=0.0).to(tl.float32)
        w3 = tl.load(w3_ptr + base + k[None, :], mask=mask, other=0.0).to(tl.float32)
        acc1 += tl.sum(w1 * z[None, :], axis=1)
        acc3 += tl.sum(w3 * z[None, :], axis=1)
    hidden = acc1 / (1.0 + tl.exp(-acc1)) * acc3
    tl.store(h_ptr + pair * inter + rows, bf16_rne(hidden), mask=rows < inter)


@triton.jit
def _down_kernel(h_ptr, ids_ptr, w2_ptr, out_ptr, inter, lat, BL: tl.constexpr, BK: tl.constexpr):
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BL + tl.arange(0, BL)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    base = expert * lat * inter + rows[:, None].to(tl.int64) * inter
    acc = tl.full([BL], 0.0, tl.float32)
    for k0 in range(0, inter, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < inter
        h = tl.load(h_ptr + pair * inter + k, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(w2_ptr + base + k[None, :], mask=(rows[:, None] < lat) & kmask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * h[None, :], axis=1)
    tl.store(out_ptr + pair * lat + rows, bf16_rne(acc), mask=rows < lat)


def expert_gemv(z: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor) -> torch.Tensor:
    batch, top_k = ids.shape
    experts, inter, lat = w1.shape
    assert z.shape == (batch, lat) and w3.shape == w1.shape and w2.shape == (experts, lat, inter)
    pairs = batch * top_k
    hidden = torch.empty(pairs, inter, dtype=torch.bfloat16, device=z.device)
    out = torch.empty(batch, top_k, lat, dtype=torch.bfloat16, device=z.device)
    flat = ids.reshape(-1).contiguous()
    t = TUNE
    wide = interpreter_active()
    bi = max(t["gu_bi"], INTERPRETED_ROWS) if wide else t["gu_bi"]
    bl = max(t["dn_bl"], INTERPRETED_ROWS) if wide else t["dn_bl"]
    _gate_up_kernel[(pairs, triton.cdiv(inter, bi))](
        z.contiguous(), flat, w1, w3, hidden, top_k, inter, lat, BI=bi, BK=t["gu_bk"],
        num_warps=t["gu_warps"], num_stages=t["gu_stages"])
    _down_kernel[(pairs, triton.cdiv(lat, bl))](
        hidden, flat, w2, out, inter, lat, BL=bl, BK=t["dn_bk"], num_warps=t["dn_warps"],
        num_stages=t["dn_stages"])
    return out


def naive_expert_gemv(z: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                      w2: torch.Tensor) -> torch.Tensor:
    """Reference in fp32: every (token, slot) through its expert, one at a time."""
    batch, top_k = ids.shape
    out = torch.empty(batch, top_k, w2.shape[1], dtype=torch.float32, device=z.device)
    for b in range(batch):
        for s in range(top_k):
            e = int(ids[b, s])
            zb = z[b].float()
            hidden = torch.nn.functional.silu(w1[e].float() @ zb) * (w3[e].float() @ zb)
            out[b, s] = w2[e].float() @ hidden.to(torch.bfloat16).float()
    return out
