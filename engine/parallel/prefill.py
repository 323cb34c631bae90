"""W-rank prefill of a batch of requests over each rank's weight shard: token-sharded or head-sharded MLA+DSA.

SPMD: every rank calls `parallel_prefill(ctx, model, batch, caches, mode)` with the same batch; `model` is this
rank's shard (engine/model/shards.py: its MLA and KDA heads, routed experts and output rows; the MoE
expert-parallel), each rank's caches hold the whole attention rows (replicated, as under TP) and its own KDA heads
(`kda_shard.rank_cache`). Data moves, partial sums never do: only all_gather and all_to_all move data, every linear
runs over full-length dot products (a sharded weight's own output rows), and the attention and KDA cores run
unchanged code on a query subset or head subset, so each value is computed by the same ops on the same inputs as
in the single-rank `KimiModel.prefill` (docs/SHARDING.md has the steps and the bytes moved).

Per layer, both modes: token-local work on replicated weights (norms, latent and indexer projections, MoE
routing) on the rank's rows; the new latent and index-key rows are all-gathered into every rank's cache; every
new token's hidden row is all-gathered, so the rank projects its heads (MLA queries and gate, KDA q/k/v, gates)
for every token; the heads' gated outputs are all-gathered and the rank computes its output rows for every token,
then one all-to-all hands each rank its tokens' features (`_Step.project_out`). KDA runs conv + KDA per request in
position order on the rank's heads.
- token mode (the seed's): rows are the zigzag split (pieces r and 2W-1-r of each request); all-to-all #1 turns
  (every token, own heads) queries into (own tokens, every head); the indexer and sparse MLA run for the rank's
  own queries with every head against the replicated cache; all-to-all #2 returns the outputs to (every token,
  own heads). Bitwise equal to one rank.
- head mode (baseline, what plain TP does): rows are contiguous; every rank runs the full indexer for every query
  and sparse MLA for its heads (equal to one rank within fp32: the score GEMM runs on H/W heads).
`choose_mode` picks per step: token mode when the step has at least `token_threshold` new tokens.
World size 1 runs the same code with no collectives (= KimiModel.prefill).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.model.indexer import IndexQueries, index_scores, select_topk
from engine.model.mla import MLA, QUERY_BLOCK, attention_topk, sparse_attention
from engine.model.model import KimiModel, dequantize_context
from engine.model.numerics import device_scope, pad_rows, pad_to
from engine.model.state import SequenceCache
from engine.parallel.comm import all_gather_varlen, all_to_all_list
from engine.parallel.groups import ParallelContext
from engine.parallel.kda_shard import kda_core_heads
from engine.parallel.sharded import all_heads, check_shard
from engine.parallel.shard_plan import ShardPlan, all_plans, scatter_to_global

MODES = ("token", "head")


@dataclass(frozen=True)
class PrefillBatch:
    """New tokens of B requests; request b's cache already holds positions 0..starts[b]-1."""

    token_ids: tuple[torch.Tensor, ...]
    starts: tuple[int, ...]

    @property
    def lengths(self) -> list[int]:
        return [int(t.numel()) for t in self.token_ids]


@dataclass
class PrefillStats:
    """This rank's measurements of one prefill step."""

    attention_s: float = 0.0
    """Indexer + sparse MLA (incl. reading and dequantising the cache) on this rank."""
    total_s: float = 0.0
    exchange_bytes: int = 0
    """Bytes this rank put into the attention's and KDA's all_gather / all_to_all (docs/SHARDING.md's formulas)."""
    moe_exchange_bytes: int = 0
    """Bytes this rank put into the expert-parallel MoE's all_to_all (the fast prefill counts them; the reference's
    `ExpertParallelMoE` does not)."""
    selections: list[list[torch.Tensor]] = field(default_factory=list)
    """With record_selections: per MLA layer, per request, this rank's [q, k] selections (own queries)."""
    selection_positions: list[list[torch.Tensor]] = field(default_factory=list)


@dataclass(frozen=True)
class PrefillResult:
    logits: torch.Tensor
    """[B, V]: logits of each request's last new token, or with `all_logits` [sum of new tokens, V]: every new
    token's, request by request in position order (identical on every rank)."""
    mode: str
    stats: PrefillStats


