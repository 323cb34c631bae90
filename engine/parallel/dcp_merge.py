"""Exact global top-k of the DSA indexer under DCP: the compact merge and the generic baseline.

Each DCP rank scores only the tokens it owns (`DCPLayout`); the selection must equal the monolithic
stable top-k: the k best scores, ties to the lower global position, tokens scored -inf never selected
(a query with fewer than k earlier tokens keeps them all). Both merges are exact; they differ in bytes.

Generic merge (baseline, vLLM's): every rank all-gathers its full local top-k as (fp32 score, int32 id),
8 bytes a candidate, and every rank runs one stable top-k over the union.

Compact merge: every rank all-gathers only its best m = ceil(1.5 k / W) candidates as one 32-bit word each,
in its stable local order: `word = key << slot_bits | slot`, `key` = the top `key_bits` bits of an
order-preserving map of the fp32 score (monotone: a higher score never gets a lower key; -0.0 == +0.0),
`slot` = the candidate's place in the rank's stable local order. Word 0 means "no candidate".
Packing choice: a receiver already knows every word's (rank, slot) from its place in the gathered buffer,
so the default `key_bits=32` spends all 32 bits on the key (the exact fp32 order) and leaves the slot
implicit; `key_bits=16` is the 16-bit key + 16-bit slot packing. The key width only changes how often the
exact round runs (benchmarks/dcp.py measures it: with 16-bit keys the boundary bucket spans ranks in
nearly every row; with 32-bit keys only exact cross-rank ties at the boundary or a saturated rank do).
Every rank computes, from the same gathered words, the same decision: T = the k-th largest key; all
candidates with key > T are selected; of the bucket key == T, the `need` best are selected, which is
decidable when the bucket lives on one rank (its slot order is the exact order, because local order ==
global order within a rank) or when the whole bucket is taken.
A row falls back (second, exact round) when
  * a rank is *saturated*: it sent m valid candidates and its last one has key >= T, so its unsent tokens
    might belong to the global top-k; that rank resends its full local top-k (the entries past m go out in
    one broadcast per saturated rank); or
  * the bucket is *ambiguous*: it spans several ranks and not all its members are selected (truncated keys
    or exact score ties across ranks cannot be ordered from the words).
  In the exact round every rank resends its m candidates as (fp32 score, int32 id) for the fallback rows,
  and every rank runs the generic stable merge over them (plus the saturated ranks' extra entries).
Why the first round is exact otherwise: a non-saturated rank's unsent tokens have key <= its last key < T,
and at least k candidates have key >= T, so none of them can be selected; every token with key > T is
beaten by fewer than k tokens; the bucket is resolved exactly as argued above.
The selection decision is a per-rank count: rank q's selected tokens are the first counts[q] entries of its
stable local order; every rank computes the same counts [B, W].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.parallel.comm import all_gather_stack
from engine.parallel.dcp_layout import DCPLayout
from engine.parallel.groups import ParallelContext

NEG_INF = float("-inf")


@dataclass(frozen=True)
class MergeResult:
    """One rank's outcome of a global top-k merge over a batch of B query rows."""

    local_ids: torch.Tensor
    """[B, k] int64: local indices this rank owns in the global top-k, ascending, padded with -1."""
    counts: torch.Tensor
    """[B, W] int64: global top-k entries owned by each rank (identical on every rank)."""
    num_fallback_rows: int
    """Rows that needed the exact second round (compact merge only)."""
    bytes_sent: int
    """Payload bytes this rank contributed to the collectives (all rows, both rounds)."""


def candidates_per_rank(k: int, world_size: int) -> int:
    return min(k, math.ceil(1.5 * k / world_size))


