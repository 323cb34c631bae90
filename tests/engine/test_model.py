"""Whole-model checks: prefill + decode == teacher-forced forward, weights, determinism of init."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from engine.cache import RowPool, RowSequenceCache
from engine.model.config import get_preset
from engine.model.state import LocalSequenceCache
from engine.model.weights import build_model, save_weights
from engine.layout import plan_layout

CFG = get_preset("kimi-k3.1-mini")


@pytest.fixture(scope="module")
def model():  # type: ignore[no-untyped-def]
    return build_model(CFG)


@torch.no_grad()
def test_prefill_then_decode_equals_teacher_forced_forward(model) -> None:  # type: ignore[no-untyped-def]
    """A 300-token prompt (sparse: > index_topk 256, chunk tail 300 % 64 = 44) then 12 greedy decode steps.
    Logits agree with one forward over prompt + outputs within atol 2e-4 (chunked vs recurrent KDA rounding),
    and the greedy tokens are the same."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (300,), generator=gen)
    pool = RowPool(plan_layout(CFG), CFG, 8)
    cache = RowSequenceCache(pool, pool.allocate_request(400))
    logits = [model.prefill(prompt, cache)[0]]
    tokens = [int(logits[-1].argmax())]
    for step in range(12):
        logits.append(model.decode(torch.tensor(tokens[-1:]), [300 + step], [cache])[0])
        tokens.append(int(logits[-1].argmax()))
    full = torch.cat([prompt, torch.tensor(tokens[:-1])])
    forced = model.prefill(full, LocalSequenceCache(CFG, 400), all_logits=True)[299:]
    torch.testing.assert_close(torch.stack(logits), forced, rtol=0, atol=2e-4)
    assert forced.argmax(-1).tolist() == tokens


@torch.no_grad()
def test_prefill_in_two_pieces_equals_one(model) -> None:  # type: ignore[no-untyped-def]
    """Continuing a prefill from cached state (KDA state + attention rows) matches one prefill: atol 2e-4."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (200,), generator=gen)
    whole = model.prefill(prompt, LocalSequenceCache(CFG, 200), all_logits=True)
    cache = LocalSequenceCache(CFG, 200)
    model.prefill(prompt[:128], cache)
    rest = model.prefill(prompt[128:], cache, start=128, all_logits=True)
    torch.testing.assert_close(rest, whole[128:], rtol=0, atol=2e-4)


def test_seeded_init_is_reproducible_and_weights_round_trip(tmp_path: Path, model) -> None:  # type: ignore[no-untyped-def]
    again = build_model(CFG)
    other = build_model(CFG, seed=7)
    params = dict(model.named_parameters())
    assert all(torch.equal(p, params[n]) for n, p in again.named_parameters())
    assert not torch.equal(dict(other.named_parameters())["embed"], params["embed"])
    path = tmp_path / "w.safetensors"
    save_weights(other, path)
    loaded = build_model(CFG, weights=path)
    assert all(torch.equal(p, dict(other.named_parameters())[n]) for n, p in loaded.named_parameters())


def test_weights_file_for_another_shape_is_rejected(tmp_path: Path) -> None:
    from dataclasses import replace

    small = build_model(replace(CFG, dense_intermediate=256))
    path = tmp_path / "small.safetensors"
    save_weights(small, path)
    with pytest.raises(ValueError, match="has shape"):
        build_model(CFG, weights=path)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["row-pool", "local"])
def test_decode_batch_of_ten_is_bit_identical_to_alone(model, kind: str) -> None:  # type: ignore[no-untyped-def]
    """10 requests (two attention groups of the batched decode core; contexts 3..290 tokens) decoded together
    give exactly the logits each gets alone, through the pool's batched reads and through the per-request
    fallback of a plain SequenceCache."""
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 290, 17, 64, 65, 130, 257, 5, 200, 99]
    layout = plan_layout(CFG)
    pool = RowPool(layout, CFG, 2 * len(lengths) * sum(layout.rows_per_request(300)))

    def fresh():  # type: ignore[no-untyped-def]
        return RowSequenceCache(pool, pool.allocate_request(300)) if kind == "row-pool" else LocalSequenceCache(CFG, 300)

    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in lengths]
    batch_caches = [fresh() for _ in lengths]
    for prompt, cache in zip(prompts, batch_caches):
        model.prefill(prompt, cache)
    if kind == "local":
        alone_caches = [copy.deepcopy(c) for c in batch_caches]
    else:
        alone_caches = [fresh() for _ in lengths]
        for src, dst in zip(batch_caches, alone_caches):
            pool.buffer[dst.table.row_ids] = pool.buffer[src.table.row_ids]
    tokens = torch.randint(0, 256, (len(lengths),), generator=gen)
    batched = model.decode(tokens, lengths, batch_caches)
    for i, n in enumerate(lengths):
        assert torch.equal(model.decode(tokens[i : i + 1], [n], [alone_caches[i]])[0], batched[i]), f"request {i}"
