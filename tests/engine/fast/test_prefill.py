"""The fast prefill (engine/fast/prefill.py) end to end against the reference `KimiModel.prefill`, on mini's
structure with index_topk 32 (so that prompts of ~100 tokens exercise the indexer's selection on CPU through the
Triton interpreter in seconds).

- fp32 weights and activations: last-token logits within 1e-2 of their range; the pool rows then decode (reference
  decode) to the same greedy tokens as the reference prefill's rows for every prompt.
- bf16 (the production setting): greedy tokens after the prefill are reported (agreement printed), and the first
  token must agree where the reference's top-2 margin is over 15% of the logit range (as the decode test).
- start > 0: a prompt prefilled in two chunks gives the logits of one prefill (fp32, 1e-2 of the range).
- FastModel.prefill takes the fast path on a RowSequenceCache on the model's device.

The prompts: 20 tokens (every query keeps every key), 64 (selects; ends on a KDA chunk and a sub-block boundary),
90 (crosses both). The fp32 fast prefills are computed once (`fast_fp32`) for the first and the chunked test.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.cache import RowPool, RowSequenceCache
from engine.fast.model import FastModel
from engine.fast.prefill import FastPrefiller
from engine.layout import plan_layout
from engine.model.config import get_preset
from engine.model.weights import build_model

TINY = dataclasses.replace(get_preset("kimi-k3.1-mini"), name="mini-topk32", index_topk=32)
PROMPTS = [20, 64, 90]
DECODE_STEPS = 4


def _greedy(model, pool: RowPool, table, length: int, first: torch.Tensor) -> list[int]:  # type: ignore[no-untyped-def]
    tokens = [int(first.argmax())]
    cache = RowSequenceCache(pool, table)
    with torch.no_grad():
        for step in range(DECODE_STEPS):
            logits = model.decode(torch.tensor(tokens[-1:]), [length + step], [cache])
            tokens.append(int(logits[0].argmax()))
    return tokens


@pytest.fixture(scope="module")
def reference():  # type: ignore[no-untyped-def]
    """The model, layout and per prompt: (tokens, reference logits, reference greedy tokens)."""
    model, layout = build_model(TINY), plan_layout(TINY)
    gen = torch.Generator().manual_seed(11)
    cases = []
    for n in PROMPTS:
        pool = RowPool(layout, TINY, 8)
        table = pool.allocate_request(n + DECODE_STEPS + 1)
        tokens = torch.randint(0, 256, (n,), generator=gen)
        with torch.no_grad():
            logits = model.prefill(tokens, RowSequenceCache(pool, table))
        cases.append((tokens, logits, _greedy(model, pool, table, n, logits[0])))
    return model, layout, cases


def _fast_prefills(reference, dtype, device):  # type: ignore[no-untyped-def]
    """Per prompt: (pool, table, fast prefill logits) of a fresh pool."""
    model, layout, cases = reference
    prefiller = FastPrefiller(model.to(device), layout, dtype)
    out = []
    for tokens, _, _ in cases:
        pool = RowPool(layout, TINY, 8, device=device)
        table = pool.allocate_request(tokens.shape[0] + DECODE_STEPS + 1)
        logits = prefiller.prefill(pool.buffer, tokens.to(device), table.attn_row_ids, table.kda_row_ids).cpu()
        out.append((pool, table, logits))
    return out


@pytest.fixture(scope="module")
def fast_fp32(reference, device):  # type: ignore[no-untyped-def]
    """`_fast_prefills` in fp32, shared by the tests that read them (each copies a pool before writing to it)."""
    return _fast_prefills(reference, torch.float32, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fast_prefill_then_decode_matches_reference(reference, dtype, device, request):  # type: ignore[no-untyped-def]
    model, layout, cases = reference
    is_fp32 = dtype == torch.float32
    fast = request.getfixturevalue("fast_fp32") if is_fp32 else _fast_prefills(reference, dtype, device)
    agree = total = 0
    for (tokens, ref_logits, ref_tokens), (shared_pool, table, logits) in zip(cases, fast):
        n = tokens.shape[0]
        pool = _copy(shared_pool)
        span = float(ref_logits.max() - ref_logits.min())
        top2 = ref_logits[0].topk(2).values
        if dtype == torch.float32:
            torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-2 * span)
        elif float(top2[0] - top2[1]) > 0.15 * span:
            assert int(logits.argmax()) == ref_tokens[0]
        got = _greedy(model.cpu(), pool, table, n, logits[0])
        model.to(device)
        agree += sum(a == b for a, b in zip(got, ref_tokens))
        total += len(ref_tokens)
        if dtype == torch.float32:
            assert got == ref_tokens, (n, got, ref_tokens)
    print(f"greedy tokens after the fast prefill ({dtype}), reference decode: {agree}/{total} agree")


def _copy(pool: RowPool) -> RowPool:
    """A CPU pool holding the pool's bytes, for the reference decode to write into the rows its table holds."""
    copy = RowPool(pool.layout, TINY, pool.num_rows)
    copy.buffer.copy_(pool.buffer.cpu())
    return copy


def test_chunked_fast_prefill_matches_one_prefill(reference, fast_fp32, device):  # type: ignore[no-untyped-def]
    model, layout, cases = reference
    prefiller = FastPrefiller(model.to(device), layout, torch.float32)
    tokens = cases[2][0].to(device)  # 90 tokens: the second chunk's queries all select
    whole = fast_fp32[2][2]
    pool = RowPool(layout, TINY, 8, device=device)
    table = pool.allocate_request(tokens.shape[0] + 1)
    prefiller.prefill(pool.buffer, tokens[:53], table.attn_row_ids, table.kda_row_ids)
    split = prefiller.prefill(pool.buffer, tokens[53:], table.attn_row_ids, table.kda_row_ids, start=53).cpu()
    span = float(whole.max() - whole.min())
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-2 * span)


def test_fast_model_prefill_takes_the_fast_path(reference, device, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model, layout, cases = reference
    fast = FastModel(model.to(device), layout, torch.float32)
    monkeypatch.setattr(model, "prefill", lambda *a, **k: pytest.fail("the reference prefill ran"))
    pool = RowPool(layout, TINY, 8, device=device)
    tokens, ref_logits, _ = cases[0]
    table = pool.allocate_request(tokens.shape[0] + 1)
    logits = fast.prefill(tokens, RowSequenceCache(pool, table)).cpu()
    span = float(ref_logits.max() - ref_logits.min())
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-2 * span)
    all_logits = fast.prefill(tokens[:5], RowSequenceCache(pool, pool.allocate_request(6)), all_logits=True)
    assert all_logits.shape == (5, TINY.vocab_size)
