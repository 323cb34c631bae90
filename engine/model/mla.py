"""Multi-head latent attention (MLA) with the DSA indexer, split into projections and an attention core.

Projections (token-wise, `MLA.project(x, positions)` / `MLA.output`):
    qr = RMSNorm(W_DQ x)   q = W_UQ qr -> per head [q^C (qk_nope) | q^R (qk_rope)]   (q_lora_rank 0: q = W_Q x)
    c  = RMSNorm(W_DKV x)  k^R = W_KR x       cached latent row [c | k^R] (kv_lora + rope values, FP8 or fp32)
    absorbed query q~_h = [W_UK_h^T q^C_h | q^R_h]   (kv_lora + rope dims, one MQA "KV head")
    out = W_O( (W_UV_h o^lat_h) * sigmoid(W_g x) )     (the gate only with mla_output_gate)
`mla_rope`: "none" (NoPE: k^R and q^R stay unrotated, K3.1 and Kimi-Linear) or a rotary style (DeepSeek:
"interleaved"): q^R and k^R are rotated by their token's position before k^R is cached.
Softmax scale tau = (qk_nope + qk_rope)^-1/2. Without the DSA indexer (`dsa_indexer` false) every query attends
to every earlier key (`attention_topk`: k = the keys there are).

Attention core (`sparse_attention`): for any subset of query tokens of one request, score the request's cached
index keys, select the top-k positions per query, and attend in the absorbed form over exactly those cached,
dequantized latents. Queries run in blocks; each query's keys are gathered into a fixed [k] buffer in ascending
position order, padded with -inf, so a query's output does not depend on its block or batch.
The latent cache is FP8 with a per-tensor static scale (`latent_scale`), or exact fp32 (`latent_dtype`); prefill
and decode both attend over the cached values, so prefill -> transfer -> decode agrees with a teacher-forced forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.model.config import ModelConfig
from engine.model.indexer import Indexer, IndexQueries, index_scores, model_rotary, select_topk
from engine.model.numerics import RMSNorm, RowLinear, apply_rope, cache_decode, cache_encode, yarn_mscale
from engine.model.shards import WHOLE, ShardSpec

QUERY_BLOCK = 256


@dataclass
class AttentionContext:
    """One request's cached attention state for one layer, dequantized: positions 0..L-1."""

    latent: torch.Tensor  # [L, kv_lora + rope] float32
    index_keys: torch.Tensor  # [L, d_I] float32 holding e4m3 values
    index_scale: torch.Tensor  # [L] float32


@dataclass
class MLAProjection:
    """Everything the projections produce for R (padded) rows of tokens."""

    q_absorbed: torch.Tensor  # [R, H, kv_lora + rope]
    latent_bytes: torch.Tensor  # [R, (kv_lora + rope) * value bytes] uint8 (FP8 or fp32)
    index_queries: IndexQueries
    index_key_bytes: torch.Tensor  # [R, index_key_value_bytes] uint8 (FP8 or fp32)
    index_key_scale: torch.Tensor  # [R] float32
    gate: torch.Tensor | None  # [R, H * v_head_dim]