def choose_mode(batch: PrefillBatch, token_threshold: int) -> str:
    return "token" if sum(batch.lengths) >= token_threshold else "head"


@dataclass
class _Step:
    ctx: ParallelContext
    model: KimiModel
    batch: PrefillBatch
    caches: list[SequenceCache]
    plans: list[ShardPlan]
    mode: str
    stats: PrefillStats
    record: bool

    @property
    def me(self) -> ShardPlan:
        return self.plans[self.ctx.rank]

    def gather_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows -> per request [T, ...] in global order (all ranks' rows)."""
        self.stats.exchange_bytes += rows.numel() * rows.element_size() * (self.ctx.world_size - 1)
        return scatter_to_global(all_gather_varlen(self.ctx, rows), self.plans, self.batch.lengths)

    def exchange(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        self.stats.exchange_bytes += sum(c.numel() * c.element_size() for i, c in enumerate(chunks)
                                         if i != self.ctx.rank)
        return all_to_all_list(self.ctx, chunks)

    def all_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows -> every new token's row [N, ...], request by request in position order."""
        return torch.cat(self.gather_rows(rows), dim=0)

    def rows_of(self, rank: int) -> torch.Tensor:
        """Where rank `rank`'s rows sit in the `all_rows` order."""
        starts = torch.tensor([0] + self.batch.lengths).cumsum(0)
        return torch.cat([starts[b] + offs for b, offs in enumerate(self.plans[rank].offsets)])

    def gather_heads(self, local: torch.Tensor) -> torch.Tensor:
        """[N, h, ...] of this rank's heads for every new token -> [N, W*h, ...] (all-gather over heads)."""
        self.stats.exchange_bytes += local.numel() * local.element_size() * (self.ctx.world_size - 1)
        return all_heads(self.ctx, local)

    def project_out(self, wo: torch.nn.Module, values: torch.Tensor) -> torch.Tensor:
        """Gated values of this rank's heads for every new token [N, h*v] -> this rank's rows of the output
        projection [rows, d_model]: every head's values gathered, this rank's d_model/W output features for every
        token (its rows of wo), and one all-to-all hands each rank its tokens' features (engine/parallel/sharded)."""
        every_head = pad_rows(self.gather_heads(values))
        mine = wo(every_head)[: values.shape[0]]                                # [N, d_model / W]
        parts = self.exchange([mine[self.rows_of(r)] for r in range(self.ctx.world_size)])
        return torch.cat(parts, dim=1)


def parallel_prefill(ctx: ParallelContext, model: KimiModel, batch: PrefillBatch, caches: list[SequenceCache],
                     mode: str = "token", record_selections: bool = False, all_logits: bool = False
                     ) -> PrefillResult:
    """Run one prefill step on every rank (SPMD). Returns the last-token logits of every request (`all_logits`:
    of every new token; each rank computes its own rows' logits, one all-gather puts them in order)."""
    if mode not in MODES:
        raise ValueError(f"prefill mode must be one of {MODES}, got {mode!r}")
    if not batch.token_ids or min(batch.lengths) < 1:
        raise ValueError("every request of a prefill step needs at least one new token")
    check_shard(ctx, model)
    with device_scope(ctx.device):
        return _parallel_prefill(ctx, model, batch, caches, mode, record_selections, all_logits)


def _clock(device: torch.device) -> float:
    """Host seconds after the device's queued work is done (CUDA runs asynchronously; CPU: plain clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _parallel_prefill(ctx: ParallelContext, model: KimiModel, batch: PrefillBatch, caches: list[SequenceCache],
                      mode: str, record_selections: bool, all_logits: bool = False) -> PrefillResult:
    begin = _clock(ctx.device)
    batch = PrefillBatch(tuple(t.to(ctx.device) for t in batch.token_ids), batch.starts)
    plans = all_plans(batch.lengths, ctx.world_size, "zigzag" if mode == "token" else "contiguous")
    step = _Step(ctx, model, batch, caches, plans, mode, PrefillStats(), record_selections)
    me = step.me
    own_tokens = torch.cat([ids[o] for ids, o in zip(batch.token_ids, me.offsets)])
    num_rows = int(own_tokens.numel())
    with torch.no_grad():
        x = pad_rows(model.embed[own_tokens])
        x = model.run_layers(x, num_rows, lambda mla, h, i: _mla_layer(step, mla, h, num_rows, i),
                             lambda kda, h, i: _kda_layer(step, kda, h, num_rows, i))
        if all_logits:
            logits = torch.cat(step.gather_rows(model.logits(x[:num_rows])), dim=0)
        else:
            logits = _last_logits(step, x[:num_rows])
    step.stats.total_s = _clock(ctx.device) - begin
    return PrefillResult(logits=logits, mode=mode, stats=step.stats)


def _last_logits(step: _Step, x: torch.Tensor) -> torch.Tensor:
    """Every request's last token lives on one rank: it computes the logits; one gather shares them."""
    model, lengths = step.model, step.batch.lengths
    rows, ids = [], []
    for b, (offs, sl) in enumerate(zip(step.me.offsets, step.me.row_slices())):
        if offs.numel() and int(offs[-1]) == lengths[b] - 1:
            rows.append(sl.stop - 1)
            ids.append(b)
    mine = model.logits(x[rows]) if rows else x.new_zeros(0, model.cfg.vocab_size)
    tagged = torch.cat([torch.tensor(ids, dtype=torch.float32)[:, None], mine], dim=1)
    out = torch.zeros(len(lengths), model.cfg.vocab_size)
    for part in all_gather_varlen(step.ctx, tagged):
        out[part[:, 0].long()] = part[:, 1:]
    return out


def _write_new_rows(step: _Step, latent_bytes: torch.Tensor, key_bytes: torch.Tensor, key_scale: torch.Tensor,
                    num_rows: int, mla_index: int) -> None:
    latent = step.gather_rows(latent_bytes[:num_rows])
    keys = step.gather_rows(key_bytes[:num_rows])
    scales = step.gather_rows(key_scale[:num_rows])
    for b, cache in enumerate(step.caches):
        cache.write_attention(mla_index, step.batch.starts[b], latent[b], keys[b], scales[b])


def _attend(step: _Step, mla: MLA, mla_index: int, b: int, q_abs: torch.Tensor, iq: IndexQueries,
            positions: torch.Tensor) -> torch.Tensor:
    """Indexer + sparse MLA for some queries of request b (timed as the attention module)."""
    cfg = step.model.cfg
    start = _clock(step.ctx.device)
    num_keys = step.batch.starts[b] + step.batch.lengths[b]
    cached = dequantize_context(step.caches[b].read_attention(mla_index, num_keys), mla)
    topk = attention_topk(cfg, num_keys)
    o_lat = sparse_attention(q_abs, iq, positions, cached, topk, mla.softmax_scale, cfg.kv_lora_rank)
    step.stats.attention_s += _clock(step.ctx.device) - start
    if step.record:
        sel = [select_topk(index_scores(iq.q[i:i + QUERY_BLOCK], iq.weights[i:i + QUERY_BLOCK], cached.index_keys,
                                        cached.index_scale), positions[i:i + QUERY_BLOCK], topk)
               for i in range(0, positions.numel(), QUERY_BLOCK)]
        step.stats.selections[-1].append(torch.cat(sel) if sel else torch.zeros(0, topk, dtype=torch.long))
        step.stats.selection_positions[-1].append(positions)
    return o_lat


def _own_positions(step: _Step) -> torch.Tensor:
    """Absolute positions of this rank's rows, request by request (the order of its hidden rows)."""
    parts = [step.batch.starts[b] + offs for b, offs in enumerate(step.me.offsets)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _mla_layer(step: _Step, mla: MLA, h: torch.Tensor, num_rows: int, mla_index: int) -> torch.Tensor:
    """One MLA + DSA layer. The cache rows and the indexer's queries come from the rank's own rows (replicated
    weights); every new token's hidden row is all-gathered, so the rank computes its heads' queries and gate for
    every token; the attention runs per mode; `project_out` maps the heads' values to the rank's rows."""
    pos = mla.row_positions(h.shape[0], _own_positions(step))
    qr = mla.query_latent(h)
    latent_bytes, key_bytes, key_scale = mla.cache_rows(h, pos)
    _write_new_rows(step, latent_bytes, key_bytes, key_scale, num_rows, mla_index)
    if step.record:
        step.stats.selections.append([])
        step.stats.selection_positions.append([])
    h_all = pad_rows(step.all_rows(h[:num_rows]))
    num_all = sum(step.batch.lengths)
    pos_all = mla.row_positions(h_all.shape[0], _all_positions(step))
    qr_all = mla.query_latent(h_all)
    q_local = mla.head_queries(qr_all, pos_all)[:num_all]                    # [N, H/W, C]: this rank's heads
    if step.mode == "token":
        o_local = _token_sharded_attention(step, mla, q_local, mla.index_queries(qr, h, pos), num_rows, mla_index)
    else:
        o_local = _head_sharded_attention(step, mla, q_local, mla.index_queries(qr_all, h_all, pos_all), mla_index)
    values = mla.head_output(pad_to(o_local, h_all.shape[0]), mla.gate(h_all))[:num_all]
    return pad_to(step.project_out(mla.wo, values), h.shape[0])


def _all_positions(step: _Step) -> torch.Tensor:
    """Absolute positions of every new token, in the `all_rows` order."""
    return torch.cat([s + torch.arange(n) for s, n in zip(step.batch.starts, step.batch.lengths)])


def _token_sharded_attention(step: _Step, mla: MLA, q_local: torch.Tensor, iq: IndexQueries, num_rows: int,
                             mla_index: int) -> torch.Tensor:
    """All-to-all #1: (every token, this rank's heads) -> (this rank's tokens, every head); the indexer and sparse
    MLA for the rank's own queries; all-to-all #2 back to (every token, this rank's heads)."""
    cfg, ctx = step.model.cfg, step.ctx
    world, per = ctx.world_size, mla.num_local_heads
    q_own = torch.cat(step.exchange([q_local[step.rows_of(r)] for r in range(world)]), dim=1)   # [rows, H, C]
    o_lat = q_own.new_zeros(num_rows, cfg.num_heads, cfg.kv_lora_rank)
    for b, (offs, rows) in enumerate(zip(step.me.offsets, step.me.row_slices())):
        if offs.numel():
            own_iq = IndexQueries(q=iq.q[rows], weights=iq.weights[rows])
            o_lat[rows] = _attend(step, mla, mla_index, b, q_own[rows], own_iq, step.batch.starts[b] + offs)
    back = step.exchange([o_lat[:, r * per:(r + 1) * per].contiguous() for r in range(world)])
    out = o_lat.new_zeros(sum(step.batch.lengths), per, cfg.kv_lora_rank)
    for r, part in enumerate(back):
        out[step.rows_of(r)] = part
    return out


def _head_sharded_attention(step: _Step, mla: MLA, q_local: torch.Tensor, iq: IndexQueries, mla_index: int
                            ) -> torch.Tensor:
    """The indexer and sparse MLA of this rank's heads for every token (no query exchange: the rank computed
    them); equal to one rank's within fp32 (the score GEMM runs on H/W heads)."""
    outs, at = [], 0
    for b, length in enumerate(step.batch.lengths):
        rows = slice(at, at + length)
        positions = step.batch.starts[b] + torch.arange(length)
        outs.append(_attend(step, mla, mla_index, b, q_local[rows],
                            IndexQueries(q=iq.q[rows], weights=iq.weights[rows]), positions))
        at += length
    return torch.cat(outs, dim=0)


def _kda_layer(step: _Step, kda, h: torch.Tensor, num_rows: int, kda_index: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """One KDA layer: every new token's hidden row is all-gathered, the rank projects its heads for every token,
    runs conv + KDA per request on them in position order, and `project_out` maps the heads' outputs to the rank's
    rows."""
    h_all = pad_rows(step.all_rows(h[:num_rows]))
    proj = kda.project(h_all)
    per, d = kda.num_heads, kda.head_dim
    outs, at = [], 0
    for b, length in enumerate(step.batch.lengths):
        rows = slice(at, at + length)
        state = step.caches[b].read_kda(kda_index)
        o, state = kda_core_heads(kda, proj.qkv[rows], proj.g[rows], proj.beta[rows], state)
        step.caches[b].write_kda(kda_index, state)
        outs.append(o)
        at += length
    o_all = pad_to(torch.cat(outs, dim=0), h_all.shape[0])                   # [N, H/W, d]
    values = kda.head_output(o_all, proj.gate_out)[:at]
    return pad_to(step.project_out(kda.wo, values), h.shape[0])
