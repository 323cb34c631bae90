"""Placement policy, pure: which decode pool, decode instance and prefill instances serve a request.

Inputs are frozen snapshots (instances, pools, the session's record, compatible and warm pairs); the
output is a `Placement`. Rules:
- session: `X-Session-ID` header, else the body's `user`; no session -> a one-off request.
- projected context = max(prompt estimate, the session's known context) + max_tokens + expected growth
  (setting or the `X-Expected-Context-Tokens` hint). Pools that fit it: TP pools first (smallest capacity
  that fits), then DCP pools; when none fits, the largest pool.
- sticky: a session stays on its decode instance (prefix reuse) while that instance is usable and its
  pool still fits; it migrates explicitly (`is_migration`) when it outgrows the pool.
- a decode instance whose circuit breaker lets nothing through (`blocked`) is not usable; a P->D link
  whose breaker is open is not in `compatible` (RouterState.usable_pairs).
- least-loaded decode within the pool (router in-flight + node running/waiting + KV usage), preferring
  instances that have a usable compatible prefill. With `hash_sessions` (a router of several worker
  processes, each with its own session table) a session that needs an instance (new to this worker, or
  its instance unusable) goes to the one its id hashes to (rendezvous hashing over the pool's usable
  decodes, same preference), so every worker picks the same instance for it.
- prefill ranking: compatible and usable only, least-loaded, warm (already handshaken) pairs preferred.
- conditional disaggregation: skip the P leg when the uncached part of the prompt (prompt minus what the
  chosen decode instance already holds) is below `min_uncached_tokens`, or when no prefill is compatible.
- routing by cache (`held`: instance -> tokens of this session its prefix cache holds, from the nodes'
  `/v1/cache` reports and finished turns, router/cache_view.py): within the session's pool the decode
  instance holding the most of it wins over stickiness and load; a session this router has no record of
  goes back to the pool of the instance holding it; "cached" for the P-leg decision is only what the chosen
  decode instance reported it can resume a local prefill from (`resumable`; never the router's own guess).
  A session that outgrows its pool migrates (the new pool's instance then receives the whole KV once).
  Prefills holding more of the session rank first, then by load.
- session growth moves KV decode-to-decode (`move_source`): when a session migrates, the old pool's usable
  decode instance holding the most of it, where that instance -> the new decode instance is a usable move pair
  (`move_pairs`: compat.move_matrix, link and source breakers closed), runs the P leg in a prefill's place, first
  of `prefills`: it prefills only the new tokens on top of its prefix cache and leases the whole prompt's rows,
  which the new instance READs. The prefills ranked as usual follow it (the fallback when that leg fails).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from router.registry import InstanceView

WARM_PAIR_BONUS = 2.0
"""Load units a cold P-D pair must be ahead by to be picked over a warm one (first handshake is slow)."""


@dataclass(frozen=True)
class PoolView:
    name: str
    kind: str
    capacity_tokens: int | None


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    pool: str
    decode: str
    context_tokens: int
    last_seen: float


# Not frozen: built per request, and a frozen dataclass's __init__ (object.__setattr__ per field) costs about
# twice a plain one on the hot path. Nothing mutates it once built (changes go through dataclasses.replace).
@dataclass
class RequestShape:
    session_id: str | None
    prompt_tokens: int
    max_tokens: int
    expected_growth_tokens: int
    cache_scope: str = ""
    """The tenant's prefix-cache scope (router/identity.py `cache_scope`; "" without API keys)."""


# Not frozen: built per request, and a frozen dataclass's __init__ (object.__setattr__ per field) costs about
# twice a plain one on the hot path. Nothing mutates it once built (changes go through dataclasses.replace).
@dataclass
class Placement:
    pool: str
    decode: str
    prefills: tuple[str, ...]
    disaggregate: bool
    is_migration: bool
    reason: str
    projected_tokens: int
    cached_tokens_estimate: int
    move_source: str | None = None
    """The decode instance whose kept KV of the session moves to `decode` (the first of `prefills`), or None."""


class NoPlacement(Exception):
    """No decode instance can take the request (the message says why)."""


def session_id_of(headers: Mapping[str, str], body: Mapping) -> str | None:
    value = headers.get("x-session-id") or body.get("user")
    return str(value) if isinstance(value, (str, int)) and str(value) else None


