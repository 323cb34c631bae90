"""KDA for a prefill of T tokens of one request on its packed KDA row: short conv over the tokens, then the
delta-rule recurrence in chunked form, both starting from and ending in the row's state.

Row addressing (engine/layout.py): head h of KDA layer i of the row's group holds the recurrent state
[d_k, d_v] fp32 at `kda_recurrent_offset(h, i)` and the conv state [3, d, W-1] (`conv_dtype`) right after it.
`kda_state_views` gives both as writable strided views of the pool, so reads and writes need no copies of rows.

`kda_conv_prefill`: the reference's depthwise causal conv + SiLU (engine.model.kda.causal_conv: taps added
oldest first, fp32) over [conv state | T inputs]; the last W-1 inputs become the row's conv state.
`kda_prefill_core`: on CUDA with fla-core installed, `fla.ops.kda.chunk_kda` (chunk 64; its conventions match
engine.model.kda: g is the natural-log decay per channel, beta post-sigmoid, the state [H, d_k, d_v] with
S <- Diag(exp g) S, S <- S + beta k (v - S^T k)^T, o = scale * S^T q; our q is already scaled, so scale = 1; q, k,
v enter in bf16, g, beta and the state in fp32). Otherwise the reference engine's `kda_sequential`: on CUDA
without fla-core the token-by-token Triton recurrence (engine/model/kda_cuda.py), on CPU its torch loop (under the
Triton interpreter fla's autotuned kernels cannot run, and the interpreted recurrence kernel takes ~35 s for 300
tokens of one mini layer).
"""

from __future__ import annotations

import importlib.util

import torch

from engine.layout import RowLayout
from engine.model.kda import causal_conv, kda_sequential


def has_fla() -> bool:
    """True when fla-core (`fla.ops.kda`) is importable."""
    return importlib.util.find_spec("fla") is not None


def kda_state_views(buffer: torch.Tensor, layout: RowLayout, row: int, layer_in_group: int,
                    conv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Writable views of one request's KDA layer state in its row: (recurrent [H, d, d] fp32,
    conv [H, 3, d, W-1] conv_dtype)."""
    heads = layout.kda_heads_per_gpu
    dim = int(round((layout.kda_recurrent_bytes // 4) ** 0.5))
    base = row * layout.row_bytes
    rec = buffer.view(-1).view(torch.float32).as_strided(
        (heads, dim, dim), (layout.kda_head_bytes // 4, dim, 1),
        (base + layout.kda_recurrent_offset(0, layer_in_group)) // 4)
    size = torch.finfo(conv_dtype).bits // 8
    width = layout.kda_conv_bytes // (size * 3 * dim)
    conv = buffer.view(-1).view(conv_dtype).as_strided(
        (heads, 3, dim, width), (layout.kda_head_bytes // size, dim * width, width, 1),
        (base + layout.kda_conv_offset(0, layer_in_group)) // size)
    return rec, conv


def kda_conv_prefill(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, 3*H*d] (channels q | k | v, head-major inside each), weight [3*H*d, W], conv_state the row's view
    [H, 3, d, W-1] -> y [T, 3*H*d] fp32; the view is overwritten with the last W-1 inputs."""
    heads, _, dim, width = conv_state.shape
    state = conv_state.float().permute(3, 1, 0, 2).reshape(width, 3 * heads * dim)  # reference layout [W-1, C]
    y, new_state = causal_conv(x.float(), state, weight.float())
    conv_state.copy_(new_state.view(width, 3, heads, dim).permute(2, 1, 3, 0))
    return y


def kda_prefill_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, use_fla: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v, g [T, H, d] (q scaled), beta [T, H], state [H, d, d] fp32 -> (o [T, H, d] fp32, final state).
    `use_fla`: None = fla's chunked kernel when on CUDA and installed, else `kda_sequential`."""
    if use_fla is None:
        use_fla = q.is_cuda and has_fla()
    if use_fla:
        from fla.ops.kda import chunk_kda  # noqa: PLC0415 - optional dependency, CUDA only

        bf16 = torch.bfloat16
        o, final = chunk_kda(q.to(bf16)[None], k.to(bf16)[None], v.to(bf16)[None], g.float()[None],
                             beta.float()[None], scale=1.0, initial_state=state.float().contiguous()[None],
                             output_final_state=True)
        return o[0].float(), final[0]
    return kda_sequential(q.float(), k.float(), v.float(), g.float(), beta.float(), state.float().contiguous())


def naive_kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: engine.model.kda.kda_sequential on CPU fp32 (the reference engine's prefill)."""
    return kda_sequential(*(t.float().cpu() for t in (q, k, v, g, beta, state)))