class MLA(nn.Module):
    """One MLA + DSA layer. Built with a `ShardSpec` of W ranks it holds heads [head_lo, head_lo + num_local_heads)
    of wq_b, wkv_b and wg and d_model/W output rows of wo (engine/model/shards.py): `project` then gives the local
    heads' queries and gate, `head_output` the local heads' gated values, and `wo` maps every head's values to
    this rank's output features; the parallel paths move the data in between."""

    def __init__(self, cfg: ModelConfig, shard: ShardSpec = WHOLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.head_lo, head_hi = shard.split(cfg.num_heads, "MLA heads")
        self.num_local_heads = head_hi - self.head_lo
        out_lo, out_hi = shard.split(cfg.d_model, "output rows (d_model)")
        h, nope, rope, v = self.num_local_heads, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim
        self.wq_a = RowLinear(cfg.d_model, cfg.q_lora_rank) if cfg.q_lora_rank else None
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_eps) if cfg.q_lora_rank else None
        self.wq_b = RowLinear(cfg.q_lora_rank or cfg.d_model, h * (nope + rope))
        self.wkv_a = RowLinear(cfg.d_model, cfg.kv_lora_rank + rope)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.rms_eps)
        self.wkv_b = nn.Parameter(torch.empty(h * (nope + v), cfg.kv_lora_rank), requires_grad=False)
        self.wg = RowLinear(cfg.d_model, h * v) if cfg.mla_output_gate else None
        self.wo = RowLinear(cfg.num_heads * v, out_hi - out_lo)
        self.indexer = Indexer(cfg) if cfg.dsa_indexer else None
        self.rotary = model_rotary(cfg)
        self.softmax_scale = (nope + rope) ** -0.5
        if cfg.rope_mscale_all_dim:  # YaRN scales the whole q.k, not only its rotary part
            self.softmax_scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
        self.latent_scale = cfg.latent_fp8_scale

    def decode_latent(self, raw: torch.Tensor) -> torch.Tensor:
        """Cached latent bytes [..., C * value bytes] -> float32 [..., C]."""
        return cache_decode(raw, self.cfg.latent_dtype, self.latent_scale)

    def w_uk(self) -> torch.Tensor:
        """[H, qk_nope, kv_lora] (the local heads)"""
        cfg = self.cfg
        return self.wkv_b.view(self.num_local_heads, cfg.qk_nope_dim + cfg.v_head_dim, -1)[:, : cfg.qk_nope_dim]

    def w_uv(self) -> torch.Tensor:
        """[H, v_head_dim, kv_lora] (the local heads)"""
        cfg = self.cfg
        return self.wkv_b.view(self.num_local_heads, cfg.qk_nope_dim + cfg.v_head_dim, -1)[:, cfg.qk_nope_dim :]

    def query_latent(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, d] -> qr [R, q_lora] = RMSNorm(W_DQ x) (x itself when q_lora_rank is 0)."""
        return self.q_norm(self.wq_a(x)) if self.wq_a is not None else x

    def head_queries(self, qr: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """qr [R, q_lora], positions [R] (padded, `row_positions`) -> absorbed queries [R, H, kv_lora + rope] of
        the local heads: [W_UK_h^T q^C_h | rotated q^R_h]."""
        cfg = self.cfg
        q = self.wq_b(qr).view(qr.shape[0], self.num_local_heads, cfg.qk_nope_dim + cfg.qk_rope_dim)
        q_rope = apply_rope(q[..., cfg.qk_nope_dim :], positions, cfg.mla_rope, self.rotary)
        q_lat = torch.matmul(q[..., : cfg.qk_nope_dim].transpose(0, 1), self.w_uk()).transpose(0, 1)
        return torch.cat([q_lat, q_rope], dim=-1).contiguous()

    def row_positions(self, num_rows: int, positions: torch.Tensor | None) -> torch.Tensor | None:
        """The positions of `num_rows` padded rows (padding at position 0), or None when nothing rotates."""
        cfg = self.cfg
        if cfg.mla_rope == "none" and cfg.index_rope == "none":
            return None
        if positions is None:
            raise ValueError("a rotary MLA needs the rows' positions")
        pos = torch.zeros(num_rows, dtype=torch.int64)
        pos[: positions.shape[0]] = positions
        return pos

    def latent(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, d], positions [R] -> unquantised latent rows [R, kv_lora + rope] = [RMSNorm(c) | rotated k^R]."""
        cfg = self.cfg
        kv = self.wkv_a(x)
        c = self.kv_norm(kv[:, : cfg.kv_lora_rank])
        return torch.cat([c, apply_rope(kv[:, cfg.kv_lora_rank :], positions, cfg.mla_rope, self.rotary)], dim=-1)

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> MLAProjection:
        """x [R, d] (padded rows) at `positions` (the first len(positions) rows' absolute positions; the padding
        rows get position 0; unused without rotary embeddings) -> every projection of the layer (the queries and
        gate of the local heads)."""
        pos = self.row_positions(x.shape[0], positions)
        qr = self.query_latent(x)
        latent_bytes, key_bytes, key_scale = self.cache_rows(x, pos)
        return MLAProjection(
            q_absorbed=self.head_queries(qr, pos),
            latent_bytes=latent_bytes,
            index_queries=self.index_queries(qr, x, pos),
            index_key_bytes=key_bytes,
            index_key_scale=key_scale,
            gate=self.gate(x),
        )

    def cache_rows(self, x: torch.Tensor, pos: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [R, d], padded positions -> what the cache keeps per token: (latent bytes, index-key bytes, key scale)."""
        cfg = self.cfg
        latent_bytes = cache_encode(self.latent(x, pos), cfg.latent_dtype, self.latent_scale)
        if self.indexer is None:  # dense MLA: the index pages hold zeros and no query scores them
            return (latent_bytes, torch.zeros(x.shape[0], cfg.index_key_value_bytes, dtype=torch.uint8),
                    torch.zeros(x.shape[0]))
        key_bytes, key_scale = self.indexer.keys(x, pos)
        return latent_bytes, key_bytes, key_scale

    def index_queries(self, qr: torch.Tensor, x: torch.Tensor, pos: torch.Tensor | None) -> IndexQueries:
        """The indexer's queries of rows x (zeros for a dense MLA, which scores nothing)."""
        cfg = self.cfg
        if self.indexer is None:
            return IndexQueries(q=torch.zeros(x.shape[0], cfg.index_num_heads, cfg.index_head_dim),
                                weights=torch.zeros(x.shape[0], cfg.index_num_heads))
        return self.indexer.queries(qr, x, pos)

    def gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """The output gate's pre-activations of the local heads [R, H * v] (None without mla_output_gate)."""
        return self.wg(x) if self.wg is not None else None

    def head_output(self, o_latent: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """o_latent [R, H, kv_lora] (the local heads) -> [R, H * v]: W_UV per head, then the sigmoid gate."""
        o = torch.matmul(o_latent.transpose(0, 1), self.w_uv().transpose(1, 2)).transpose(0, 1)
        o = o.reshape(o.shape[0], -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return o

    def output(self, o_latent: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """o_latent [R, H, kv_lora] -> [R, d]: W_UV per head, sigmoid gate, W_O (a whole layer)."""
        return self.wo(self.head_output(o_latent, gate))


def attention_topk(cfg: ModelConfig, num_keys: int) -> int:
    """Keys each query attends to when the longest query sees `num_keys` keys: index_topk with the DSA indexer,
    all of them without (dense MLA: every query keeps every earlier key and nothing is scored; rounded up to a
    multiple of 64, which bounds the shapes a step compiles for and changes no selection)."""
    return cfg.index_topk if cfg.dsa_indexer else -(-max(num_keys, 1) // 64) * 64


def sparse_mla(
    q_absorbed: torch.Tensor, latent: torch.Tensor, selected: torch.Tensor, scale: float, kv_lora_rank: int
) -> torch.Tensor:
    """Absorbed MLA over selected keys. q [T,H,C], latent [L,C], selected [T,k] (-1 pads) -> o^lat [T,H,kv_lora]."""
    return sparse_mla_gathered(q_absorbed, latent[selected.clamp_min(0)], selected, scale, kv_lora_rank)


def sparse_mla_gathered(
    q_absorbed: torch.Tensor, gathered: torch.Tensor, selected: torch.Tensor, scale: float, kv_lora_rank: int
) -> torch.Tensor:
    """As sparse_mla with each query's keys already gathered: gathered [T, k, C] in `selected` order."""
    scores = torch.matmul(q_absorbed, gathered.transpose(1, 2)) * scale  # [T, H, k]
    scores = scores.masked_fill((selected < 0).unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, gathered[..., :kv_lora_rank])


def decode_attention(
    q_absorbed: torch.Tensor,
    index_queries: IndexQueries,
    positions: torch.Tensor,
    latent_bytes: torch.Tensor,
    index_keys: torch.Tensor,
    index_scale: torch.Tensor,
    decode_latent: Callable[[torch.Tensor], torch.Tensor],
    topk: int,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """One query per request for B requests at once -> o^lat [B, H, kv_lora].

    latent_bytes [B, Lmax, C] uint8 (cached bytes, made float by `decode_latent`), index_keys [B, Lmax, D] float (e4m3 values), index_scale [B, Lmax]: each
    request's cache padded to the longest (entries past positions[b] are ignored). Every request's result is
    bit-identical to running it alone: the index dots are exact, selection is per row, and the attention is a
    per-request [H, C] x [C, k] product whose kernel does not depend on B.
    """
    batch = positions.shape[0]
    if int(positions.max()) + 1 <= topk:
        scores = torch.empty(batch, index_keys.shape[1])
    else:
        dots = torch.matmul(index_queries.q.double(), index_keys.double().transpose(1, 2)).to(torch.float32)
        dots.relu_().mul_(index_queries.weights.unsqueeze(-1))  # [B, H_I, Lmax]
        scores = dots[:, 0] + dots[:, 1] if dots.shape[1] > 1 else dots[:, 0].clone()
        for h in range(2, dots.shape[1]):
            scores.add_(dots[:, h])
        scores.mul_(index_scale)
    selected = select_topk(scores, positions, topk)  # [B, k]
    rows = torch.arange(batch).unsqueeze(1)
    gathered = decode_latent(latent_bytes[rows, selected.clamp_min(0)])  # [B, k, C]
    return sparse_mla_gathered(q_absorbed, gathered, selected, softmax_scale, kv_lora_rank)


def sparse_attention(
    q_absorbed: torch.Tensor,
    index_queries: IndexQueries,
    positions: torch.Tensor,
    ctx: AttentionContext,
    topk: int,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Indexer scoring + top-k + sparse MLA for T query tokens of one request -> o^lat [T, H, kv_lora].

    positions [T] are absolute positions; ctx must hold every position up to max(positions).
    """
    outputs = []
    for start in range(0, positions.shape[0], QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, positions.shape[0])
        pos = positions[start:end]
        num_keys = int(pos.max()) + 1
        if num_keys <= topk:  # every query keeps all earlier keys: no scoring needed
            scores = torch.empty(end - start, num_keys)
        else:
            scores = index_scores(
                index_queries.q[start:end],
                index_queries.weights[start:end],
                ctx.index_keys[:num_keys],
                ctx.index_scale[:num_keys],
            )
        selected = select_topk(scores, pos, topk)
        outputs.append(sparse_mla(q_absorbed[start:end], ctx.latent, selected, softmax_scale, kv_lora_rank))
    return torch.cat(outputs, dim=0)


def naive_mla_expanded(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference, expanded form: per-head keys k_h = [W_UK_h c | k^R], values W_UV_h c, masked to `selected`.

    q_nope [T,H,n], q_rope [T,H,r], latent [L, kv_lora + r] -> [T, H, v] (float64 inside).
    """
    kv_lora = w_uk.shape[-1]
    c, k_rope = latent[:, :kv_lora].double(), latent[:, kv_lora:].double()
    keys = torch.einsum("hnc,lc->hln", w_uk.double(), c)  # [H, L, n]
    values = torch.einsum("hvc,lc->hlv", w_uv.double(), c)  # [H, L, v]
    scores = torch.einsum("thn,hln->thl", q_nope.double(), keys) + torch.einsum(
        "thr,lr->thl", q_rope.double(), k_rope
    )
    allowed = torch.zeros(q_nope.shape[0], latent.shape[0], dtype=torch.bool)
    for t in range(selected.shape[0]):
        ids = selected[t][selected[t] >= 0]
        allowed[t, ids] = True
    scores = (scores * scale).masked_fill(~allowed.unsqueeze(1), float("-inf"))
    return torch.einsum("thl,hlv->thv", torch.softmax(scores, -1), values).to(torch.float32)


def naive_mla_absorbed(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference, absorbed form, one query and head at a time: q~ = W_UK^T q^C, MQA over [c | k^R], then W_UV."""
    kv_lora = w_uk.shape[-1]
    out = torch.zeros(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1], dtype=torch.float64)
    lat = latent.double()
    for t in range(q_nope.shape[0]):
        ids = selected[t][selected[t] >= 0]
        keys = lat[ids]
        for h in range(q_nope.shape[1]):
            q_abs = torch.cat([w_uk[h].double().t() @ q_nope[t, h].double(), q_rope[t, h].double()])
            probs = torch.softmax(keys @ q_abs * scale, dim=0)
            out[t, h] = w_uv[h].double() @ (probs @ keys[:, :kv_lora])
    return out.to(torch.float32)