def order_key(scores: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 in [0, 2^32) with a < b  <=>  key(a) < key(b) (and -0.0 mapped to +0.0)."""
    bits = (scores.float() + 0.0).contiguous().view(torch.int32).long()
    unsigned = bits & 0xFFFFFFFF
    return torch.where(bits < 0, (~unsigned) & 0xFFFFFFFF, unsigned | 0x80000000)


def stable_order(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort rows by (score desc, index asc). -0.0 is normalised so it ties with +0.0."""
    return torch.sort(scores.float() + 0.0, dim=-1, descending=True, stable=True)


def naive_topk_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Monolithic reference: [B, L] scores -> [B, k] selected positions, ascending, -1 padded."""
    vals, idx = stable_order(scores)
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int64)
    for b in range(scores.shape[0]):
        chosen = idx[b, : k][vals[b, : k] > NEG_INF]
        out[b, : chosen.numel()] = chosen.sort().values
    return out


def _pad_cols(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
    if x.shape[1] >= width:
        return x[:, :width]
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype)
    return torch.cat([x, pad], dim=1)


def _local_ids_from_counts(order_idx: torch.Tensor, counts_me: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.full((order_idx.shape[0], k), -1, dtype=torch.int64)
    for b, c in enumerate(counts_me.tolist()):
        if c:
            out[b, :c] = order_idx[b, :c].sort().values
    return out


def exact_select(scores: torch.Tensor, gids: torch.Tensor, k: int, layout: DCPLayout
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable top-k over gathered exact candidates [W, R, n] (gid -1 = empty).

    Returns (selected global ids [R, k] in selection order, -1 padded; per-rank counts [R, W]).
    """
    width = scores.shape[0] * scores.shape[2]
    flat_s = scores.permute(1, 0, 2).reshape(-1, width)
    flat_g = gids.permute(1, 0, 2).reshape(-1, width)
    flat_s = torch.where(flat_g < 0, torch.full_like(flat_s, NEG_INF), flat_s)
    by_id = torch.sort(torch.where(flat_g < 0, torch.iinfo(torch.int64).max, flat_g), dim=1, stable=True)
    s_by_id = flat_s.gather(1, by_id.indices)
    g_by_id = flat_g.gather(1, by_id.indices)
    order = torch.sort(s_by_id, dim=1, descending=True, stable=True).indices[:, :k]
    chosen_s = s_by_id.gather(1, order)
    chosen_g = torch.where(chosen_s > NEG_INF, g_by_id.gather(1, order), -1)
    chosen_g = _pad_cols(chosen_g, k, -1)
    owners = torch.where(chosen_g >= 0, layout.owner(chosen_g.clamp(min=0)), layout.world_size)
    counts = torch.nn.functional.one_hot(owners, layout.world_size + 1).sum(1)[:, : layout.world_size]
    return chosen_g, counts


def generic_merge(ctx: ParallelContext, local_scores: torch.Tensor, k: int, layout: DCPLayout
                  ) -> MergeResult:
    """Baseline: all-gather every rank's full local top-k as (fp32 score, int32 id)."""
    vals, idx = stable_order(local_scores)
    gids_local = layout.global_ids(ctx.rank, local_scores.shape[1])
    top_s = _pad_cols(vals[:, :k], k, NEG_INF)
    top_g = _pad_cols(torch.where(vals[:, :k] > NEG_INF, gids_local[idx[:, :k]], -1), k, -1)
    if ctx.is_single:
        _, counts = exact_select(top_s[None], top_g[None], k, layout)
        return MergeResult(_local_ids_from_counts(idx, counts[:, 0], k), counts, 0, 0)
    all_s = all_gather_stack(ctx, top_s)
    all_g = all_gather_stack(ctx, top_g.to(torch.int32)).long()
    _, counts = exact_select(all_s, all_g, k, layout)
    sent = top_s.numel() * 4 + top_g.numel() * 4
    return MergeResult(_local_ids_from_counts(idx, counts[:, ctx.rank], k), counts, 0, sent)


@dataclass(frozen=True)
class CandidateDecision:
    """What every rank concludes from the gathered compact words (identical on all ranks)."""

    counts: torch.Tensor      # [B, W] selected per rank, valid where fallback is False
    fallback: torch.Tensor    # [B] bool
    saturated: torch.Tensor   # [W, B] bool


def pack_candidates(sorted_scores: torch.Tensor, m: int, key_bits: int) -> torch.Tensor:
    """[B, n] stably sorted scores -> [B, m] int32 words (0 = no candidate)."""
    slot_bits = 32 - key_bits
    cand = _pad_cols(sorted_scores, m, NEG_INF)
    keys = order_key(cand) >> slot_bits
    slots = torch.arange(m, dtype=torch.int64).expand_as(keys) & ((1 << slot_bits) - 1)
    words = torch.where(cand > NEG_INF, (keys << slot_bits) | slots, 0)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def resolve_candidates(words: torch.Tensor, k: int, key_bits: int) -> CandidateDecision:
    """[W, B, m] gathered words -> the shared selection decision (pure; same on every rank)."""
    unsigned = words.long() & 0xFFFFFFFF
    valid = unsigned != 0
    keys = torch.where(valid, unsigned >> (32 - key_bits), 0)
    num_ranks, rows, m = keys.shape
    flat = keys.permute(1, 0, 2).reshape(rows, num_ranks * m)
    top = flat.sort(dim=1, descending=True).values
    kth = top[:, k - 1] if top.shape[1] >= k else torch.zeros(rows, dtype=torch.int64)
    thresh = torch.where(valid.sum((0, 2)) >= k, kth, 0)                   # [B]; 0 = "take every valid"
    gt = valid & (keys > thresh[None, :, None])
    eq = valid & (keys == thresh[None, :, None]) & (thresh[None, :, None] > 0)
    need = torch.where(thresh > 0, k - gt.sum((0, 2)), 0)                  # [B]
    in_bucket = eq.sum(2)                                                   # [W, B]
    bucket_ranks = (in_bucket > 0).sum(0)
    ambiguous = (in_bucket.sum(0) > need) & (bucket_ranks > 1)
    saturated = valid[:, :, m - 1] & (keys[:, :, m - 1] >= thresh[None])
    take_eq = torch.where(in_bucket.sum(0)[None] > need[None], torch.minimum(in_bucket, need[None]), in_bucket)
    counts = (gt.sum(2) + take_eq).T.contiguous()
    return CandidateDecision(counts=counts, fallback=ambiguous | saturated.any(0), saturated=saturated)


def _exact_payload(vals: torch.Tensor, idx: torch.Tensor, gids_local: torch.Tensor, rows: torch.Tensor,
                   start: int, stop: int, limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries [start, stop) of the stable local order of `rows` as (fp32, gid); beyond `limit` empty."""
    width = stop - start
    s = _pad_cols(vals[rows, start:stop], width, NEG_INF)
    g = _pad_cols(gids_local[idx[rows, start:stop]], width, -1)
    keep = ((torch.arange(start, stop)[None] < limit[:, None]) & (s > NEG_INF))
    return torch.where(keep, s, NEG_INF), torch.where(keep, g, -1)


def _exact_round(ctx: ParallelContext, vals: torch.Tensor, idx: torch.Tensor, layout: DCPLayout,
                 rows: torch.Tensor, saturated: torch.Tensor, k: int, m: int) -> tuple[torch.Tensor, int]:
    """Second round for fallback `rows`: every rank sends its m candidates exactly (fp32 + id); each
    saturated rank q also broadcasts its local entries m..k-1 for the rows where it is saturated.
    Returns (per-rank counts [F, W], bytes this rank sent)."""
    n_local = vals.shape[1]
    gids_local = layout.global_ids(ctx.rank, n_local)
    full = torch.full((rows.numel(),), n_local, dtype=torch.int64)
    base_s, base_g = _exact_payload(vals, idx, gids_local, rows, 0, m, full)
    all_s = [all_gather_stack(ctx, base_s)]
    all_g = [all_gather_stack(ctx, base_g.to(torch.int32)).long()]
    sent = base_s.numel() * 8
    if k > m:
        for q in saturated.any(1).nonzero().flatten().tolist():
            limit = torch.where(saturated[q], n_local, 0)            # only q's saturated rows
            ext_s, ext_g = _exact_payload(vals, idx, gids_local, rows, m, k, limit)
            ext_g = ext_g.to(torch.int32)
            if ctx.rank != q:
                ext_s, ext_g = torch.empty_like(ext_s), torch.empty_like(ext_g)
            else:
                sent += ext_s.numel() * 8
            torch.distributed.broadcast(ext_s, src=q, group=ctx.group)
            torch.distributed.broadcast(ext_g, src=q, group=ctx.group)
            pad_s = torch.full((ctx.world_size,) + tuple(ext_s.shape), NEG_INF)
            pad_g = torch.full((ctx.world_size,) + tuple(ext_g.shape), -1, dtype=torch.int64)
            pad_s[q], pad_g[q] = ext_s, ext_g.long()
            all_s.append(pad_s)
            all_g.append(pad_g)
    _, counts = exact_select(torch.cat(all_s, 2), torch.cat(all_g, 2), k, layout)
    return counts, sent


def compact_merge(ctx: ParallelContext, local_scores: torch.Tensor, k: int, layout: DCPLayout,
                  key_bits: int = 32) -> MergeResult:
    """The compact exact merge (module docstring). World size 1 is the plain stable local top-k."""
    vals, idx = stable_order(local_scores)
    if ctx.is_single:
        counts = (vals[:, :k] > NEG_INF).sum(1, keepdim=True)
        return MergeResult(_local_ids_from_counts(idx, counts[:, 0], k), counts, 0, 0)
    m = candidates_per_rank(k, ctx.world_size)
    if key_bits < 32 and (1 << (32 - key_bits)) < m or key_bits < 8 or key_bits > 32:
        raise ValueError(f"key_bits={key_bits} leaves no room for {m} slots in 32 bits")
    words = pack_candidates(vals, m, key_bits)
    decision = resolve_candidates(all_gather_stack(ctx, words), k, key_bits)
    counts = decision.counts.clone()
    sent = words.numel() * 4
    fb_rows = decision.fallback.nonzero().flatten()
    if fb_rows.numel():
        fb_counts, fb_sent = _exact_round(ctx, vals, idx, layout, fb_rows, decision.saturated[:, fb_rows], k, m)
        counts[fb_rows] = fb_counts
        sent += fb_sent
    local_ids = _local_ids_from_counts(idx, counts[:, ctx.rank], k)
    return MergeResult(local_ids, counts, int(fb_rows.numel()), sent)
