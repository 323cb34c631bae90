"""Which part of every weight a rank of a W-rank TP or DCP group holds: the shard plan (no torch.distributed).

A `ShardSpec(world_size, rank)` builds a `KimiModel` whose sharded parameters hold only this rank's rows; every
sharded tensor is split along its dim 0 (its output features), so a shard is a few runs of whole rows of the
full tensor and equals that slice of it, value for value (init and checkpoint loading produce the slice and
nothing else: engine/model/weights.py, loader.py). Kinds (`tensor_split`):
- `attention_head`: MLA per-head tensors, rank r holds heads [r*H/W, (r+1)*H/W): wq_b (the heads' q^C|q^R rows),
  wkv_b (W_UK|W_UV rows), wg (gate rows).
- `kda_head`: KDA per-head tensors, heads [r*H_K/W, ...): w_qkv and conv_weight (three runs: q | k | v), w_g,
  w_fb.
- `expert`: routed experts [r*E/W, (r+1)*E/W) of w1, w3, w2.
- `output_rows`: the MLA and KDA output projections wo [d_model, H*v], split by their d_model output rows
  (d_model/W rows each, with every head's inputs): a rank computes its output features over full-length dot
  products, so no partial sum crosses ranks and the result equals the single rank's bit for bit (the head-split
  form would need a cross-rank sum, whose order differs from one GEMM's).
- `replicated`: the rest (embeddings, the LM head, norms, the router and its bias, the MoE's latent projections
  and shared expert, the dense MLP, the query/KV latent projections wq_a and wkv_a, the indexer, and the KDA's
  per-head scalars w_b, A_log, dt_bias, which are a few hundred bytes and run as whole tensors so that their
  element-wise kernels and small GEMMs see the single rank's shapes).
DCP ranks shard their weights as TP ranks do (mode `dcp` plans the same tensors); W = 1 holds everything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.model.config import ModelConfig

KINDS = ("attention_head", "kda_head", "expert", "output_rows", "replicated")
MODES = ("tp", "dcp")


@dataclass(frozen=True)
class ShardSpec:
    """One rank of a group that splits the weights (TP or DCP ranks of a node)."""

    world_size: int = 1
    """Ranks the weights are split over; 1: the whole model."""
    rank: int = 0
    """This rank, 0..world_size-1."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"shard rank {self.rank} of {self.world_size} ranks is not a rank of the group")

    @property
    def is_whole(self) -> bool:
        return self.world_size == 1

    def split(self, count: int, what: str) -> tuple[int, int]:
        """This rank's even share [lo, hi) of `count` items (heads, experts, rows); ValueError naming `what`."""
        if count % self.world_size:
            raise ValueError(f"{count} {what} do not split over {self.world_size} ranks")
        per = count // self.world_size
        return self.rank * per, (self.rank + 1) * per


WHOLE = ShardSpec()


@dataclass(frozen=True)
class TensorSplit:
    """How one parameter is split: its kind, the full tensor's shape and this rank's runs of dim-0 rows."""

    kind: str
    full_shape: tuple[int, ...]
    rows: tuple[tuple[int, int], ...]
    """Runs [lo, hi) of the full tensor's dim-0 rows this rank holds, ascending (the local tensor is their
    concatenation)."""

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (sum(hi - lo for lo, hi in self.rows),) + self.full_shape[1:]

    @property
    def is_sharded(self) -> bool:
        return self.kind != "replicated"


_MLA_HEAD = {"wq_b.weight": "q", "wkv_b": "kv", "wg.weight": "v"}
_KDA_HEAD = {"w_qkv.weight": 3, "conv_weight": 3, "w_g.weight": 1, "w_fb.weight": 1}
_LAYER = re.compile(r"^layers\.(\d+)\.(mixer|ffn)\.(.+)$")


def split_kind(cfg: ModelConfig, name: str) -> str:
    """The kind of split of parameter `name` (engine names, as `KimiModel.named_parameters`) on W > 1 ranks."""
    match = _LAYER.match(name)
    if match is None:
        return "replicated"
    layer, part, leaf = int(match.group(1)), match.group(2), match.group(3)
    is_mla = (layer + 1) in cfg.mla_layers
    if part == "ffn":
        return "expert" if leaf in ("w1", "w3", "w2") else "replicated"
    if leaf == "wo.weight":
        return "output_rows"
    if is_mla and leaf in _MLA_HEAD:
        return "attention_head"
    if not is_mla and leaf in _KDA_HEAD:
        return "kda_head"
    return "replicated"


