"""The KDA recurrence on CUDA tensors: one Triton kernel for the token-by-token prefill and the decode step.

`kda.kda_sequential` (prefill, token by token) and `kda.kda_recurrent_step` (decode, one token for B requests)
call `kda_recurrence` when their inputs live on a GPU. On the CPU they run their own torch code, unchanged.
Why a kernel: on a GPU the torch form launches about a dozen small kernels per token and layer (a 2,000-token
prompt on kimi-k3.1-mini is ~150k launches per prefill, launch-bound); here each (request, head, block of value
columns) is one program that keeps its [d_k, BV] slice of the state in registers and walks the tokens.

Numerics: the recurrence of `kda.kda_recurrent_step`, in fp32,
    S <- S * exp(g)[:, None];  u = beta * (v - S^T k);  S <- S + k u^T;  o = S^T q.
Prefill (T tokens of one request) and decode (one token of B requests) run the same compiled kernel with the
token count as a runtime argument, so every token goes through the same instructions whatever the split: a
prompt's teacher-forced log-probs equal those served while decoding it, and a prefix resumed from a stored
state (prefix cache, chunked prefill) continues bit for bit. Against the torch form the results differ in the
last bits (another reduction order); tests/engine/test_kda_cuda.py compares them (Triton interpreter on the
CPU, the GPU under the `gpu` marker).
"""

from __future__ import annotations

import torch

_BLOCK_V = 16
"""Value columns per program: d_v / 16 programs per head keep the state slice small enough for registers."""


def _kernel():
    import triton  # noqa: PLC0415 - only where a GPU (or the interpreter) runs it
    import triton.language as tl  # noqa: PLC0415

    @triton.jit
    def kda_recurrence_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_state_ptr, o_ptr, num_tokens,
                              H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr):
        # q, k, v, g, o: [B, T, H, D]; beta: [B, T, H]; state, out_state: [B, H, D, D] (all contiguous, fp32)
        b = tl.program_id(0)
        h = tl.program_id(1)
        rk = tl.arange(0, D)
        rv = tl.program_id(2) * BV + tl.arange(0, BV)
        s_offsets = ((b * H + h) * D + rk[:, None]) * D + rv[None, :]
        s = tl.load(state_ptr + s_offsets)
        for t in range(num_tokens):
            row = (b * num_tokens + t) * H + h
            kt = tl.load(k_ptr + row * D + rk)
            qt = tl.load(q_ptr + row * D + rk)
            gt = tl.load(g_ptr + row * D + rk)
            vt = tl.load(v_ptr + row * D + rv)
            bt = tl.load(beta_ptr + row)
            s = s * tl.exp(gt)[:, None]
            ks = tl.sum(kt[:, None] * s, axis=0)
            u = bt * (vt - ks)
            s = s + kt[:, None] * u[None, :]
            tl.store(o_ptr + row * D + rv, tl.sum(qt[:, None] * s, axis=0))
        tl.store(out_state_ptr + s_offsets, s)

    return kda_recurrence_kernel


_KERNEL = None


def kda_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """B requests of T tokens each. q, k, v, g [B, T, H, d], beta [B, T, H], state [B, H, d, d] (fp32)
    -> (o [B, T, H, d], new state [B, H, d, d]). The input state is not modified."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    batch, num_tokens, heads, dim = q.shape
    if dim % _BLOCK_V or dim & (dim - 1):
        raise ValueError(f"KDA head dim {dim} must be a power of two and a multiple of {_BLOCK_V}")
    shapes = {"k": (k, q.shape), "v": (v, q.shape), "g": (g, q.shape), "beta": (beta, q.shape[:3]),
              "state": (state, (batch, heads, dim, dim))}
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"KDA recurrence: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        if t.dtype != torch.float32:
            raise ValueError(f"KDA recurrence wants fp32 {name}, got {t.dtype}")
    q, k, v, g, beta, state = (t.contiguous() for t in (q, k, v, g, beta, state))
    out = torch.empty_like(q)
    new_state = torch.empty_like(state)
    if batch and heads:
        if num_tokens == 0:
            new_state.copy_(state)
        else:
            _KERNEL[(batch, heads, dim // _BLOCK_V)](q, k, v, g, beta, state, new_state, out, num_tokens,
                                                    H=heads, D=dim, BV=_BLOCK_V)
    return out, new_state
