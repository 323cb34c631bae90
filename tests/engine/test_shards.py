"""A rank's shard of the model (engine/model/shards.py): the plan, and that init and checkpoint loading give each
rank exactly its slice of the whole model's tensors without drawing or reading the whole of a sharded tensor."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model import weights
from engine.model.config import get_preset
from engine.model.shards import ShardSpec, TensorSplit, shard_plan
from engine.model.weights import build_model

MINI = get_preset("kimi-k3.1-mini")


def assert_slices(whole: torch.nn.Module, part: torch.nn.Module) -> None:
    full = dict(whole.named_parameters())
    for name, param in part.named_parameters():
        split = part.splits[name]
        want = torch.cat([full[name][lo:hi] for lo, hi in split.rows]) if split.rows else full[name]
        assert torch.equal(param, want), f"{name}: the shard is not its rows of the whole tensor"


@pytest.fixture(scope="module")
def whole():
    return build_model(MINI)


@pytest.mark.parametrize("world_size", [2, 4])
def test_random_init_shard_equals_slice_of_whole(whole, world_size: int) -> None:
    for rank in range(world_size):
        assert_slices(whole, build_model(MINI, shard=ShardSpec(world_size, rank)))


@pytest.mark.parametrize("total", [1, 15, 16, 17, 33, 48, 1000, 1001, 4099])
@pytest.mark.parametrize("chunk", [16, 32, 1024])
@pytest.mark.parametrize("draw", ["randn", "rand"])
def test_chunked_draws_continue_one_stream(total: int, chunk: int, draw: str, monkeypatch) -> None:  # noqa: ANN001
    """`_draw_shard` keeps the rows of one whole draw for any size, chunk and run layout."""
    fn = getattr(torch, draw)
    monkeypatch.setattr(weights, "INIT_CHUNK", chunk)
    want = fn(total, generator=torch.Generator().manual_seed(3))
    rows = ((0, total // 3), (total // 2, total)) if total > 2 else ((0, total),)
    split = TensorSplit("kda_head", (total,), rows)
    got = torch.empty(split.local_shape)
    gen = torch.Generator().manual_seed(3)
    weights._draw_shard(got, split, lambda n: fn(n, generator=gen))
    assert torch.equal(got, torch.cat([want[lo:hi] for lo, hi in rows]))
    after = torch.Generator().manual_seed(3)
    fn(total, generator=after)
    assert torch.equal(fn(5, generator=gen), fn(5, generator=after)), "the generator must end where a whole draw does"


def test_sharded_init_never_draws_a_whole_sharded_tensor(monkeypatch) -> None:  # noqa: ANN001
    """Every draw is at most one chunk (+ a short tail) unless its tensor is replicated (drawn whole, as ever)."""
    monkeypatch.setattr(weights, "INIT_CHUNK", 4096)
    biggest_sharded = 0
    plan = shard_plan(MINI, 2)
    replicated = {math.prod(t.full_shape) for t in plan.tensors if t.kind == "replicated"}
    drawn: list[int] = []
    real = torch.randn

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = real(*args, **kwargs)
        drawn.append(out.numel())
        return out

    monkeypatch.setattr(torch, "randn", spy)
    build_model(MINI, shard=ShardSpec(2, 1))
    for t in plan.tensors:
        if t.kind != "replicated":
            biggest_sharded = max(biggest_sharded, math.prod(t.full_shape))
    assert biggest_sharded > 4096 + 16
    assert all(n <= 4096 + 15 or n in replicated for n in drawn), "a sharded tensor was drawn whole"


def test_plan_bytes_are_replicated_plus_sharded_over_w() -> None:
    one = shard_plan(MINI, 1)
    assert one.rank_bytes == one.full_bytes == one.replicated_bytes
    for world_size in (2, 4):
        for rank in range(world_size):
            plan = shard_plan(MINI, world_size, rank)
            assert plan.full_bytes == one.full_bytes
            assert plan.rank_bytes == plan.replicated_bytes + plan.sharded_bytes // world_size
            built = build_model(MINI, shard=ShardSpec(world_size, rank))
            held = sum(p.numel() * p.element_size() for p in built.parameters())
            assert held == plan.rank_bytes, "the built shard is not what the plan says"
    kinds = {t.name: t.kind for t in shard_plan(MINI, 2).tensors}
    assert kinds["layers.3.mixer.wq_b.weight"] == "attention_head"
    assert kinds["layers.0.mixer.w_qkv.weight"] == "kda_head"
    assert kinds["layers.1.ffn.w1"] == "expert"
    assert kinds["layers.3.mixer.wo.weight"] == "output_rows"
    for name in ("embed", "lm_head.weight", "layers.1.ffn.router.weight", "layers.3.mixer.wkv_a.weight",
                 "layers.3.mixer.indexer.wq.weight", "layers.0.mixer.A_log"):
        assert kinds[name] == "replicated", name


def test_pro_plan_shards_most_bytes() -> None:
    pro = get_preset("kimi-k3.1-pro")
    plan = shard_plan(pro, 8, 3, mode="dcp")
    assert plan.sharded_bytes > 0.95 * plan.full_bytes
    assert plan.rank_bytes == plan.replicated_bytes + plan.sharded_bytes // 8


@pytest.mark.parametrize("world_size,what", [(3, "heads do not split over 3 ranks"), (8, "heads do not split over 8")])
def test_uneven_split_is_refused_by_name(world_size: int, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        shard_plan(MINI, world_size)


@pytest.mark.parametrize("kind", ["kimi-mix", "dsv32-fp8", "dsv32-sharded"])
def test_checkpoint_shard_equals_slice_of_whole(kind: str) -> None:
    pytest.importorskip("transformers", reason="the checkpoints are written by transformers (a test dependency)")
    from engine.model.config import resolve_model
    from tests.checkpoints import checkpoint_dir

    cfg = resolve_model(str(checkpoint_dir(kind)))
    full = build_model(cfg)
    for rank in range(2):
        assert_slices(full, build_model(cfg, shard=ShardSpec(2, rank)))


def test_safetensors_weights_file_loads_a_shard(whole, tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "w.safetensors"
    weights.save_weights(whole, path)
    other_seed = build_model(MINI, seed=99, weights=path, shard=ShardSpec(2, 0))
    assert_slices(whole, other_seed)
