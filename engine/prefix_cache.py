"""The prefix cache: full blocks of finished (or in-progress) requests' KV, shared read-only by later requests.

A cache block is one attention row of the pool holding the KV of global tokens [k*B, (k+1)*B) of some token
sequence (B = the layout's block size, a power of two; under DCP each rank's row holds its owned tokens of that
block). It is keyed by a chained hash: key_k = H(key_{k-1} || fingerprint || tokens of block k), so a key names
the whole prefix [0, (k+1)*B), and the fingerprint (model, weights seed/file, tokenizer, layout) keeps KV of
another model or layout from matching. The chain starts at a root: ROOT, or a request's salted root
(`cache_root(salt)`: the node derives the salt from the tenant the router names and the request's `cache_salt`,
node/textgen.py), so blocks are keyed by (tenant, content): a request of one tenant never matches, reuses or learns
of another tenant's prefix, and tails hang off the same root. Every rank of a node makes the same decisions (the commands and steps are
the same), so block k of a prefix has the same row id on every rank.

KDA is recurrent: attention rows alone cannot resume a prefix. A block may carry a KDA snapshot (`kda_rows`, one
row per KDA group, the state after its last token). A request computes locally from the longest cached prefix
whose last block has a snapshot (`resumable`); an import (KV read from a prefill node, which sends the KDA state
at the prompt's end) reuses the longest prefix of attention blocks (`lookup`) whatever the snapshots.

A finished turn also leaves a tail (`CachedTail`): the attention row of its last, partial block and its KDA rows,
the state after the turn's last written token (prompt + answer but the last sampled token), and a prompt tail
(copies of the prompt's last partial row and of the KDA state at the prompt's end) for a next prompt that extends
the prompt with another text of the answer. A later prompt that starts with a tail's tokens resumes at its exact
end (`find_tail`): the tail's rows are copied into the new request's own rows, so a tail is never shared and is
evicted, least recently used, before any block.

Ownership: a cached block's rows belong to the cache. `refs` counts the requests whose block table uses it;
a block with refs 0 is evictable, least recently used first, but only when the pool runs out of free rows
(`RowPool.allocate` calls `evict`). `pinned_until` keeps a block out of eviction until a time (a remote READ
of an export that was given up may still target it; math.inf when the READ could not be cancelled). Cached rows
are never written: a request writes only positions past its reused prefix, into its own rows; an import writes
only the blocks it did not reuse.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = b"pdcluster-prefix-v1"


def cache_root(salt: str = "") -> bytes:
    """The key chain's root for a cache salt ("": the shared ROOT). Different salts never share a block."""
    if not salt:
        return ROOT
    return hashlib.blake2b(ROOT + b"\0" + salt.encode("utf-8"), digest_size=16).digest()


@dataclass
class CachedBlock:
    key: bytes
    index: int
    """Block index k: the block holds tokens [k*B, (k+1)*B) of its prefix."""
    attn_row: int
    kda_rows: tuple[int, ...] | None = None
    """KDA state after token (k+1)*B - 1, one row per KDA group (None: this block cannot be resumed from)."""
    refs: int = 0
    pinned_until: float = 0.0

    @property
    def rows(self) -> list[int]:
        return [self.attn_row, *(self.kda_rows or ())]


@dataclass
class CachedTail:
    parent: bytes
    """Key of block index-1 (the root of its requests' chain for index 0): the full blocks the tail extends."""
    index: int
    """The partial block k: the tail holds tokens [k*B, end) of its sequence."""
    tokens: Sequence[int]
    """Token ids [k*B, end) (`frozen_tokens`: a tuple, or an immutable sequence that compares by content)."""
    end: int
    attn_row: int
    kda_rows: tuple[int, ...]

    @property
    def rows(self) -> list[int]:
        return [self.attn_row, *self.kda_rows]


@dataclass
class CacheCounters:
    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0
    blocks_read: int = 0
    """Import blocks read from a prefill node."""
    blocks_reused: int = 0
    """Import blocks this node already held."""


