"""The fast kernels (engine/fast, single rank) on checkpoints written by transformers, against the reference model
on the same weights: the checkpoints' semantics (interleaved and half-split rotary, YaRN, dense MLA, a full-rank
query, the softplus KDA gate, MoE without a latent, grouped top-k) through the fused segments and the Triton
kernels (on CPU under the Triton interpreter, see conftest.py).

Both run the fast kernels' cache formats (FP8 latent and FP8 index keys; a checkpoint's default fp32 latent is
refused by the fast path, engine/fast/support.py).
- Segments, fp32, same inputs: the MLA front (rotary, full-rank query, dense MLA) equals `MLA.project` bit for bit;
  the KDA front (softplus gate) and the MoE (no latent, grouped top-k) agree with the reference within 1e-5.
- End to end, a 40-token prompt on 32-token pages (it crosses a page, and the DSA kinds' index_topk of 16 and 32)
  prefilled (all logits), then 3 tokens decoded teacher-forced on the reference's greedy tokens. bf16 (the
  production setting): argmax equal wherever the reference's top-2 margin exceeds 15% of the range. fp32: logits
  within 1e-2 of the range (what is left: the sparse MLA kernel's bf16 queries and probabilities) at every
  position whose attention needs no selection (all of them for a dense MLA; below index_topk for DSA), with
  grouped routing off: the kernel set's small differences move FP8 index-key roundings and router scores near a
  top-k boundary, and on these tiny random models one flipped expert or key moves the logits by 10-30% of their
  range (measured), as FP8 keys against exact scores do (tests/engine/test_checkpoint.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.cache import RowPool, RowSequenceCache
from engine.fast.model import FastModel
from engine.layout import plan_layout
from engine.model.config import resolve_model
from engine.model.weights import build_model
from tests.checkpoints import checkpoint_dir

pytest.importorskip("transformers", reason="transformers writes the test checkpoints")

KINDS = ["kimi-mix", "kimi-dense-shared", "dsv32-topk", "dsv32-yarn"]
PROMPT_TOKENS = 40
SUBBLOCK_TOKENS = 32
DECODE_STEPS = 3


def _reference(model, cfg, layout, tokens: torch.Tensor):  # type: ignore[no-untyped-def]
    """(all prefill logits [T, V], decode logits [S, V], the greedy tokens fed to the decode steps)."""
    pool = RowPool(layout, cfg, 8)
    table = pool.allocate_request(PROMPT_TOKENS + DECODE_STEPS + 1)
    cache = RowSequenceCache(pool, table)
    with torch.no_grad():
        prefill = model.prefill(tokens, cache, all_logits=True)
        fed, steps = [int(prefill[-1].argmax())], []
        for step in range(DECODE_STEPS):
            logits = model.decode(torch.tensor(fed[-1:]), [PROMPT_TOKENS + step], [cache])[0]
            steps.append(logits)
            fed.append(int(logits.argmax()))
    return prefill, torch.stack(steps), fed


def _check(got: torch.Tensor, want: torch.Tensor, tight: bool, what: str, rows: int | None = None) -> None:
    span = float(want.max() - want.min())
    if tight:
        err = float((got[:rows] - want[:rows]).abs().max()) / span
        assert err <= 1e-2, f"{what}: fast logits differ by {err:.2e} of the range"
        return
    top2 = want.topk(2, dim=-1).values
    sure = (top2[..., 0] - top2[..., 1]) > 0.15 * span
    assert torch.equal(got.argmax(-1)[sure], want.argmax(-1)[sure]), f"{what}: greedy tokens differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_fast_kernels_match_reference_on_checkpoint(kind: str, dtype: torch.dtype, device) -> None:  # noqa: ANN001
    tight = dtype == torch.float32
    cfg = dataclasses.replace(resolve_model(str(checkpoint_dir(kind))), latent_dtype="fp8")
    if tight:
        cfg = dataclasses.replace(cfg, num_expert_groups=1, topk_groups=1)
    model, layout = build_model(cfg), plan_layout(cfg, subblock_tokens=SUBBLOCK_TOKENS)
    tokens = torch.randint(3, cfg.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(9))
    want_prefill, want_steps, fed = _reference(model, cfg, layout, tokens)
    fast = FastModel(model.to(device), layout, dtype)
    pool = RowPool(layout, cfg, 8, device=device)
    cache = RowSequenceCache(pool, pool.allocate_request(PROMPT_TOKENS + DECODE_STEPS + 1))
    unselected = None if not cfg.dsa_indexer else cfg.index_topk
    got = fast.prefill(tokens.to(device), cache, all_logits=True).cpu()
    _check(got, want_prefill, tight, f"{kind} prefill", unselected)
    if tight and cfg.dsa_indexer:
        return  # every decode step attends a selection
    for step in range(DECODE_STEPS):
        got = fast.decode(torch.tensor(fed[step:step + 1], device=device), [PROMPT_TOKENS + step], [cache])[0].cpu()
        _check(got, want_steps[step], tight, f"{kind} decode step {step}")


def _fast_and_reference(kind: str):  # type: ignore[no-untyped-def]
    from engine.fast.decoder import FastDecoder

    cfg = dataclasses.replace(resolve_model(str(checkpoint_dir(kind))), latent_dtype="fp8")
    model = build_model(cfg)
    return cfg, model, FastDecoder(model, plan_layout(cfg), torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_segments_follow_the_checkpoint_semantics(kind: str) -> None:
    """fp32 segments against the reference modules on the same rows (positions 40..71)."""
    from engine.fast.decoder import _kda_front, _moe_all_experts, _moe_out, _moe_route, _mla_front

    cfg, model, dec = _fast_and_reference(kind)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(32, cfg.d_model, generator=gen)
    positions = torch.arange(40, 72)
    for layer, packed in zip(model.layers, dec.layers):
        m, h = packed.mixer, layer.mixer_norm(x)
        if layer.is_mla:
            gate, q_abs, latent, key, key_scale, qi, weights = _mla_front(x, *m["front"], positions=positions,
                                                                           **m["front_const"])
            proj = layer.mixer.project(h, positions)
            assert torch.equal(latent, proj.latent_bytes) and torch.equal(q_abs, proj.q_absorbed)
            assert torch.equal(key, proj.index_key_bytes) and torch.equal(key_scale, proj.index_key_scale)
            assert torch.equal(qi, proj.index_queries.q) and torch.equal(weights, proj.index_queries.weights)
        else:
            gate, g, beta, _ = _kda_front(x, *m["front"], **m["front_const"])
            proj = layer.mixer.project(h)
            torch.testing.assert_close(g, proj.g, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(beta, proj.beta, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(gate, torch.sigmoid(proj.gate_out), rtol=1e-5, atol=1e-6)
        if packed.dense:
            continue
        f = packed.ffn
        shared, ids, weights, z = _moe_route(x, f["norm"], f["router"], f["bias"], f["w_h"], cfg.rms_eps,
                                             cfg.num_experts_per_tok, cfg.routed_scaling_factor, f["latent"],
                                             **dec.route_const)
        want_ids, want_weights = layer.ffn.route(layer.ffn_norm(x))
        assert torch.equal(ids.sort(-1).values, want_ids)
        mixed = _moe_all_experts(z, ids, weights, f["w1"], f["w3"], f["w2"])
        got = _moe_out(x, shared, mixed, None, f["latent_norm"], f["w_up_latent"], f["shared_down"], cfg.rms_eps)
        torch.testing.assert_close(got - x, layer.ffn(layer.ffn_norm(x)), rtol=1e-5, atol=1e-5)


def test_fast_path_refuses_what_it_lacks() -> None:
    """fp32 caches on any rank count, checkpoint semantics under TP/DCP: refused by name."""
    from engine.fast.support import fast_unsupported

    cfg = resolve_model(str(checkpoint_dir("dsv32-topk")))
    assert "latent_dtype fp32" in fast_unsupported(cfg)
    fp8 = dataclasses.replace(cfg, latent_dtype="fp8")
    assert fast_unsupported(fp8) is None
    reason = fast_unsupported(fp8, "tp")
    assert "under tp" in reason and "mla_rope interleaved" in reason and "grouped top-k" in reason
