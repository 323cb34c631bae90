"""KDA decode on the packed KDA rows: the recurrent step in place (Triton) and the short-conv step.

`kda_recurrent_step` runs one program per (request, head, block of BV value dims): it loads the [d_k, BV] slice
of the fp32 state from the request's KDA row (`layout.kda_recurrent_offset`), applies
    S <- Diag(exp g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
(the reference engine.model.kda.kda_recurrent_step) and stores S back into the row, so the state never leaves
the pool. `kda_conv_qkv_rows` (Triton, what the decode step runs) reads the conv state [3, d, W-1] of each head
from the rows, runs the depthwise causal conv + SiLU and the q/k L2 norms, and writes the shifted window back
(fp32 or bf16 state, as `conv_state_bytes` says); `kda_conv_step` is the same conv in torch, in the reference's
term order (the kernel's reference in the tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.fast.backend import interpreter_active
from engine.fast.dot import bf16_rne
from engine.layout import RowLayout
from engine.model.kda import causal_conv_step, kda_recurrent_step
from engine.model.state import KDAState

BLOCK_V = 32
"""Value dims per program of the recurrent step on a GPU. Under the Triton interpreter, which pays milliseconds of
Python per program, one program takes every head of a request and all its value dims (and the conv kernel every
head of a request's q, k or v): each head's sums run over the same elements in the same order either way, so the
outputs are the same bits, and a CPU test's decode step runs a few programs per layer instead of dozens."""


@triton.jit
def _kda_step_kernel(state_ptr, rows_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
                     row_words, head_words, layer_words, num_heads,
                     D: tl.constexpr, BV: tl.constexpr, HB: tl.constexpr):
    b = tl.program_id(0)
    hh = tl.program_id(1) * HB + tl.arange(0, HB)  # [HB] heads of this program
    vb = tl.program_id(2)
    live = hh < num_heads
    row = tl.load(rows_ptr + b).to(tl.int64)
    base = row * row_words + hh.to(tl.int64) * head_words + layer_words  # [HB]
    kk = tl.arange(0, D)
    vv = vb * BV + tl.arange(0, BV)
    ptrs = state_ptr + base[:, None, None] + kk[None, :, None] * D + vv[None, None, :]
    s = tl.load(ptrs, mask=live[:, None, None], other=0.0)  # [HB, D, BV]
    vec = (b * num_heads + hh) * D  # [HB]
    q = tl.load(q_ptr + vec[:, None] + kk[None, :], mask=live[:, None], other=0.0)  # [HB, D]
    k = tl.load(k_ptr + vec[:, None] + kk[None, :], mask=live[:, None], other=0.0)
    g = tl.load(g_ptr + vec[:, None] + kk[None, :], mask=live[:, None], other=0.0)
    v = tl.load(v_ptr + vec[:, None] + vv[None, :], mask=live[:, None], other=0.0)  # [HB, BV]
    beta = tl.load(beta_ptr + b * num_heads + hh, mask=live, other=0.0)  # [HB]
    s = s * tl.exp(g)[:, :, None]
    ks = tl.sum(k[:, :, None] * s, axis=1)  # [HB, BV]
    u = beta[:, None] * (v - ks)
    s = s + k[:, :, None] * u[:, None, :]
    o = tl.sum(q[:, :, None] * s, axis=1)
    tl.store(ptrs, s, mask=live[:, None, None])
    tl.store(o_ptr + vec[:, None] + vv[None, :], o, mask=live[:, None])


def kda_recurrent_step_rows(buffer: torch.Tensor, layout: RowLayout, rows: torch.Tensor, layer_in_group: int,
                            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor) -> torch.Tensor:
    """One step for B requests whose state sits in KDA rows `rows` [B]: q,k,v,g [B,H,d] fp32, beta [B,H] ->
    o [B,H,d] fp32; the rows' recurrent states are updated in place."""
    batch, heads, dim = q.shape
    assert layout.row_bytes % 4 == 0 and layout.kda_head_bytes % 4 == 0 and dim % BLOCK_V == 0
    out = torch.empty(batch, heads, dim, dtype=torch.float32, device=buffer.device)
    args = [t.float().contiguous() for t in (q, k, v, g)]
    hb, bv = (triton.next_power_of_2(heads), dim) if interpreter_active() else (1, BLOCK_V)
    _kda_step_kernel[(batch, triton.cdiv(heads, hb), dim // bv)](
        buffer.view(-1).view(torch.float32), rows.contiguous(), *args, beta.float().contiguous(), out,
        layout.row_bytes // 4, layout.kda_head_bytes // 4, layout.kda_recurrent_offset(0, layer_in_group) // 4,
        heads, D=dim, BV=bv, HB=hb, num_warps=4,
    )
    return out


def _conv_rows(buffer: torch.Tensor, layout: RowLayout, layer_in_group: int) -> torch.Tensor:
    """Strided view [num_rows, heads, conv_bytes] of one KDA layer's conv state in every row."""
    return buffer.view(-1).as_strided((buffer.shape[0], layout.kda_heads_per_gpu, layout.kda_conv_bytes),
                                      (layout.row_bytes, layout.kda_head_bytes, 1),
                                      layout.kda_conv_offset(0, layer_in_group))


def kda_conv_step(buffer: torch.Tensor, layout: RowLayout, rows: torch.Tensor, layer_in_group: int,
                  x: torch.Tensor, weight: torch.Tensor, conv_dtype: torch.dtype) -> torch.Tensor:
    """Depthwise causal conv + SiLU of one token. x [B, 3*H*d] (channels q | k | v, head-major inside each),
    weight [3*H*d, W]; the conv states of `rows` are read and shifted in place -> y [B, 3*H*d] fp32."""
    batch = x.shape[0]
    heads, width = layout.kda_heads_per_gpu, weight.shape[1]
    dim = x.shape[1] // (3 * heads)
    view = _conv_rows(buffer, layout, layer_in_group)
    state = view[rows].view(conv_dtype).view(batch, heads, 3, dim, width - 1).float()
    window = torch.cat([state, x.float().view(batch, 3, heads, dim).transpose(1, 2).unsqueeze(-1)], dim=-1)
    taps = weight.float().view(3, heads, dim, width).transpose(0, 1)  # [H, 3, d, W]
    acc = window[..., 0] * taps[..., 0]
    for w in range(1, width):  # oldest first, as the reference
        acc = acc + window[..., w] * taps[..., w]
    view[rows] = window[..., 1:].to(conv_dtype).contiguous().view(torch.uint8).view(batch, heads, -1)
    return F.silu(acc).transpose(1, 2).reshape(batch, -1)


@triton.jit
def _kda_conv_kernel(state_ptr, rows_ptr, x_ptr, w_ptr, y_ptr, batch, row_elems, head_elems, conv_off, num_heads,
                     q_scale, D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BF16_STATE: tl.constexpr,
                     HB: tl.constexpr):
    b = tl.program_id(0)
    hh = tl.program_id(1) * HB + tl.arange(0, HB)  # [HB] heads of this program
    part = tl.program_id(2)  # 0 q, 1 k, 2 v
    live = hh < num_heads
    row = tl.load(rows_ptr + b).to(tl.int64)
    i = tl.arange(0, D)
    tap = tl.arange(0, WP)
    ch = part * num_heads * D + hh[:, None] * D + i[None, :]  # [HB, D] channel in x (q | k | v, head-major inside)
    x = tl.load(x_ptr + b * 3 * num_heads * D + ch, mask=live[:, None], other=0.0).to(tl.float32)
    states = (state_ptr + row * row_elems + hh.to(tl.int64)[:, None, None] * head_elems + conv_off
              + (part * D + i)[None, :, None] * (W - 1))  # [HB, D, 1]
    keep = live[:, None, None] & (tap[None, None, :] < W - 1)
    old = tl.load(states + tap[None, None, :], mask=keep, other=0.0).to(tl.float32)  # [HB, D, WP]
    taps = tl.load(w_ptr + ch[:, :, None] * W + tap[None, None, :], mask=keep, other=0.0).to(tl.float32)
    acc = tl.sum(old * taps, axis=2) + x * tl.load(w_ptr + ch * W + W - 1, mask=live[:, None], other=0.0).to(
        tl.float32)
    shifted = tl.where(tap[None, None, :] == W - 2, x[:, :, None], tl.load(
        states + tap[None, None, :] + 1, mask=live[:, None, None] & (tap[None, None, :] < W - 2), other=0.0))
    if BF16_STATE:
        tl.store(states + tap[None, None, :], bf16_rne(shifted), mask=keep)
    else:
        tl.store(states + tap[None, None, :], shifted.to(state_ptr.dtype.element_ty), mask=keep)
    y = acc / (1.0 + tl.exp(-acc))  # SiLU
    norm = tl.rsqrt(tl.sum(y * y, axis=1) + 1e-6)[:, None]  # [HB, 1]: one norm per head
    y = tl.where(part == 0, y * norm * q_scale, tl.where(part == 1, y * norm, y))
    tl.store(y_ptr + (part * batch + b) * num_heads * D + hh[:, None] * D + i[None, :], y, mask=live[:, None])


def kda_conv_qkv_rows(buffer: torch.Tensor, layout: RowLayout, rows: torch.Tensor, layer_in_group: int,
                      x: torch.Tensor, weight: torch.Tensor, conv_dtype: torch.dtype,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kda_conv_step` and the query/key normalisation of the decode step in one kernel: x [B, 3*H*d] (any
    float), weight [3*H*d, W] -> (l2_normalize(q) * d^-1/2, l2_normalize(k), v), each [B, H, d] fp32 and
    contiguous; the conv states of `rows` are shifted in place. The taps are summed in a tree, not the
    reference's oldest-first order (equal within fp32 rounding)."""
    batch = x.shape[0]
    heads, width = layout.kda_heads_per_gpu, weight.shape[1]
    dim = x.shape[1] // (3 * heads)
    size = conv_dtype.itemsize
    assert layout.row_bytes % size == 0 and layout.kda_head_bytes % size == 0 and dim & (dim - 1) == 0
    y = torch.empty(3, batch, heads, dim, dtype=torch.float32, device=buffer.device)
    hb = triton.next_power_of_2(heads) if interpreter_active() else 1
    _kda_conv_kernel[(batch, triton.cdiv(heads, hb), 3)](
        buffer.view(-1).view(conv_dtype), rows, x.contiguous(), weight.contiguous(), y, batch,
        layout.row_bytes // size, layout.kda_head_bytes // size, layout.kda_conv_offset(0, layer_in_group) // size,
        heads, dim**-0.5, D=dim, W=width, WP=triton.next_power_of_2(width), BF16_STATE=conv_dtype == torch.bfloat16,
        HB=hb, num_warps=4,
    )
    return y[0], y[1], y[2]


def naive_kda_decode(state: KDAState, x: torch.Tensor, weight: torch.Tensor, split, g: torch.Tensor,
                     beta: torch.Tensor) -> tuple[torch.Tensor, KDAState]:  # type: ignore[no-untyped-def]
    """Reference: engine.model.kda's conv step and recurrent step on a batched KDAState (fp32)."""
    conv_out, conv_state = causal_conv_step(x, state.conv, weight)
    q, k, v = split(conv_out)
    o, recurrent = kda_recurrent_step(q, k, v, g, beta, state.recurrent)
    return o, KDAState(recurrent, conv_state)