def block_bytes(tokens: Sequence[int]) -> bytes:
    """The bytes a block's key hashes: 4 little-endian bytes per token id. A token sequence that encodes itself
    (a `key_bytes()` method, injective on the token sequences it represents: the simulator's run-length prompts,
    sim/tokens.py) supplies its own, so a key costs what its encoding costs rather than a loop over tokens."""
    encode = getattr(tokens, "key_bytes", None)
    if encode is not None:
        return encode()
    return b"".join(int(t).to_bytes(4, "little") for t in tokens)


def frozen_tokens(tokens: Sequence[int]) -> Sequence[int]:
    """An immutable copy of `tokens` that compares equal to another exactly when the tokens are equal (a tail's
    `tokens`): a tuple, or the sequence itself when it encodes itself (`key_bytes()`, as in `block_bytes`: the
    simulator's run-length sequences are immutable and compare by their canonical runs, so copying their
    thousands of tokens into a tuple would only cost time)."""
    if hasattr(tokens, "key_bytes"):
        return tokens
    return tuple(tokens)


def chain_keys(tokens: Sequence[int], block_tokens: int, num_blocks: int, fingerprint: bytes,
               parent: bytes = ROOT, first: int = 0) -> list[bytes]:
    """Keys of blocks first..num_blocks-1 of `tokens`, chained from `parent` (the key of block first-1)."""
    encode_blocks = getattr(tokens, "block_key_bytes", None)
    if encode_blocks is not None:  # a sequence that encodes its blocks in one pass (sim/tokens.py)
        encoded = encode_blocks(block_tokens, first, num_blocks)
    else:
        encoded = (block_bytes(tokens[k * block_tokens:(k + 1) * block_tokens]) for k in range(first, num_blocks))
    keys = []
    for data in encoded:
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(fingerprint)
        h.update(data)
        parent = h.digest()
        keys.append(parent)
    return keys


def resumable_of(held: list[CachedBlock]) -> list[CachedBlock]:
    """The longest prefix of `held` (a `lookup`) whose last block has a KDA snapshot (a local prefill resumes
    there); a new list."""
    n = len(held)
    while n and held[n - 1].kda_rows is None:
        n -= 1
    return held[:n]


