"""The fast prefill (engine/fast/prefill.py) inside the W-rank SPMD prefill: token-sharded or head-sharded, each
rank on its shard of the weights (engine/model/shards.py).

`TPFastPrefiller(decoder)` runs on every rank of the decoder's group (a `fast_tp.TPFastDecoder`: the bf16 copies of
the rank's shard - its MLA heads, KDA heads, experts and output rows of wo - and the compiled segments) what
engine/parallel/prefill.py runs for the reference, with the same data movement (all_gather / all_to_all only,
never a cross-rank partial sum; docs/SHARDING.md) and the fast kernels of the single-rank `FastPrefiller` in place
of the reference ops:

- rows: a rank runs the token-local work (norms, MoE routing and the shared expert, the residual stream) on its
  own tokens of the request: the zigzag split (pieces r and 2W-1-r) in token mode, one contiguous run in head mode
  (engine/parallel/shard_plan.py);
- MLA + DSA: the hidden rows of every new token are all-gathered and each rank runs the MLA front on all of them
  (the replicated projections give every rank the same FP8 latents, index keys and index queries, so every rank
  writes every new token into its pool - a TP pool replicates the attention rows - with nothing else exchanged;
  its own head rows give its heads' absorbed queries and gate). Token mode (the seed's prefill): all-to-all #1
  turns the queries (all tokens, own heads) into (own tokens, all heads), the rank runs the causal indexer
  (`prefill_select`) and the sparse MLA (`sparse_mla_prefill`) for its own queries, one contiguous piece at a
  time, and all-to-all #2 returns o^lat to (all tokens, own heads). Head mode: no query exchange; the rank runs
  the indexer and the sparse MLA for every token with its heads. Then W_UV and the gate on the rank's heads;
- KDA: the hidden rows of every new token are all-gathered, the rank projects its heads (its w_qkv, w_g, w_fb
  rows) for every token and runs the conv and the chunked recurrence (fla-core's chunk_kda on CUDA, bf16 path)
  on them from and into its pool's KDA rows (which hold its heads), then the per-head norm and the gate;
- output projections (MLA and KDA): the gated values of the rank's heads are all-gathered over heads, the rank
  computes its d_model/W output features of every token with its rows of wo, and one all-to-all hands each rank
  its own tokens' features;
- MoE: expert parallel over the shard's experts. Each rank routes its rows, sends each row's latent z and
  expert ids to the ranks owning any of its chosen experts (all-to-all), every owner runs its experts on the
  (row, slot) pairs it owns as grouped GEMMs (engine/fast/moe.py `expert_pairs`) and returns the per-pair
  outputs (all-to-all), and the rank mixes each row's slots as the single-rank prefill does;
- logits: the last token's on the rank that owns it, shared by one gather (`all_logits`: every rank's rows,
  gathered in position order).

Every rank ends with the same logits. World size 1 runs the single-rank computation (the collectives are
no-ops). A step resuming at `start` > 0 reads the earlier keys from the pages and the KDA state from the rows.
The attention time (indexer + sparse MLA; the device synchronised before and after) and the bytes this rank put
into collectives are reported as engine/parallel/prefill.py reports them (the MoE's apart, `moe_exchange_bytes`).
Bytes rank r puts into the attention's and KDA's exchanges of one step of N tokens, n of them its own (h = H/W,
h_K = H_K/W, e the activations' bytes: 2 in bf16; the hidden rows and outputs fp32; `all_logits` adds
4 (W-1) n V; tests/engine/fast/test_tp_prefill.py counts them):
    per MLA layer:  4 (W-1) n d  +  e (W-1) N h v  +  4 (N-n) d/W
                    token mode adds  e (N-n) h (kv_lora + rope)  (all-to-all #1)  +  4 n (H-h) kv_lora  (#2)
    per KDA layer:  4 (W-1) n d  +  4 (W-1) N h_K d_K  +  4 (N-n) d/W
"""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.fast.decoder import BF16
from engine.fast.moe import expert_pairs
from engine.fast.prefill import attend_selected, check_request, kda_prefill_rows, request_subblocks
from engine.fast.prefill_attention import prefill_select, write_tokens
from engine.parallel.comm import all_gather_varlen, all_to_all_list
from engine.parallel.fast_tp import TPFastDecoder
from engine.parallel.prefill import MODES, PrefillResult, PrefillStats
from engine.parallel.shard_plan import ShardPlan, all_plans, scatter_to_global
from engine.parallel.sharded import all_heads


