"""Rank pools, collectives wrappers and prefill shard plans."""

from __future__ import annotations

import pytest
import torch

from engine.parallel.groups import ParallelContext, RankError, RankPool
from engine.parallel.prefill import PrefillBatch, choose_mode
from engine.parallel.shard_plan import all_plans, contiguous_offsets, zigzag_offsets
from tests.engine.parallel import _ranks


@pytest.mark.process
def test_uneven_all_to_all_and_rank_failure() -> None:
    with RankPool(3, backend="gloo", timeout_s=600) as pool:
        received = pool.run(_ranks.exchange_case)
        for dst, parts in enumerate(received):
            for src, part in enumerate(parts):
                assert part.shape == (src + dst, 3) and bool((part == 100 * src + dst).all())
        with pytest.raises(RankError, match="rank one fails on purpose"):
            pool.run(_ranks.fail_on_rank_one)
        assert not pool.alive


def test_zigzag_pieces_cover_each_request_once_and_balance_causal_work() -> None:
    for length in (1, 5, 37, 300, 4096):
        for world in (1, 2, 4, 8):
            parts = [zigzag_offsets(length, world, r) for r in range(world)]
            assert torch.equal(torch.cat(parts).sort().values, torch.arange(length))
            contiguous = [contiguous_offsets(length, world, r) for r in range(world)]
            assert torch.equal(torch.cat(contiguous), torch.arange(length))
    work = [int((zigzag_offsets(4096, 4, r) + 1).sum()) for r in range(4)]
    assert max(work) / min(work) < 1.01
    assert torch.equal(zigzag_offsets(16, 2, 0), torch.tensor([0, 1, 2, 3, 12, 13, 14, 15]))
    assert all_plans([10], 1)[0].offsets[0].tolist() == list(range(10))


def test_mode_threshold_and_single_context() -> None:
    batch = PrefillBatch((torch.zeros(300, dtype=torch.long), torch.zeros(40, dtype=torch.long)), (0, 0))
    assert choose_mode(batch, 340) == "token" and choose_mode(batch, 341) == "head"
    ctx = ParallelContext.single()
    assert ctx.is_single and ctx.group is None and ctx.world_size == 1
