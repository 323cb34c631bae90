"""P -> D read plans: which bytes of which prefill rank's rows each decode rank reads, and into where.

Inputs: P's `RowLayout` (TP=a, block Bp, dcp 1), D's `RowLayout` (TP=b, optionally DCP=W, block Bd), the
request's token count and row ids on both sides (one block table per instance: every rank of an instance
uses the same row ids in its own pool). Output: `plan_reads(...) -> ReadPlan`, per D rank a list of
`ReadOp(p_rank, p_row, p_offset, length, d_row, d_offset)` in pool-relative bytes (`p_row * row_bytes +
p_offset`); adjacent ops whose source and destination both continue are merged, so a merged op may run
across consecutive rows.

Sources: attention rows are replicated over P's TP ranks, KDA rows are head-sharded. D rank r reads its
KDA heads `[r*H/b, (r+1)*H/b)` from the P rank(s) holding them, and its attention bytes from the P rank
holding its first head (`attention_source`). So with a <= b every D rank reads from exactly one P rank (one
READ), D ranks spread evenly over P ranks; with a > b a D rank reads from a/b P ranks (one READ each).

Attention bytes: rows are sub-block-major, so any aligned power-of-two token run is one contiguous range.
- Bp == Bd: one op per row. Bp > Bd: each P row splits into Bp/Bd contiguous D rows. Bp < Bd: each D row
  gathers Bd/Bp P rows. Ranges never cross a row boundary before merging.
- DCP=W: D rank `tp_rank % W` owns the tokens of every W-th ownership unit of `dcp_interleave` tokens
  (a power-of-two multiple of the sub-block; `layout.default_dcp_interleave` picks the smallest unit of
  >= 256 KiB, where one descriptor runs within ~10% of the single-descriptor ceiling). Each owned unit is
  one op (split where it crosses a P row). Single-token interleave would scatter every token into 2 pieces
  per DSA layer (K3.1 Pro: 576 + 132 bytes, 48 descriptors per token); sub-block units keep each piece
  `unit * a` bytes: 1.09 MB for Pro at 64 tokens, 75.8-151.6 KB for mini at 256-512 tokens.
Tokens past the request's end are rounded up to whole sub-blocks (padding bytes move with them).
Incremental reads: `skip_tokens` (whole D blocks D's prefix cache already holds) are not read; the KDA rows
always are (they hold the state at the prompt's end).

Pairing: `pair_problems(p, d) -> list[str]` is the pure check the router's pairing matrix calls with any
objects carrying `tp`, `dcp`, `block_size`, `layout_fingerprint` (kv_transfer.geometry.Geometry);
`layout_pair_problems(p_layout, d_layout)` checks two full layouts. An empty list means compatible;
`plan_reads` raises `IncompatiblePair` with the same reasons before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.layout import RowLayout


class IncompatiblePair(ValueError):
    """P and D layouts that cannot be remapped; the message lists every reason."""


@dataclass(frozen=True)
class ReadOp:
    """Copy `length` bytes from P rank `p_rank` (row p_row, offset p_offset) to this D rank (d_row, d_offset)."""

    p_rank: int
    p_row: int
    p_offset: int
    length: int
    d_row: int
    d_offset: int
    kind: str = "attn"
    """attn or kda (a merged op keeps the first piece's kind)."""


@dataclass
class ReadPlan:
    """Per D rank, its read ops (merged) grouped by the P rank they read from."""

    reads: dict[int, list[ReadOp]] = field(default_factory=dict)
    """d_rank -> ops, in posting order."""

    def by_source(self, d_rank: int) -> dict[int, list[ReadOp]]:
        """P rank -> ops of d_rank: each entry is one READ."""
        out: dict[int, list[ReadOp]] = {}
        for op in self.reads.get(d_rank, []):
            out.setdefault(op.p_rank, []).append(op)
        return out

    def num_reads(self) -> int:
        return sum(len(self.by_source(r)) for r in self.reads)

    def consumers(self) -> list[tuple[int, int]]:
        """(d_rank, p_rank) pairs, one per READ: P frees the lease after this many notifications."""
        return sorted((d, p) for d in self.reads for p in self.by_source(d))


def _is_pow2(n: int | None) -> bool:
    return n is not None and n > 0 and n & (n - 1) == 0


def pair_problems(p: Any, d: Any) -> list[str]:
    """Why a P instance cannot feed a D instance, from geometry alone (kv_transfer.geometry.Geometry or a
    RowLayout-like object with tp/dcp/block_size/layout_fingerprint). Empty list = compatible."""
    get = lambda obj, *names: next((getattr(obj, n) for n in names if getattr(obj, n, None) is not None), None)  # noqa: E731
    problems: list[str] = []
    pf, df = get(p, "layout_fingerprint", "fingerprint"), get(d, "layout_fingerprint", "fingerprint")
    if pf is None or df is None:
        problems.append("layout fingerprint unknown")
    elif pf != df:
        problems.append(f"layout fingerprints differ ({pf} vs {df}): formats, sub-block or model shapes differ")
    p_tp, d_tp = get(p, "tp", "tp_size") or 1, get(d, "tp", "tp_size") or 1
    p_dcp, d_dcp = get(p, "dcp", "dcp_size") or 1, get(d, "dcp", "dcp_size") or 1
    if p_dcp != 1:
        problems.append(f"prefill DCP {p_dcp} unsupported: DCP is a decode-pool layout")
    if not _is_pow2(d_dcp) or d_tp % d_dcp:
        problems.append(f"decode DCP {d_dcp} must be a power of two dividing decode TP {d_tp}")
    for label, value in (("prefill TP", p_tp), ("decode TP", d_tp)):
        if not _is_pow2(value):
            problems.append(f"{label} {value} is not a power of two (KDA head slices would not nest)")
    for label, obj in (("prefill", p), ("decode", d)):
        bs = get(obj, "block_size")
        if bs is None:
            problems.append(f"{label} block size unknown")
        elif not _is_pow2(bs):
            problems.append(f"{label} block size {bs} is not a power of two")
    return problems


def layout_pair_problems(p: RowLayout, d: RowLayout) -> list[str]:
    """pair_problems plus what full layouts reveal (head counts, sub-block, DCP unit)."""
    problems = pair_problems(p, d)
    if p.kda_heads_total != d.kda_heads_total:
        problems.append(f"KDA head counts differ ({p.kda_heads_total} vs {d.kda_heads_total})")
    if p.subblock_tokens != d.subblock_tokens:
        problems.append(f"sub-block sizes differ ({p.subblock_tokens} vs {d.subblock_tokens})")
    if d.dcp_size > 1 and d.dcp_interleave % d.subblock_tokens:
        problems.append(f"decode DCP unit {d.dcp_interleave} is not whole sub-blocks of {d.subblock_tokens}")
    return problems


def attention_source(p: RowLayout, d: RowLayout, d_rank: int) -> int:
    """P rank that D rank d_rank reads attention bytes from: the one holding its first KDA head."""
    return (d_rank * d.kda_heads_per_gpu) // p.kda_heads_per_gpu


def _merge(ops: list[ReadOp], p_row_bytes: int, d_row_bytes: int) -> list[ReadOp]:
    out: list[ReadOp] = []
    for op in ops:
        if out:
            last = out[-1]
            p_end = last.p_row * p_row_bytes + last.p_offset + last.length
            d_end = last.d_row * d_row_bytes + last.d_offset + last.length
            if (op.p_rank == last.p_rank and op.p_row * p_row_bytes + op.p_offset == p_end
                    and op.d_row * d_row_bytes + op.d_offset == d_end):
                out[-1] = ReadOp(last.p_rank, last.p_row, last.p_offset, last.length + op.length,
                                 last.d_row, last.d_offset, last.kind)
                continue
        out.append(op)
    return out


def _owned_units(d: RowLayout, d_rank: int, padded_tokens: int) -> list[tuple[int, int]]:
    """Token ranges [t0, t1) of the request that D rank d_rank stores."""
    if d.dcp_size == 1:
        return [(0, padded_tokens)]
    r, u, w = d_rank % d.dcp_size, d.dcp_interleave, d.dcp_size
    return [(g * u, min((g + 1) * u, padded_tokens)) for g in range(r, -(-padded_tokens // u), w)]


def _attention_ops(p, d, d_rank, src, num_tokens, p_rows, d_rows, skip_tokens: int = 0) -> list[ReadOp]:
    a, b0 = p.attn_bytes_per_token, p.subblock_tokens
    padded = -(-num_tokens // b0) * b0
    ops: list[ReadOp] = []
    for t0, t1 in _owned_units(d, d_rank, padded):
        t = max(t0, skip_tokens)
        while t < t1:
            local = d.dcp_local_token(t) if d.dcp_size > 1 else t
            p_left = p.tokens_per_row - t % p.tokens_per_row
            d_left = d.tokens_per_row - local % d.tokens_per_row
            n = min(t1 - t, p_left, d_left)
            ops.append(ReadOp(src, p_rows[t // p.tokens_per_row], (t % p.tokens_per_row) * a, n * a,
                              d_rows[local // d.tokens_per_row], (local % d.tokens_per_row) * a, "attn"))
            t += n
    return ops


def _kda_ops(p: RowLayout, d: RowLayout, d_rank: int, p_kda: list[int], d_kda: list[int]) -> list[ReadOp]:
    h0, h1 = d.global_heads(d_rank)
    ops: list[ReadOp] = []
    for g in range(d.kda_groups):
        for p_rank in range(h0 // p.kda_heads_per_gpu, -(-h1 // p.kda_heads_per_gpu)):
            ps, pe = p.global_heads(p_rank)
            lo, hi = max(h0, ps), min(h1, pe)
            ops.append(ReadOp(p_rank, p_kda[g], (lo - ps) * p.kda_head_bytes, (hi - lo) * p.kda_head_bytes,
                              d_kda[g], (lo - h0) * d.kda_head_bytes, "kda"))
    return ops


def plan_reads(
    p: RowLayout,
    d: RowLayout,
    num_tokens: int,
    p_attn_rows: list[int],
    p_kda_rows: list[int],
    d_attn_rows: list[int],
    d_kda_rows: list[int],
    skip_tokens: int = 0,
) -> ReadPlan:
    """The read plan of one request (see the module docstring). Raises IncompatiblePair or ValueError
    before producing anything if the pair or the row lists do not fit. `skip_tokens` (whole D blocks): D already
    holds the attention KV of the first skip_tokens tokens (prefix cache), so only the later tokens and the KDA
    state are read; the D rows of the skipped blocks are not touched."""
    problems = layout_pair_problems(p, d)
    if problems:
        raise IncompatiblePair("; ".join(problems))
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    if skip_tokens < 0 or skip_tokens % d.block_size or skip_tokens > num_tokens:
        raise ValueError(f"skip_tokens {skip_tokens} must be whole D blocks of {d.block_size} within {num_tokens}")
    for label, rows, need in (
        ("P attention rows", p_attn_rows, -(-num_tokens // p.block_size)),
        ("P KDA rows", p_kda_rows, p.kda_groups),
        ("D KDA rows", d_kda_rows, d.kda_groups),
    ):
        if len(rows) != need:
            raise ValueError(f"{label}: {len(rows)} given, {need} needed for {num_tokens} tokens")
    # D usually holds more attention rows than the transferred tokens fill (room for what it will generate):
    # the first ones receive the tokens, the rest are not touched.
    d_need = -(-num_tokens // d.block_size)
    if len(d_attn_rows) < d_need:
        raise ValueError(f"D attention rows: {len(d_attn_rows)} given, {d_need} needed for {num_tokens} tokens")
    d_attn_rows = d_attn_rows[:d_need]
    plan = ReadPlan()
    for d_rank in range(d.tp_size):
        src = attention_source(p, d, d_rank)
        ops = _kda_ops(p, d, d_rank, p_kda_rows, d_kda_rows)
        ops += _attention_ops(p, d, d_rank, src, num_tokens, p_attn_rows, d_attn_rows, skip_tokens)
        ops.sort(key=lambda o: (o.p_rank, o.kind != "kda"))
        plan.reads[d_rank] = _merge(ops, p.row_bytes, d.row_bytes)
    return plan


def naive_subblock_map(p: RowLayout, d: RowLayout, num_tokens: int, d_rank: int,
                       p_attn_rows: list[int], d_attn_rows: list[int]) -> dict[int, int]:
    """Reference for tests, one sub-block at a time: D pool offset -> P pool offset of every attention
    sub-block D rank d_rank stores (a sub-block is `subblock_bytes` contiguous bytes on both sides)."""
    b0 = p.subblock_tokens
    out: dict[int, int] = {}
    for t in range(0, -(-num_tokens // b0) * b0, b0):
        if d.dcp_size > 1 and d.dcp_owner(t) != d_rank % d.dcp_size:
            continue
        local = d.dcp_local_token(t) if d.dcp_size > 1 else t
        p_off = p_attn_rows[t // p.tokens_per_row] * p.row_bytes + (t % p.tokens_per_row) // b0 * p.subblock_bytes
        d_off = d_attn_rows[local // d.tokens_per_row] * d.row_bytes + (local % d.tokens_per_row) // b0 * d.subblock_bytes
        out[d_off] = p_off
    return out
