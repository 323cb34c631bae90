"""Continuous batching: request states, the prefill queue, chunked prefill and the decode batch. No torch, no model.

States: WAITING (prefill queue) -> PREFILLING (rows allocated, prompt computed chunk by chunk) -> RUNNING (decode
batch) -> FINISHED; with export: ... -> EXPORTED (prefill done, rows kept for a remote reader until released); with
import: IMPORTING (rows allocated, an external writer fills them) -> RUNNING once `start_decode` gives the first
token.
An export is named by its request id AND its `generation` (a per-scheduler counter stamped when the prefill is
done): `release(request_id, generation)` ends only that export, so a stale release of an earlier request with the
same id, or of rows that have since been reused, frees nothing. Ending a request whose rows a remote READ may
still target (EXPORTED or IMPORTING; `finish(..., quarantine_until=t)`) quarantines its own rows instead of
freeing them (engine/rows.py `RowBook.quarantine`) and pins the shared cache blocks it used until t; a `held`
request's rows stay quarantined for good.
`Scheduler.schedule()` picks, per engine step, every running request (up to max_batch) to decode and one prefill
chunk: the request being prefilled (first in, first out; the head of the queue is admitted when the pool, counting
evictable cache blocks, has rows for its prompt + `reserve_ahead_tokens` of its answer; a head that does not fit
lets at most MAX_HEAD_BYPASS later requests that do go first, nor is it starved) computes its next
`max_step_tokens - decodes`
tokens (at least MIN_CHUNK; all of them when the budget is None). A chunk also ends at the prompt's last block
boundary, where the KDA state is snapshotted for the prefix cache. Decode priority (`decode_first_tokens`): while
every running request is that close to its max_tokens, the prompt next in line lets them decode alone, for at most
that many steps in all (`Request.num_deferred`).
Prefix cache (engine/prefix_cache.py): admission reuses the longest resumable cached prefix (its attention rows
shared, its KDA snapshot copied into the request's own KDA rows) and computes only the rest; an import reuses
the longest held prefix of attention blocks and reads only the others. Finished blocks are published as they
complete (prefill chunks, decode steps crossing a block boundary, an import's blocks at start_decode).
Rows, reserve as you go (docs/ARCHITECTURE.md "Admission"): a request is admitted with rows for its prompt plus
at most RESERVE_AHEAD_TOKENS of its answer, and takes one more attention row each time its answer crosses into
a new block, so a huge max_tokens holds only the rows its answer really fills. When a running request needs a
row and the pool (cache blocks evicted, prompt-state copies dropped) has none, the request that started running
last is preempted by recompute: its rows go back, its outputs so far join its prompt (`SamplingParams.num_resumed`,
the path a resumed stream takes) and it goes back to the head of the queue; once re-admitted it prefills prompt +
outputs and continues with the next token, bit for bit. The request ahead of all others never is, so the queue
always moves; `add` refuses a request whose prompt + max_tokens the whole pool could not hold.
`reserve_ahead_tokens=None` (the simulator, which advances many tokens per event) reserves prompt + max_tokens at
admission instead, and nothing is ever preempted. A request's own rows return to the pool when it finishes, is
aborted, or its export is released, and its references to cache blocks are dropped.
The scheduler is deterministic: the same commands in the same order give the same batches and row ids.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field, replace

from engine.api import SamplingParams
from engine.rows import BlockTable, OutOfRows, RowBook
from engine.prefix_cache import (CachedBlock, CachedTail, PrefixCache, cache_root, chain_keys, frozen_tokens,
                                 resumable_of)

MIN_CHUNK = 16
"""Fewest prompt tokens a step prefills while a prompt waits (so a full decode batch cannot starve it)."""
MAX_HEAD_BYPASS = 16
"""Later requests a waiting head that does not fit may let go ahead of it before the queue waits for it again."""
BYPASS_SCAN = 4
"""Waiting requests behind the head a step tries when the head does not fit."""
RESERVE_AHEAD_TOKENS = 16
"""Answer tokens a request's rows hold at admission beyond its prompt (it takes more rows as its answer grows)."""


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    EXPORTED = "exported"
    IMPORTING = "importing"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int
    export: bool = False
    session: str = ""
    """Opaque session key (the router's); the node reports what it holds per session."""
    cache_salt: str = ""
    """The prefix cache's salt (the node's digest of tenant and `cache_salt`; "" shares the unsalted chain): only
    requests with the same salt share cached blocks and tails."""
    state: RequestState = RequestState.WAITING
    generation: int = 0
    """Set when the request is exported (unique within the scheduler); releases must name it."""
    held: bool = False
    """A READ into its rows could not be cancelled: when it ends, its rows stay quarantined for good."""
    table: BlockTable | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_computed: int = 0
    """Prompt tokens whose KV is in the rows (reused or prefilled)."""
    num_cached_tokens: int = 0
    """Prompt tokens reused from the prefix cache (not computed, not read)."""
    cached_blocks: list[CachedBlock] = field(default_factory=list)
    """Cache blocks this request's table uses (reused or published by it); their rows belong to the cache."""
    block_keys: list[bytes] = field(default_factory=list)
    """Chained keys of this request's full blocks so far."""
    prompt_keys: list[bytes] = field(default_factory=list)
    """Chained keys of the prompt's first blocks, as admission looked them up (`publish` takes them over)."""
    decode_snapshot: CachedBlock | None = None
    given_rows: set[int] = field(default_factory=set)
    """Rows handed to the prefix cache as this request's tail (not freed with the request)."""
    prompt_state: tuple[int, ...] | None = None
    """A copy of the KDA state at the prompt's exact end (rows outside the table), kept until the request ends:
    it becomes the prompt tail, from which a later prompt that extends this prompt but not this answer resumes."""
    prompt_logits: list = field(default_factory=list)
    """Chunk logits of a request that asked for prompt log-probs."""
    num_bypassed: int = 0
    """Later requests admitted ahead of this one while it headed the queue and did not fit."""
    num_deferred: int = 0
    """Steps this request, ready to prefill, let the running requests decode alone (`decode_first_tokens`)."""
    num_folded: int = 0
    """Outputs that preemptions moved into the prompt (already emitted; recomputed as prompt on re-admission)."""
    first_cached_tokens: int | None = None
    """num_cached_tokens of its first admission, kept through preemptions (what usage reports)."""

    @property
    def cache_root(self) -> bytes:
        """The root its block keys chain from (engine/prefix_cache.py `cache_root`)."""
        return cache_root(self.cache_salt)

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV is (or is about to be) in the cache: prompt + outputs so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def capacity(self) -> int:
        """Tokens the rows may come to hold: the prompt, plus max_tokens unless the rows go to a remote decoder."""
        return len(self.prompt_token_ids) + (0 if self.export else self.sampling.max_tokens)

    def reserve_tokens(self, ahead: int | None) -> int:
        """Tokens its rows hold at admission: the prompt plus `ahead` answer tokens (None: all of max_tokens)."""
        if ahead is None:
            return self.capacity
        return len(self.prompt_token_ids) + (0 if self.export else min(self.sampling.max_tokens, ahead))

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt the client sent (without outputs folded in by preemptions)."""
        return len(self.prompt_token_ids) - self.num_folded

    @property
    def num_emitted(self) -> int:
        """Outputs emitted so far, those folded into the prompt included."""
        return self.num_folded + len(self.output_token_ids)

    @property
    def reported_cached_tokens(self) -> int:
        return self.num_cached_tokens if self.first_cached_tokens is None else self.first_cached_tokens

    def token_at(self, lo: int, hi: int) -> list[int]:
        """Token ids of positions [lo, hi) (prompt, then outputs)."""
        n = len(self.prompt_token_ids)
        return (self.prompt_token_ids[lo:min(hi, n)] + self.output_token_ids[max(lo - n, 0):max(hi - n, 0)])


@dataclass(frozen=True)
class SchedulerOutput:
    prefill: Request | None
    decode: tuple[Request, ...]
    prefill_end: int = 0
    """The chunk prefills prompt positions [prefill.num_computed, prefill_end)."""


class Scheduler:
    def __init__(self, pool: RowBook, max_batch: int = 64, cache: PrefixCache | None = None,
                 max_step_tokens: int | None = None, resume: bool = True,
                 reserve_ahead_tokens: int | None = RESERVE_AHEAD_TOKENS,
                 decode_first_tokens: int | None = None) -> None:
        """`cache`: the prefix cache (None: none); `max_step_tokens`: tokens per step shared by decodes and a
        prefill chunk (None: a prompt prefills in one step); `resume`: the model can prefill from a position
        past 0 (chunks and cache hits of local prefills need it); `reserve_ahead_tokens`: answer tokens reserved
        at admission, rows growing as the answer does (None: all of max_tokens at admission, no preemption);
        `decode_first_tokens`: decode priority (engine/api.py `EngineConfig.decode_first_tokens`; None: off)."""
        self.pool = pool
        self.decode_first_tokens = decode_first_tokens
        self.reserve_ahead_tokens = reserve_ahead_tokens
        self.num_preemptions = 0
        """Running requests preempted by recompute (their rows given back, their outputs recomputed as prompt)."""
        self.max_batch = max_batch
        self.cache = cache
        self.max_step_tokens = max_step_tokens if resume else None
        self.resume = resume
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefilling: Request | None = None
        self._generations = 0

    @property
    def block_tokens(self) -> int:
        return self.pool.layout.block_size

    def _caching(self) -> bool:
        return self.cache is not None and self.cache.enabled

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        num_attn, num_kda = self.pool.rows_for(req.capacity)
        if num_attn + num_kda > self.pool.num_usable:
            raise ValueError(f"request {req.request_id!r} needs {num_attn + num_kda} rows for {req.capacity} tokens;"
                             f" the pool has {self.pool.num_usable}")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    # ---- admission ----
    def _admit(self, req: Request, reuse: list[CachedBlock], keys: list[bytes], num_tokens: int) -> bool:
        """Give `req` rows for num_tokens tokens, the first len(reuse) blocks shared from the cache; False (nothing
        changed) when the pool lacks rows even after eviction."""
        num_attn, num_kda = self.pool.rows_for(num_tokens)
        if self.cache is not None:
            self.cache.acquire(reuse)
        need = num_attn - len(reuse) + num_kda
        if need > self.pool.num_available:
            self._drop_prompt_states(need - self.pool.num_available)
        if need > self.pool.num_available:
            if self.cache is not None:
                self.cache.release(reuse)
            return False
        attn = [b.attn_row for b in reuse] + self.pool.allocate(num_attn - len(reuse))
        kda = self.pool.allocate(num_kda)
        req.table = BlockTable(attn, kda)
        req.cached_blocks = list(reuse)
        req.block_keys = list(keys[:len(reuse)])
        req.prompt_keys = keys
        req.num_cached_tokens = req.num_computed = len(reuse) * self.block_tokens
        if self.cache is not None:
            self.cache.counters.queried_tokens += len(req.prompt_token_ids)
            self.cache.counters.hit_tokens += req.num_cached_tokens
        return True

    def _admit_local(self, req: Request) -> bool:
        """Rows for a request this node prefills, resuming from the longest resumable cached prefix."""
        reuse: list[CachedBlock] = []
        keys: list[bytes] = []
        tail: CachedTail | None = None
        if self._caching() and self.resume and req.sampling.prompt_logprobs is None:
            root = req.cache_root
            keys = self.cache.keys(req.prompt_token_ids, (len(req.prompt_token_ids) - 1) // self.block_tokens, root)
            held = self.cache.lookup(keys)
            reuse = resumable_of(held)
            tail = self.cache.find_tail(req.prompt_token_ids, held, root)
            if tail is not None and tail.end > len(reuse) * self.block_tokens:
                reuse = held[:tail.index]
                self.cache.take_tail(tail)  # not evicted by this very admission
            else:
                tail = None
        admitted = self._admit(req, reuse, keys, req.reserve_tokens(self.reserve_ahead_tokens))
        if tail is not None:
            if admitted:
                assert req.table is not None
                self.pool.copy_rows([req.table.attn_row_ids[tail.index], *req.table.kda_row_ids],
                                    tail.rows)
                extra = tail.end - len(reuse) * self.block_tokens
                req.num_cached_tokens = req.num_computed = tail.end
                self.cache.counters.hit_tokens += extra
            self.cache.put_back_tail(tail)
        if not admitted:
            return False
        assert req.table is not None
        if tail is not None:
            return True
        if reuse:
            self.pool.copy_rows(req.table.kda_row_ids, reuse[-1].kda_rows or ())
        else:
            self.pool.buffer[req.table.kda_row_ids] = 0
        return True

    def admit_now(self, req: Request) -> BlockTable:
        """Admit a local prefill outside the queue (prefill_and_keep); raises OutOfRows when the pool is short."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if not self._admit_local(req):
            raise OutOfRows(f"a request of {req.capacity} tokens needs more rows than the pool has free")
        req.state = RequestState.PREFILLING
        self.requests[req.request_id] = req
        assert req.table is not None
        return req.table

    def add_imported(self, req: Request, num_tokens: int, zero_kda: bool = False) -> BlockTable:
        """Admit a request whose prompt KV arrives from elsewhere; rows are allocated at once, the longest held
        prefix of whole prompt blocks shared from the cache (`req.num_cached_tokens`: the tokens not to read).
        Raises engine.rows.OutOfRows when the pool is short."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        keys: list[bytes] = []
        reuse: list[CachedBlock] = []
        if self._caching():
            keys = self.cache.keys(req.prompt_token_ids, len(req.prompt_token_ids) // self.block_tokens,
                                   req.cache_root)
            reuse = self.cache.lookup(keys)
        total = max(req.reserve_tokens(self.reserve_ahead_tokens), num_tokens)
        if not self._admit(req, reuse, keys, total):
            num_attn, num_kda = self.pool.rows_for(total)
            raise OutOfRows(f"a request of {total} tokens needs {num_attn - len(reuse) + num_kda} rows, "
                            f"{self.pool.num_available} available")
        assert req.table is not None
        if zero_kda:
            self.pool.buffer[req.table.kda_row_ids] = 0
        if self.cache is not None:
            num_blocks = -(-len(req.prompt_token_ids) // self.block_tokens)
            self.cache.counters.blocks_reused += len(reuse)
            self.cache.counters.blocks_read += num_blocks - len(reuse)
        req.state = RequestState.IMPORTING
        self.requests[req.request_id] = req
        return req.table

    def start_running(self, req: Request) -> None:
        req.state = RequestState.RUNNING
        if self.prefilling is req:
            self.prefilling = None
        self.running.append(req)

    # ---- stepping ----
    def snapshot_boundary(self, req: Request) -> int:
        """The prompt's last block boundary before its last token: where a later request can resume."""
        if not (self._caching() and self.resume):
            return 0
        return (len(req.prompt_token_ids) - 1) // self.block_tokens * self.block_tokens

    def _admit_next(self) -> Request | None:
        """The waiting request admitted now, if any: the head when it fits; else, while the head has let fewer
        than MAX_HEAD_BYPASS requests go ahead, the first of the next BYPASS_SCAN that fits. So a request whose
        prompt + max_tokens the pool cannot hold yet does not stop smaller ones behind it, and cannot itself be
        starved: past the bound the queue waits for it (running requests end and free their rows)."""
        head = self.waiting[0]
        if self._admit_local(head):
            return self.waiting.popleft()
        if head.num_bypassed >= MAX_HEAD_BYPASS:
            return None
        for i in range(1, min(len(self.waiting), 1 + BYPASS_SCAN)):
            req = self.waiting[i]
            if self._admit_local(req):
                del self.waiting[i]
                head.num_bypassed += 1
                return req
        return None

    def _decode_first(self, decode: tuple[Request, ...]) -> bool:
        """Whether this step decodes alone while a prompt waits to prefill (decode priority): every running
        request is within `decode_first_tokens` of its max_tokens, and the prompt next in line has not yet let
        them go first that many steps."""
        limit = self.decode_first_tokens
        nxt = self.prefilling or (self.waiting[0] if self.waiting else None)
        if limit is None or not decode or nxt is None or nxt.num_deferred >= limit:
            return False
        if any(req.sampling.max_tokens - len(req.output_token_ids) > limit for req in self.running):
            return False
        nxt.num_deferred += 1
        return True

    def schedule(self) -> SchedulerOutput:
        decode = self._grow()
        if self._decode_first(decode):
            return SchedulerOutput(None, decode)
        if self.prefilling is None and self.waiting:
            self.prefilling = self._admit_next()
            if self.prefilling is not None:
                self.prefilling.state = RequestState.PREFILLING
        req = self.prefilling
        if req is None:
            return SchedulerOutput(None, decode)
        n = len(req.prompt_token_ids)
        end = n
        if self.max_step_tokens is not None:
            end = min(n, req.num_computed + max(self.max_step_tokens - len(decode), MIN_CHUNK))
        boundary = self.snapshot_boundary(req)
        if req.num_computed < boundary < end:
            end = boundary
        return SchedulerOutput(req, decode, end)

    def _grow(self) -> tuple[Request, ...]:
        """This step's decode batch, each with rows for the position it writes (num_tokens - 1): a request whose
        answer crossed into a new block takes a row; when the pool has none, the last request to start running
        is preempted (it may be the one growing) until the row is found."""
        while True:
            batch = self.running[: self.max_batch]
            if self.reserve_ahead_tokens is None:
                return tuple(batch)
            short = next((req for req in batch if not self._extend(req)), None)
            if short is None:
                return tuple(batch)
            self.preempt(self.running[-1])

    def _extend(self, req: Request) -> bool:
        """Rows for req.num_tokens tokens; False (nothing changed) when the pool cannot give them."""
        assert req.table is not None
        need = self.pool.rows_for(req.num_tokens)[0] - len(req.table.attn_row_ids)
        if need <= 0:
            return True
        if need > self.pool.num_available:
            self._drop_prompt_states(need - self.pool.num_available)
        if need > self.pool.num_available:
            return False
        self.pool.extend(req.table, req.num_tokens)
        return True

    def preempt(self, req: Request) -> None:
        """Preempt a running request by recompute: its rows go back to the pool, its outputs join its prompt (as
        a resumed stream's do: `SamplingParams.num_resumed`, so sampling continues where it was) and it waits at
        the head of the queue; re-admitted, it prefills prompt + outputs and samples its next token from there."""
        assert req.state == RequestState.RUNNING
        self.running.remove(req)
        self._free(req)
        if req.first_cached_tokens is None:
            req.first_cached_tokens = req.num_cached_tokens
        outputs = req.output_token_ids
        req.sampling = replace(req.sampling, num_resumed=req.sampling.num_resumed + len(outputs),
                               max_tokens=req.sampling.max_tokens - len(outputs), prompt_logprobs=None)
        req.prompt_token_ids = req.prompt_token_ids + outputs
        req.num_folded += len(outputs)
        req.output_token_ids, req.output_logprobs = [], []
        req.num_computed = req.num_cached_tokens = req.num_bypassed = 0
        req.block_keys, req.prompt_keys, req.given_rows = [], [], set()
        req.state = RequestState.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def prefill_done(self, req: Request) -> None:
        if self.prefilling is req:
            self.prefilling = None

    def publish(self, req: Request, upto: int, snapshot: bool = False) -> None:
        """Put req's full blocks below token `upto` (KV written) into the prefix cache; with `snapshot`, the block
        ending at `upto` carries a copy of req's KDA state (upto must then be a block boundary)."""
        if not self._caching() or req.table is None:
            return
        bt, cache, known = self.block_tokens, self.cache, req.prompt_keys
        for k in range(len(req.block_keys), upto // bt):
            if k < len(known):  # the keys so far are known's first k: block k chains to known[k]
                key = known[k]
            else:
                parent = req.block_keys[-1] if req.block_keys else req.cache_root
                key = chain_keys(req.token_at(k * bt, (k + 1) * bt), bt, 1, cache.fingerprint, parent)[0]
            req.block_keys.append(key)
            kda = None
            if snapshot and (k + 1) * bt == upto and self.resume:
                kda = self._snapshot(req)
            row = req.table.attn_row_ids[k]
            block = cache.insert(key, k, row, kda)
            if block is not None:
                req.cached_blocks.append(block)
                if kda is not None and req.state == RequestState.RUNNING:
                    if req.decode_snapshot is not None:
                        cache.drop_snapshot(req.decode_snapshot)
                    req.decode_snapshot = block

    def _snapshot(self, req: Request) -> tuple[int, ...] | None:
        assert req.table is not None
        count = len(req.table.kda_row_ids)
        if self.pool.num_available < count:
            return None
        rows = self.pool.allocate(count)
        self.pool.copy_rows(rows, req.table.kda_row_ids)
        return tuple(rows)

    def keep_prompt_state(self, req: Request) -> None:
        """The prompt's KV and KDA state are complete (prefilled here or imported): copy the KDA state for the
        prompt tail `keep_tail` leaves. Agent clients send the next turn as this prompt + *their* text of the
        answer, which need not re-encode to the tokens this node sampled; the prompt tail lets such a turn resume
        at this prompt's end instead of at its last block boundary. A prompt ending on a block boundary needs no
        copy (that block's snapshot does it); without rows to spare there is no copy and no prompt tail."""
        if not (self._caching() and self.resume) or req.table is None or req.export \
                or len(req.prompt_token_ids) % self.block_tokens == 0 or req.prompt_state is not None:
            return
        req.prompt_state = self._snapshot(req)

    def _drop_prompt_states(self, count: int) -> None:
        """Give up prompt-state copies (opportunistic: a request is never refused rows for them), the requests
        that started last first, until `count` rows were freed or none is left."""
        for req in reversed(list(self.requests.values())):
            if count <= 0:
                break
            if req.prompt_state is not None:
                self.pool.free(list(req.prompt_state))
                count -= len(req.prompt_state)
                req.prompt_state = None

    # ---- ending ----
    def keep_tail(self, req: Request) -> list[CachedTail]:
        """A request that decoded to its end leaves tails in the prefix cache instead of freeing those rows: its
        last partial block's attention row and its KDA rows (the state after its last written token), and, when
        `keep_prompt_state` copied the state at the prompt's end, a prompt tail (a copy of the prompt's last
        partial row with that state). Returned most complete first."""
        if not (self._caching() and self.resume) or req.table is None or req.held \
                or req.state != RequestState.RUNNING:
            return []
        bt = self.block_tokens
        written = req.num_tokens - 1  # the last sampled token never went through the model
        n, state = len(req.prompt_token_ids), req.prompt_state
        prompt_tail = None
        if state is not None and written > n and len(req.block_keys) >= n // bt and self.pool.num_available >= 1:
            # its row is taken before the turn's own tail is handed over, so the allocation cannot evict that tail
            k = n // bt
            row = self.pool.allocate(1)[0]
            self.pool.copy_rows([row], [req.table.attn_row_ids[k]])  # positions < n stay as written
            prompt_tail = CachedTail(parent=req.block_keys[k - 1] if k else req.cache_root, index=k,
                                     tokens=frozen_tokens(req.prompt_token_ids[k * bt:n]), end=n, attn_row=row, kda_rows=state)
            req.prompt_state = None
        tails: list[CachedTail] = []
        k = written // bt
        if written % bt and k < len(req.table.attn_row_ids) and len(req.block_keys) == k:
            tail = CachedTail(parent=req.block_keys[-1] if k else req.cache_root, index=k,
                              tokens=frozen_tokens(req.token_at(k * bt, written)), end=written,
                              attn_row=req.table.attn_row_ids[k], kda_rows=tuple(req.table.kda_row_ids))
            req.given_rows = set(tail.rows)
            self.cache.add_tail(tail)
            tails.append(tail)
        if prompt_tail is not None:
            self.cache.add_tail(prompt_tail)
            tails.append(prompt_tail)
        return tails

    def finish(self, req: Request, reason: str, quarantine_until: float | None = None) -> None:
        """End a request in any state; its rows are freed, or quarantined until `quarantine_until`."""
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        if req.state == RequestState.WAITING and req in self.waiting:
            self.waiting.remove(req)
        if self.prefilling is req:
            self.prefilling = None
        req.state = RequestState.FINISHED
        self._free(req, quarantine_until)
        self.requests.pop(req.request_id, None)

    def export(self, req: Request) -> None:
        """The prefill of an export request is done: keep its rows, stop scheduling it, stamp its generation."""
        req.state = RequestState.EXPORTED
        self._generations += 1
        req.generation = self._generations
        self.prefill_done(req)
        if req in self.running:
            self.running.remove(req)

    def release(self, request_id: str, generation: int, quarantine_until: float | None = None) -> bool:
        """End export `generation` of `request_id`; False (nothing freed) if that export is not live."""
        req = self.requests.get(request_id)
        if req is None or req.state != RequestState.EXPORTED or req.generation != generation:
            return False
        self.finish(req, "released", quarantine_until)
        return True

    def _free(self, req: Request, quarantine_until: float | None = None) -> None:
        if req.table is None:
            return
        if req.held:
            quarantine_until = math.inf
        shared = {b.attn_row for b in req.cached_blocks} | req.given_rows
        own = [row for row in req.table.row_ids if row not in shared]
        if quarantine_until is None:
            self.pool.free(own)
        else:
            self.pool.quarantine(own, quarantine_until, req.request_id)
        if self.cache is not None:
            self.cache.release(req.cached_blocks, pin_until=quarantine_until)
        req.cached_blocks = []
        req.decode_snapshot = None
        if req.prompt_state is not None:  # a private copy no remote READ ever targets
            self.pool.free(list(req.prompt_state))
            req.prompt_state = None
        req.table = None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + (self.prefilling is not None)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling is not None)