def estimate_prompt_tokens(body: Mapping, chars_per_token: float) -> int:
    """Tokenize-free prompt length: token-id lists count exactly, text by characters."""
    def text_tokens(text: str) -> int:
        return int(len(text) / chars_per_token) + 1

    if "messages" in body:
        total = 0
        for message in body["messages"]:
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, str):
                total += text_tokens(content)
            elif isinstance(content, list):
                total += sum(text_tokens(str(p.get("text", ""))) for p in content if isinstance(p, Mapping))
            total += 4
        return total
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return max(len(p) for p in prompt)
    return sum(text_tokens(p) for p in prompt if isinstance(p, str))


def estimate_prompt_tokens_bytes(body: Mapping) -> int:
    """Prompt tokens under the reference engine's byte-level tokenizer (node/tokenizer.py ServerTokenizer):
    chat = BOS + per message (ROLE id, UTF-8 of "role\\ncontent", END id) + ROLE id + "assistant\\n";
    text = BOS + its UTF-8 bytes; token ids count as they are. Exact for that tokenizer."""
    def utf8(text: str) -> int:
        return len(text.encode("utf-8", "surrogatepass"))

    if "messages" in body:
        total = 2 + len("assistant\n")
        for message in body["messages"]:
            if not isinstance(message, Mapping):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
            total += 3 + utf8(str(message.get("role", ""))) + (utf8(content) if isinstance(content, str) else 0)
        return total
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return 1 + utf8(prompt) if prompt else 0
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return max(len(p) for p in prompt)
    return max((1 + utf8(p) for p in prompt if isinstance(p, str)), default=0)


def projected_context(shape: RequestShape, session: SessionRecord | None) -> int:
    known = session.context_tokens if session else 0
    return max(shape.prompt_tokens, known) + shape.max_tokens + shape.expected_growth_tokens


def _fits(pool: PoolView, tokens: int) -> bool:
    return pool.capacity_tokens is None or pool.capacity_tokens >= tokens


def _capacity_key(pool: PoolView) -> float:
    return float("inf") if pool.capacity_tokens is None else float(pool.capacity_tokens)


def choose_pool(pools: list[PoolView], projected_tokens: int) -> PoolView:
    """Smallest fitting TP pool, else smallest fitting DCP pool, else the largest pool."""
    if not pools:
        raise NoPlacement("no decode pool has a usable instance")
    for kind in ("tp", "dcp"):
        fitting = [p for p in pools if p.kind == kind and _fits(p, projected_tokens)]
        if fitting:
            return min(fitting, key=lambda p: (_capacity_key(p), p.name))
    return max(pools, key=lambda p: (_capacity_key(p), p.name))


def load_score(view: InstanceView) -> float:
    return view.num_inflight + view.load.num_running + 2.0 * view.load.num_waiting + 4.0 * view.load.kv_usage


def rank_prefills(prefills: list[InstanceView], decode: str, compatible: frozenset[tuple[str, str]],
                  warm: frozenset[tuple[str, str]], held: Mapping[str, int] | None = None) -> tuple[str, ...]:
    """Usable prefills compatible with `decode`, best first: the most of the session cached (`held`), then
    least loaded, warm pairs favoured."""
    ok = [p for p in prefills if p.is_usable and (p.name, decode) in compatible]
    held = held or {}
    key = lambda p: (-held.get(p.name, 0), load_score(p) - (WARM_PAIR_BONUS if (p.name, decode) in warm else 0.0),  # noqa: E731
                     p.name)
    return tuple(p.name for p in sorted(ok, key=key))


def choose_decode(candidates: list[InstanceView], prefills: list[InstanceView],
                  compatible: frozenset[tuple[str, str]]) -> InstanceView:
    """Least-loaded usable decode, preferring those with a usable compatible prefill."""
    paired = _decodes_with_prefill(prefills, compatible)
    return min(candidates, key=lambda d: (d.name not in paired, load_score(d), d.name))


def _decodes_with_prefill(prefills: list[InstanceView], compatible: frozenset[tuple[str, str]]) -> set[str]:
    """Decodes that a usable prefill may hand KV to."""
    usable = {p.name for p in prefills if p.is_usable}
    return {d for p, d in compatible if p in usable}


def rendezvous_score(session_id: str, instance: str) -> bytes:
    """Highest score wins; every process computes the same (no per-process hash seed)."""
    return hashlib.blake2b(f"{session_id}\0{instance}".encode(), digest_size=8).digest()


