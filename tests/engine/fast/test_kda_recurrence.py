"""The reference engine's KDA recurrence on CUDA (engine/model/kda_cuda.py) against the torch form it replaces
there (`kda.kda_sequential` / `kda.kda_recurrent_step` on CPU tensors).

Tolerance: 1e-5 relative to the output's scale (fp32 throughout, another reduction order). What must hold
exactly: the kernel's answer for a token does not depend on how the tokens were split into calls (one prefill
call, chunks, or one decode call per token): outputs and states bit-identical. On CPU the kernel runs under the
Triton interpreter; the `gpu` case runs it compiled, through the engine's own `kda_sequential` and
`kda_recurrent_step` dispatch, on kimi-k3.1-mini's shapes.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.kda import kda_recurrent_step, kda_sequential, l2_normalize
from engine.model.kda_cuda import kda_recurrence


def _inputs(batch: int, tokens: int, heads: int = 4, dim: int = 64, seed: int = 0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(batch, tokens, heads, dim, generator=gen)) * dim**-0.5
    k = l2_normalize(torch.randn(batch, tokens, heads, dim, generator=gen))
    v = torch.randn(batch, tokens, heads, dim, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(batch, tokens, heads, dim, generator=gen))
    beta = torch.sigmoid(torch.randn(batch, tokens, heads, generator=gen))
    state = torch.randn(batch, heads, dim, dim, generator=gen) * 0.1
    return [t.to(device) for t in (q, k, v, g, beta, state)]


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> None:
    scale = float(b.abs().max()) or 1.0
    assert float((a - b).abs().max()) <= rtol * scale


def test_prefill_matches_the_torch_recurrence(device) -> None:
    q, k, v, g, beta, state = _inputs(1, 24, device=device)
    o, s = kda_recurrence(q, k, v, g, beta, state)
    ref_o, ref_s = kda_sequential(*(t[0].cpu() for t in (q, k, v, g, beta, state)))
    _close(o[0].cpu(), ref_o)
    _close(s[0].cpu(), ref_s)


def test_decode_batch_matches_the_torch_step(device) -> None:
    q, k, v, g, beta, state = _inputs(3, 1, device=device)
    o, s = kda_recurrence(q, k, v, g, beta, state)
    ref_o, ref_s = kda_recurrent_step(*(t[:, 0].cpu() for t in (q, k, v, g, beta)), state.cpu())
    _close(o[:, 0].cpu(), ref_o)
    _close(s.cpu(), ref_s)


def test_any_split_of_the_tokens_gives_the_same_bits(device) -> None:
    q, k, v, g, beta, state = _inputs(1, 12, seed=3, device=device)
    whole_o, whole_s = kda_recurrence(q, k, v, g, beta, state)
    # two chunks (chunked prefill / a prefix resumed from its stored state)
    o1, s1 = kda_recurrence(*(t[:, :5] for t in (q, k, v, g, beta)), state)
    o2, s2 = kda_recurrence(*(t[:, 5:] for t in (q, k, v, g, beta)), s1)
    assert torch.equal(torch.cat([o1, o2], 1), whole_o) and torch.equal(s2, whole_s)
    # one decode step per token
    s, outs = state, []
    for t in range(12):
        o, s = kda_recurrence(*(x[:, t : t + 1] for x in (q, k, v, g, beta)), s)
        outs.append(o)
    assert torch.equal(torch.cat(outs, 1), whole_o) and torch.equal(s, whole_s)


def test_input_state_is_left_alone_and_bad_input_is_refused(device) -> None:
    q, k, v, g, beta, state = _inputs(1, 3, device=device)
    before = state.clone()
    kda_recurrence(q, k, v, g, beta, state)
    assert torch.equal(state, before)
    with pytest.raises(ValueError, match="fp32"):
        kda_recurrence(q.double(), k, v, g, beta, state)
    with pytest.raises(ValueError, match="power of two"):
        kda_recurrence(*(t[..., :24] for t in (q, k, v, g)), beta, state[..., :24, :24])
    with pytest.raises(ValueError, match="beta has shape"):
        kda_recurrence(q, k, v, g, beta[:, :1], state)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_dispatch_on_cuda_prefill_equals_decode_bit_for_bit() -> None:
    """`kda_sequential` (prefill) and `kda_recurrent_step` (decode) on CUDA tensors: the kernel, equal bit for
    bit to each other, within tolerance of the CPU torch form."""
    q, k, v, g, beta, state = (t[0] for t in _inputs(1, 300, seed=5, device="cuda"))  # one request
    o, s = kda_sequential(q, k, v, g, beta, state)
    step_s, outs = state.unsqueeze(0), []
    for t in range(q.shape[0]):
        o_t, step_s = kda_recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1],
                                         step_s)
        outs.append(o_t)
    assert torch.equal(torch.cat(outs, 0), o) and torch.equal(step_s[0], s)
    ref_o, ref_s = kda_sequential(*(t.cpu() for t in (q, k, v, g, beta, state)))
    _close(o.cpu(), ref_o)
    _close(s.cpu(), ref_s)