def tensor_split(cfg: ModelConfig, spec: ShardSpec, name: str, local_shape: tuple[int, ...]) -> TensorSplit:
    """The split of parameter `name` whose shape on this rank is `local_shape` (every split is even, so the whole
    tensor has W times its dim-0 rows)."""
    kind = "replicated" if spec.is_whole else split_kind(cfg, name)
    if kind == "replicated":
        return TensorSplit(kind, local_shape, ((0, local_shape[0]),) if local_shape else ())
    full_shape = (local_shape[0] * spec.world_size,) + local_shape[1:]
    if kind == "expert":
        rows = (spec.split(cfg.num_experts, "routed experts"),)
    elif kind == "output_rows":
        rows = (spec.split(cfg.d_model, "output rows (d_model)"),)
    elif kind == "attention_head":
        lo, hi = spec.split(cfg.num_heads, "MLA heads")
        per = full_shape[0] // cfg.num_heads
        rows = ((lo * per, hi * per),)
    else:
        lo, hi = spec.split(cfg.kda_num_heads, "KDA heads")
        d, width = cfg.kda_head_dim, cfg.kda_num_heads * cfg.kda_head_dim
        runs = _KDA_HEAD[name.rsplit(".mixer.", 1)[1]]
        rows = tuple((j * width + lo * d, j * width + hi * d) for j in range(runs))
    return TensorSplit(kind, full_shape, rows)


@dataclass(frozen=True)
class PlannedTensor:
    """One row of a rank's shard plan."""

    name: str
    kind: str
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype_bytes: int

    @property
    def full_bytes(self) -> int:
        return _numel(self.full_shape) * self.dtype_bytes

    @property
    def local_bytes(self) -> int:
        return _numel(self.local_shape) * self.dtype_bytes


@dataclass(frozen=True)
class ShardPlan:
    """Every parameter of one rank, with its kind and bytes."""

    model: str
    world_size: int
    rank: int
    mode: str
    tensors: tuple[PlannedTensor, ...]

    def bytes_by_kind(self) -> dict[str, tuple[int, int]]:
        """kind -> (this rank's bytes, the full model's bytes of that kind)."""
        out = {k: (0, 0) for k in KINDS}
        for t in self.tensors:
            mine, full = out[t.kind]
            out[t.kind] = (mine + t.local_bytes, full + t.full_bytes)
        return out

    @property
    def replicated_bytes(self) -> int:
        return sum(t.full_bytes for t in self.tensors if t.kind == "replicated")

    @property
    def sharded_bytes(self) -> int:
        """The full model's bytes of every sharded tensor (each rank holds about 1/W of them)."""
        return sum(t.full_bytes for t in self.tensors if t.kind != "replicated")

    @property
    def rank_bytes(self) -> int:
        return sum(t.local_bytes for t in self.tensors)

    @property
    def full_bytes(self) -> int:
        return sum(t.full_bytes for t in self.tensors)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def shard_plan(cfg: ModelConfig, world_size: int, rank: int = 0, mode: str = "tp") -> ShardPlan:
    """Rank `rank`'s plan in a group of `world_size` (mode `tp` or `dcp`: the same split). Built from the
    model's parameters on the meta device (no memory), so it is exactly what `build_model` allocates."""
    import torch

    from engine.model.model import KimiModel

    if mode not in MODES:
        raise ValueError(f"shard mode must be one of {MODES}, got {mode!r}")
    spec = ShardSpec(world_size, rank)
    with torch.device("meta"):
        model = KimiModel(cfg, spec)
    rows = []
    for name, param in model.named_parameters():
        split = model.splits[name]
        rows.append(PlannedTensor(name, split.kind, split.full_shape, tuple(param.shape), param.element_size()))
    return ShardPlan(cfg.name, world_size, rank, mode, tuple(rows))