class PrefixCache:
    def __init__(self, pool, block_tokens: int, fingerprint: bytes, enabled: bool = True) -> None:  # noqa: ANN001
        self.pool = pool
        self.block_tokens = block_tokens
        self.fingerprint = fingerprint
        self.enabled = enabled
        self.blocks: dict[bytes, CachedBlock] = {}
        self._lru: OrderedDict[bytes, CachedBlock] = OrderedDict()
        """Blocks with refs 0, least recently used first."""
        self.tails: OrderedDict[int, CachedTail] = OrderedDict()
        """Finished turns' tails, least recently used first (all evictable: a use copies them)."""
        self._tail_groups: dict[tuple[bytes, int], dict[int, None]] = {}
        """(parent, index) -> ids of the tails in `tails` that start there, in their `tails` order (the ones a new
        tail of that start may extend: `add_tail` looks at those only)."""
        self.counters = CacheCounters()
        self.now = 0.0
        """The engine's clock at the last `tick` (pins are compared with it)."""
        self._lru_rows = 0
        """Rows of the blocks in `_lru` (kept as they change, so `evictable_rows` costs no walk)."""
        self._tail_rows = 0
        """Rows of the tails in `tails`."""
        self._pinned: set[bytes] = set()
        """Keys of blocks given a pin (`pinned_until` > 0) and not yet seen expired by `evictable_rows`."""

    def _lru_put(self, block: CachedBlock) -> None:
        if block.key not in self._lru:
            self._lru_rows += len(block.rows)
        self._lru[block.key] = block
        self._lru.move_to_end(block.key)

    def _lru_drop(self, key: bytes) -> CachedBlock | None:
        block = self._lru.pop(key, None)
        if block is not None:
            self._lru_rows -= len(block.rows)
        return block

    def _tail_put(self, tail: CachedTail) -> None:
        if id(tail) not in self.tails:
            self._tail_rows += len(tail.rows)
            self._tail_groups.setdefault((tail.parent, tail.index), {})[id(tail)] = None
        self.tails[id(tail)] = tail

    def _tail_drop(self, key: int) -> CachedTail | None:
        tail = self.tails.pop(key, None)
        if tail is not None:
            self._tail_rows -= len(tail.rows)
            group = self._tail_groups[(tail.parent, tail.index)]
            del group[key]
            if not group:
                del self._tail_groups[(tail.parent, tail.index)]
        return tail

    def keys(self, tokens: Sequence[int], num_blocks: int, root: bytes = ROOT) -> list[bytes]:
        """Keys of the first num_blocks blocks of `tokens`, chained from `root` (`cache_root` of the salt)."""
        return chain_keys(tokens, self.block_tokens, num_blocks, self.fingerprint, root)

    # ---- lookup ----
    def lookup(self, keys: Sequence[bytes]) -> list[CachedBlock]:
        """The cached blocks of the longest prefix of `keys` held (attention only)."""
        out: list[CachedBlock] = []
        if not self.enabled:
            return out
        for key in keys:
            block = self.blocks.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def resumable(self, keys: Sequence[bytes]) -> list[CachedBlock]:
        """The longest held prefix of `keys` whose last block has a KDA snapshot (a local prefill resumes there)."""
        return resumable_of(self.lookup(keys))

    def find_tail(self, tokens: Sequence[int], held: Sequence[CachedBlock], root: bytes = ROOT) -> CachedTail | None:
        """The tail ending furthest into `tokens` (and before its last token) whose blocks are the first ones of
        `held` (the held prefix of `tokens`' block keys, chained from `root`) and whose tokens continue `tokens`
        there."""
        if not self.enabled:
            return None
        best = None
        for tail in self.tails.values():
            k = tail.index
            if k > len(held) or (held[k - 1].key if k else root) != tail.parent or tail.end >= len(tokens):
                continue
            if (best is None or tail.end > best.end) and frozen_tokens(tokens[k * self.block_tokens:tail.end]) == tail.tokens:
                best = tail
        return best

    def add_tail(self, tail: CachedTail) -> None:
        """Keep a finished turn's tail (its rows now belong to the cache). Tails it extends are dropped."""
        starts = getattr(tail.tokens, "startswith", None)  # a sequence that checks a prefix without slicing
        for key in list(self._tail_groups.get((tail.parent, tail.index), ())):
            old = self.tails[key]
            if starts(old.tokens) if starts is not None else tail.tokens[:len(old.tokens)] == old.tokens:
                self._tail_drop(key)
                self.pool.free(old.rows)
        self._tail_put(tail)

    def take_tail(self, tail: CachedTail) -> None:
        """Keep `tail` out of eviction while a request copies it (`put_back_tail` ends that)."""
        self._tail_drop(id(tail))

    def put_back_tail(self, tail: CachedTail) -> None:
        self._tail_put(tail)
        self.tails.move_to_end(id(tail))
        group = self._tail_groups[(tail.parent, tail.index)]
        group[id(tail)] = group.pop(id(tail))

    # ---- references ----
    def acquire(self, blocks: Sequence[CachedBlock]) -> None:
        for block in blocks:
            block.refs += 1
            self._lru_drop(block.key)

    def release(self, blocks: Sequence[CachedBlock], pin_until: float | None = None) -> None:
        """A request is done with `blocks` (its table order); the last blocks become the first to evict."""
        for block in reversed(blocks):
            block.refs -= 1
            assert block.refs >= 0, "cache block released more often than acquired"
            if pin_until is not None:
                block.pinned_until = max(block.pinned_until, pin_until)
                if block.pinned_until > 0:
                    self._pinned.add(block.key)
            if block.refs == 0 and block.key in self.blocks:
                self._lru_put(block)

    def insert(self, key: bytes, index: int, attn_row: int, kda_rows: tuple[int, ...] | None) -> CachedBlock | None:
        """Publish a finished block (refs 1: the caller's request uses it). None when the key is already cached
        (the caller keeps its attention row). The caller gives up `kda_rows` either way: they become the block's
        snapshot, or the held block's when it had none, or they are freed."""
        block = self.blocks.get(key)
        if block is not None:
            if block.kda_rows is None and kda_rows is not None:
                block.kda_rows = kda_rows
                if key in self._lru:
                    self._lru_rows += len(kda_rows)
            elif kda_rows is not None:
                self.pool.free(list(kda_rows))
            return None
        block = CachedBlock(key, index, attn_row, kda_rows, refs=1)
        self.blocks[key] = block
        return block

    def drop_snapshot(self, block: CachedBlock) -> None:
        """Free a block's KDA snapshot (a later snapshot of the same request supersedes it)."""
        if block.kda_rows is not None and block.key in self.blocks:
            rows, block.kda_rows = block.kda_rows, None
            if block.key in self._lru:
                self._lru_rows -= len(rows)
            self.pool.free(list(rows))

    # ---- eviction ----
    def evictable_rows(self) -> int:
        """Rows `evict` could free now: unreferenced blocks not pinned past `now`, and every tail. Kept as counts;
        only blocks with a pin are looked at (`naive_evictable_rows` walks everything)."""
        pinned = 0
        for key in list(self._pinned):
            block = self._lru.get(key)
            if block is not None and block.pinned_until > self.now:
                pinned += len(block.rows)
            elif key not in self.blocks or block is not None:
                self._pinned.discard(key)  # evicted, or its pin is over (a later pin adds it again)
        return self._lru_rows - pinned + self._tail_rows

    def naive_evictable_rows(self) -> int:
        return sum(len(b.rows) for b in self._lru.values() if b.pinned_until <= self.now) + \
            sum(len(t.rows) for t in self.tails.values())

    def evict(self, num_rows: int) -> int:
        """Evict tails, then unreferenced blocks, least recently used first, until num_rows rows were freed (or
        none is left)."""
        freed = 0
        tails = []  # victims are chosen first, then removed: no copy of the whole table per call
        for key, tail in self.tails.items():
            if freed >= num_rows:
                break
            tails.append(key)
            freed += len(tail.rows)
        for key in tails:
            self.pool.free(self._tail_drop(key).rows)
        blocks = []
        for key, block in self._lru.items():
            if freed >= num_rows:
                break
            if block.pinned_until > self.now:
                continue
            blocks.append(block)
            freed += len(block.rows)
        for block in blocks:
            self._lru_drop(block.key)
            del self.blocks[block.key]
            self.pool.free(block.rows)
            self.counters.evicted_blocks += 1
        return freed

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def held_tokens(self, keys: Sequence[bytes], snapshot: bool = False, tails: Sequence[CachedTail] = ()) -> int:
        """Leading tokens of the prefix `keys` names that are held (with `snapshot`: resumable, at the end of the
        furthest of `tails` still held that extends the held blocks; `tails` belong to the same requests as `keys`,
        so a tail of block 0 hangs off their root)."""
        if not snapshot:
            return len(self.lookup(keys)) * self.block_tokens
        best = len(self.resumable(keys)) * self.block_tokens
        for tail in tails:
            if id(tail) in self.tails and tail.end > best:
                held = self.lookup(keys[:tail.index])
                if len(held) == tail.index and (held[-1].key == tail.parent if held else tail.index == 0):
                    best = tail.end
        return best

    def held_figures(self, keys: Sequence[bytes], tails: Sequence[CachedTail] = ()) -> tuple[int, int]:
        """(`held_tokens(keys)`, `held_tokens(keys, snapshot=True, tails=tails)`) from one walk of the blocks: the
        held prefix of `keys[:k]` is the first k blocks of the held prefix of `keys`, so each tail is checked
        against that one walk (a cache report asks both figures of every session)."""
        held = self.lookup(keys)
        best = len(resumable_of(held)) * self.block_tokens
        for tail in tails:
            k = tail.index
            if id(tail) in self.tails and tail.end > best and len(held) >= k \
                    and (held[k - 1].key == tail.parent if k else True):
                best = tail.end
        return len(held) * self.block_tokens, best
