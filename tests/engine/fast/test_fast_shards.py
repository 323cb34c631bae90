"""A fast TP or DCP rank holds only its shard (engine/parallel/fast_tp.py, fast_dcp.py, fast_prefill.py): building
the fast decoder and SPMD prefiller on a rank's shard of kimi-k3.1-mini (what a node's `--kernels fast` rank
builds; the shard itself is built without a whole sharded tensor: tests/engine/test_shards.py) never makes a tensor
of a whole sharded tensor's shape, not even transiently (every op's output is watched), and the decoder's copies
have the shard's shapes. Construction only: no collective runs, so the
rank's context needs no process group (the numerics on 2 gloo ranks: test_tp_decode.py, test_dcp_decode.py,
test_tp_prefill.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.layout import plan_layout
from engine.model.config import get_preset
from engine.model.shards import ShardSpec
from engine.model.weights import build_model
from engine.parallel.fast_dcp import DCPFastDecoder
from engine.parallel.fast_prefill import TPFastPrefiller
from engine.parallel.fast_tp import TPFastDecoder
from engine.parallel.groups import ParallelContext

MINI = get_preset("kimi-k3.1-mini")


class _Allocations(TorchDispatchMode):
    """The shapes of every tensor an op produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.shapes.update(tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _build(model, kind: str, world_size: int, rank: int):  # type: ignore[no-untyped-def]
    ctx = ParallelContext(rank=rank, world_size=world_size, group=None, device=torch.device("cpu"), backend="gloo")
    if kind == "tp":
        decoder = TPFastDecoder(model, plan_layout(MINI, tp_size=world_size), ctx)
        TPFastPrefiller(decoder)
    else:
        decoder = DCPFastDecoder(model, plan_layout(MINI, tp_size=world_size, dcp_size=world_size), ctx)
    return decoder


@pytest.mark.parametrize("kind, world_size", [("tp", 2), ("dcp", 4)])
def test_fast_rank_never_makes_a_whole_sharded_tensor(kind: str, world_size: int) -> None:
    rank = world_size - 1
    model = build_model(MINI, shard=ShardSpec(world_size, rank))
    held = {tuple(p.shape) for p in model.parameters()}
    whole = {split.full_shape: split.kind for split in model.splits.values() if split.is_sharded}
    whole = {shape: kind for shape, kind in whole.items() if shape not in held}  # mini's coincidences left out
    assert set(whole.values()) == {"attention_head", "kda_head", "expert", "output_rows"}
    with _Allocations() as seen:
        decoder = _build(model, kind, world_size, rank)
    assert not seen.shapes & whole.keys(), f"whole sharded tensors were made: {sorted(seen.shapes & whole.keys())}"
    cfg, per = MINI, MINI.num_experts // world_size
    for layer in decoder.layers:
        assert layer.mixer["wo"].shape[0] == cfg.d_model // world_size
        if layer.kind == "mla":
            assert layer.mixer["w_uv"].shape[0] == cfg.num_heads // world_size
        else:
            assert layer.mixer["conv_weight"].shape[0] == 3 * cfg.kda_num_heads * cfg.kda_head_dim // world_size
        if not layer.dense:
            assert [layer.ffn[n].shape[0] for n in ("w1", "w3", "w2")] == [per] * 3
    other = ParallelContext(rank=0, world_size=world_size, group=None, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ValueError, match=rf"build it with ShardSpec\({world_size}, 0\)"):
        TPFastDecoder(model, plan_layout(MINI, tp_size=world_size), other)