def contiguous_runs(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    """Ascending offsets -> runs (first row, first offset, length) of consecutive offsets."""
    values = offsets.tolist()
    runs: list[tuple[int, int, int]] = []
    for row, off in enumerate(values):
        if runs and runs[-1][1] + runs[-1][2] == off:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((row, off, 1))
    return runs


class TPFastPrefiller:
    def __init__(self, decoder: TPFastDecoder) -> None:
        self.decoder, self.ctx = decoder, decoder.ctx
        self.model, self.cfg, self.layout = decoder.model, decoder.cfg, decoder.layout
        self.conv_dtype = decoder.conv_dtype
        self.use_fla = None if decoder.dtype == BF16 else False  # as FastPrefiller.use_fla
        self.steps = 0
        """Prefill steps run."""

    @torch.no_grad()
    def prefill(self, buffer: torch.Tensor, token_ids: torch.Tensor, attn_row_ids: list[int],
                kda_row_ids: list[int], start: int = 0, mode: str = "token", all_logits: bool = False
                ) -> PrefillResult:
        """token_ids [T] (the same on every rank) at positions start..start+T-1 of one request whose rows in
        this rank's pool `buffer` are attn_row_ids / kda_row_ids -> PrefillResult (logits [1, V] fp32, or
        [T, V] with `all_logits`, equal on every rank). SPMD: every rank calls it with the same request."""
        if mode not in MODES:
            raise ValueError(f"prefill mode must be one of {MODES}, got {mode!r}")
        num_tokens = int(token_ids.shape[0])
        check_request(self.layout, num_tokens, start, kda_row_ids)
        if mode == "head" and self.cfg.num_heads % self.ctx.world_size:
            raise ValueError(f"{self.cfg.num_heads} MLA heads do not split over {self.ctx.world_size} ranks")
        step = _Step(self, buffer, request_subblocks(self.layout, attn_row_ids, start + num_tokens, buffer.device),
                     kda_row_ids, start, num_tokens, mode)
        begin = step.clock()
        dec, cfg, seg = self.decoder, self.cfg, self.decoder._seg
        own = token_ids.to(buffer.device)[step.me.offsets[0].to(buffer.device)]
        x = dec.embed[own].float()
        for layer in dec.layers:
            if layer.kind == "mla":
                x = step.mla(layer.mixer, x, layer.index)
            else:
                x = step.kda(layer.mixer, x, layer.index)
            f = layer.ffn
            if layer.dense:
                x = seg["_ffn_dense"](x, f["norm"], f["w_gate_up"], f["w_down"], cfg.rms_eps)
            else:
                x = step.moe(f, x)
        logits = step.logits(x, all_logits)
        step.stats.total_s = step.clock() - begin
        self.steps += 1
        return PrefillResult(logits=logits, mode=mode, stats=step.stats)


class _Step:
    """One prefill step of one request on this rank."""

    def __init__(self, owner: TPFastPrefiller, buffer: torch.Tensor, subblocks: torch.Tensor, kda_row_ids: list[int],
                 start: int, num_tokens: int, mode: str) -> None:
        self.p, self.dec, self.cfg, self.ctx, self.layout = owner, owner.decoder, owner.cfg, owner.ctx, owner.layout
        self.buffer, self.subblocks, self.kda_row_ids = buffer, subblocks, kda_row_ids
        self.start, self.num_tokens, self.mode = start, num_tokens, mode
        self.plans = all_plans([num_tokens], self.ctx.world_size, "zigzag" if mode == "token" else "contiguous")
        self.me: ShardPlan = self.plans[self.ctx.rank]
        self.rows = self.me.num_rows
        self.stats = PrefillStats()

    def clock(self) -> float:
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)
        return time.perf_counter()

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows -> every token's [T, ...] in position order."""
        self.stats.exchange_bytes += rows.numel() * rows.element_size() * (self.ctx.world_size - 1)
        return scatter_to_global(all_gather_varlen(self.ctx, rows.contiguous()), self.plans, [self.num_tokens])[0]

    def exchange(self, chunks: list[torch.Tensor], moe: bool = False) -> list[torch.Tensor]:
        sent = sum(c.numel() * c.element_size() for r, c in enumerate(chunks) if r != self.ctx.rank)
        if moe:
            self.stats.moe_exchange_bytes += sent
        else:
            self.stats.exchange_bytes += sent
        return all_to_all_list(self.ctx, [c.contiguous() for c in chunks])

    def to_global(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Rows received from every rank (rank order, each in its plan's order) -> [T, ...] in position order."""
        return scatter_to_global(parts, self.plans, [self.num_tokens])[0]

    def to_owners(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """[T, ...] in position order -> each rank's rows (the chunks of an all-to-all back to the owners)."""
        return [rows[pl.offsets[0].to(rows.device)] for pl in self.plans]

    def output_rows(self, x: torch.Tensor, values: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
        """x (own rows) + W_O(every head's values): values [T, h*v] of this rank's heads for every token are
        all-gathered over heads, this rank's output rows of wo give [T, d/W], and one all-to-all hands every rank
        its own tokens' features [rows, d]."""
        self.stats.exchange_bytes += values.numel() * values.element_size() * (self.ctx.world_size - 1)
        mine = self.dec._seg["_out_rows"](all_heads(self.ctx, values), wo)          # [T, d/W]
        return x + torch.cat(self.exchange(self.to_owners(mine)), dim=1)

    # MLA + DSA
    def mla(self, m: dict[str, Any], x: torch.Tensor, index: int) -> torch.Tensor:
        cfg = self.cfg
        gate, q_abs, latent, key, key_scale, qi, weights = self.dec._seg["_mla_front"](self.gather(x), *m["front"],
                                                                                     **m["front_const"])
        write_tokens(self.buffer, self.layout, self.subblocks, index, self.start, latent, key, key_scale)
        del latent, key
        if self.mode == "token":
            world, heads = self.ctx.world_size, q_abs.shape[1]
            q_own = torch.cat(self.exchange(self.to_owners(q_abs)), dim=1)           # [rows, H, C + R]
            own = self.me.offsets[0].to(x.device)
            qi, weights = qi[own], weights[own]
            began = self.clock()
            o_lat = q_own.new_empty(self.rows, cfg.num_heads, cfg.kv_lora_rank, dtype=torch.float32)
            for row, off, length in contiguous_runs(self.me.offsets[0]):
                rows = slice(row, row + length)
                o_lat[rows] = self.attend(m, index, self.start + off, q_own[rows], qi[rows], weights[rows])
            self.stats.attention_s += self.clock() - began
            o_mine = self.to_global(self.exchange([o_lat[:, r * heads:(r + 1) * heads] for r in range(world)]))
        else:
            began = self.clock()
            o_mine = self.attend(m, index, self.start, q_abs, qi, weights)           # [T, h, kv_lora]
            self.stats.attention_s += self.clock() - began
        return self.output_rows(x, self.dec._seg["_mla_values"](gate, o_mine, m["w_uv"]), m["wo"])

    def attend(self, m: dict[str, Any], index: int, first: int, q_abs: torch.Tensor, qi: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
        """Indexer + sparse MLA of the queries at positions first..first+n-1 -> o^lat [n, heads, kv_lora]."""
        selected = prefill_select(self.buffer, self.layout, self.subblocks, index, first, qi, weights,
                                  self.cfg.index_topk, num_keys=self.start + self.num_tokens)
        return attend_selected(self.buffer, self.layout, self.subblocks, index, first, q_abs, selected, m,
                               self.cfg.kv_lora_rank)

    # KDA
    def kda(self, m: dict[str, Any], x: torch.Tensor, index: int) -> torch.Tensor:
        gate, g, beta, conv_in = self.dec._seg["_kda_front"](self.gather(x), *m["front"], **m["front_const"])
        group, layer_in_group = divmod(index, self.layout.kda_layers_per_group)
        o = kda_prefill_rows(self.buffer, self.layout, self.kda_row_ids[group], layer_in_group, self.p.conv_dtype,
                             conv_in, m["conv_weight"], g, beta, self.p.use_fla)      # [T, h_K, d]
        return self.output_rows(x, self.dec._seg["_kda_values"](gate, o, m["o_norm"], self.cfg.rms_eps), m["wo"])

    # MoE (expert parallel)
    def moe(self, f: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        cfg, dec, world = self.cfg, self.dec, self.ctx.world_size
        shared, ids, weights, z = dec._seg["_moe_route"](x, f["norm"], f["router"], f["bias"], f["w_h"],
                                                         cfg.rms_eps, cfg.num_experts_per_tok,
                                                         cfg.routed_scaling_factor, f["latent"])
        owner = ids // dec.per_rank                                                 # [rows, k]
        wanted = [(owner == r).any(1).nonzero().flatten() for r in range(world)]
        z_in = self.exchange([z[rows] for rows in wanted], moe=True)
        ids_in = self.exchange([ids[rows] for rows in wanted], moe=True)
        pairs, counts = [], []
        for zr, ir in zip(z_in, ids_in):
            mine = (ir >= dec.first) & (ir < dec.first + dec.per_rank)
            pr, pc = mine.nonzero(as_tuple=True)
            pairs.append((zr[pr], ir[pr, pc] - dec.first))
            counts.append(int(pr.shape[0]))
        out = expert_pairs(torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]), f["w1"], f["w3"],
                           f["w2"])
        returned = self.exchange(list(out.split(counts)), moe=True)
        slots = z.new_zeros(ids.shape[0], ids.shape[1], z.shape[1])
        for r, rows in enumerate(wanted):
            pr, pc = (owner[rows] == r).nonzero(as_tuple=True)
            slots[rows[pr], pc] = returned[r]
        mixed = torch.bmm(weights.float().unsqueeze(1), slots.float()).squeeze(1)   # as grouped_experts mixes
        return dec._seg["_moe_out"](x, shared, mixed, None, f["latent_norm"], f["w_up_latent"], f["shared_down"],
                                    cfg.rms_eps)

    # logits
    def logits(self, x: torch.Tensor, all_logits: bool) -> torch.Tensor:
        dec, cfg = self.dec, self.cfg
        if all_logits:
            return self.gather(dec._seg["_head"](x, dec.final_norm, dec.lm_head, cfg.rms_eps))
        offsets = self.me.offsets[0]
        has_last = bool(offsets.numel()) and int(offsets[-1]) == self.num_tokens - 1
        mine = (dec._seg["_head"](x[-1:], dec.final_norm, dec.lm_head, cfg.rms_eps) if has_last
                else x.new_zeros(0, cfg.vocab_size))
        return torch.cat(all_gather_varlen(self.ctx, mine), dim=0)                  # [1, V]: one rank's row