def choose_decode_by_hash(session_id: str, candidates: list[InstanceView], prefills: list[InstanceView],
                          compatible: frozenset[tuple[str, str]]) -> InstanceView:
    """The session's rendezvous-hash choice, among those with a usable compatible prefill when any has one."""
    with_prefill = _decodes_with_prefill(prefills, compatible)
    paired = [d for d in candidates if d.name in with_prefill]
    return max(paired or candidates, key=lambda d: rendezvous_score(session_id, d.name))


def should_disaggregate(prompt_tokens: int, cached_tokens: int, min_uncached_tokens: int) -> bool:
    return prompt_tokens - cached_tokens >= min_uncached_tokens


def best_holder(held: Mapping[str, int], candidates: list[InstanceView]) -> InstanceView | None:
    """The candidate holding the most of the session (None when none holds any)."""
    holding = [d for d in candidates if held.get(d.name, 0) > 0]
    return max(holding, key=lambda d: (held[d.name], -load_score(d), d.name)) if holding else None


def place(shape: RequestShape, session: SessionRecord | None, pools: list[PoolView],
          instances: list[InstanceView], compatible: frozenset[tuple[str, str]],
          warm: frozenset[tuple[str, str]], min_uncached_tokens: int, hash_sessions: bool = False,
          blocked: frozenset[str] = frozenset(), held: Mapping[str, int] | None = None,
          resumable: Mapping[str, int] | None = None,
          move_pairs: frozenset[tuple[str, str]] = frozenset()) -> Placement:
    held = held or {}
    resumable = held if resumable is None else resumable
    decodes = [v for v in instances if v.role == "decode" and v.is_healthy and not v.is_draining
               and v.name not in blocked]
    prefills = [v for v in instances if v.role == "prefill"]
    decode_pools = {d.pool for d in decodes}
    live_pools = [p for p in pools if p.name in decode_pools]
    projected = projected_context(shape, session)

    def pick(candidates: list[InstanceView]) -> InstanceView:
        if hash_sessions and shape.session_id:
            return choose_decode_by_hash(shape.session_id, candidates, prefills, compatible)
        return choose_decode(candidates, prefills, compatible)

    holder = best_holder(held, decodes)
    previous_pool = session.pool if session else (holder.pool if holder else None)
    current_pool = next((p for p in live_pools if p.name == previous_pool), None)
    is_migration = False
    if current_pool is not None and _fits(current_pool, projected):
        pool = current_pool
        holder = best_holder(held, [d for d in decodes if d.pool == pool.name])
        if holder is not None:
            decode, reason = holder, f"holds {held[holder.name]} tokens of the session"
        elif session and (sticky := next((d for d in decodes if d.name == session.decode), None)) is not None \
                and sticky.pool == pool.name:
            decode, reason = sticky, "sticky"
        else:
            decode = pick([d for d in decodes if d.pool == pool.name])
            reason = f"session's instance unusable or unknown; least-loaded in pool {pool.name}"
    else:
        pool = choose_pool(live_pools, projected)
        decode = pick([d for d in decodes if d.pool == pool.name])
        if previous_pool is not None and previous_pool != pool.name:
            is_migration = True
            reason = f"session moved from pool {previous_pool} to {pool.name} (projected {projected} tokens)"
        else:
            reason = f"least-loaded in pool {pool.name} (projected {projected} tokens)"
    cached = min(resumable.get(decode.name, 0), shape.prompt_tokens)
    ranked = rank_prefills(prefills, decode.name, compatible, warm, held)
    disaggregate = bool(ranked) and should_disaggregate(shape.prompt_tokens, cached, min_uncached_tokens)
    source = move_source(held, decodes, previous_pool, decode.name, move_pairs) if is_migration else None
    if source is not None:
        ranked, disaggregate = (source.name, *ranked), True
        reason = f"{reason}; its KV moves from {source.name} ({held[source.name]} tokens held)"
    return Placement(pool=pool.name, decode=decode.name, prefills=ranked, disaggregate=disaggregate,
                     is_migration=is_migration, reason=reason, projected_tokens=projected,
                     cached_tokens_estimate=cached, move_source=source.name if source is not None else None)


def move_source(held: Mapping[str, int], decodes: list[InstanceView], previous_pool: str | None, decode: str,
                move_pairs: frozenset[tuple[str, str]]) -> InstanceView | None:
    """The usable decode instance of the session's old pool holding the most of it whose rows may move to
    `decode` (None: the session's KV cannot move; the new instance gets it from a P leg)."""
    sources = [d for d in decodes if d.pool == previous_pool and d.name != decode and (d.name, decode) in move_pairs]
    return best_holder(held, sources)
