"""Run-length token sequences: what the simulator hands the real scheduler and prefix cache as prompts.

A simulated prompt is the chat template of its messages (loadgen's `RequestSpec.messages`), but never as one
int per token: an hour of agent traffic re-sends billions of prompt tokens. `TokenRuns` keeps a sequence as runs
`(uid, offset, length)`: tokens `offset .. offset+length-1` of the text interned as `uid`. Its tokens are the
ints `uid << 32 | position` (iteration, `tuple()`: exact, used by the cache's tail comparisons), and
`key_bytes()` encodes the runs (engine/prefix_cache.py `block_bytes` hashes that), so the real `PrefixCache`
keys blocks at the cost of their run count. Runs are canonical (adjacent pieces of one text merge), so two
sequences have equal `key_bytes` exactly when their tokens are equal.

`Template` turns messages into runs: `bytes` is the reference engine's byte-level chat template (exact:
BOS, per message ROLE id + UTF-8 of "role\\ncontent" + END id, then ROLE id + "assistant\\n"; see
router/placement.py `estimate_prompt_tokens_bytes`); `words` is a BPE model's, one token per word plus a fixed
number of framing tokens per message (profile field `template.tokens_per_message`).
"""

from __future__ import annotations

import bisect
import itertools
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter

from engine.prefix_cache import chain_keys
from loadgen.schedule import Message

_RUN = struct.Struct("<QII")
_LENGTH = itemgetter(2)


class TokenRuns(Sequence[int]):
    """An immutable token sequence stored as canonical runs (see the module docstring). Slices and `key_bytes`
    are remembered per sequence: the prefill and the decode instance key the same prompt's blocks, and a block
    published later is sliced again (a sequence is immutable, so a remembered slice stays right)."""

    __slots__ = ("_blocks", "_chains", "_ends_list", "_key", "_length", "_prefix", "_slices", "runs")

    def __init__(self, runs: Sequence[tuple[int, int, int]] = ()) -> None:
        merged: list[tuple[int, int, int]] = []
        for uid, offset, length in runs:
            if length <= 0:
                continue
            if merged and merged[-1][0] == uid and merged[-1][1] + merged[-1][2] == offset:
                prev = merged.pop()
                merged.append((uid, prev[1], prev[2] + length))
            else:
                merged.append((uid, offset, length))
        self._init(tuple(merged))

    def _init(self, runs: tuple[tuple[int, int, int], ...], length: int | None = None) -> None:
        self.runs = runs
        if length is None:
            length = sum(map(_LENGTH, runs)) if len(runs) > 1 else (runs[0][2] if runs else 0)
        self._length = length
        self._ends_list: list[int] | None = None
        self._slices: dict[tuple[int, int], TokenRuns] | None = None
        self._key: bytes | None = None
        self._blocks: dict[int, list[bytes]] | None = None
        """Per block size: the encodings of the first full blocks, as `block_key_bytes` computed them."""
        self._chains: dict[tuple[int, bytes, bytes], list[bytes]] | None = None
        """Per (block size, fingerprint, root): the chained keys of the first full blocks (`chained_keys`)."""
        self._prefix: TokenRuns | None = None
        """An earlier sequence this one extends (`continues`), until its block encodings are taken over."""

    @classmethod
    def _canonical(cls, runs: tuple[tuple[int, int, int], ...], length: int | None = None) -> TokenRuns:
        """From runs already canonical (a slice or a join of canonical sequences): no merging pass. `length`:
        their token count, when the caller knows it."""
        obj = cls.__new__(cls)
        obj._init(runs, length)
        return obj

    @property
    def _ends(self) -> list[int]:
        """End position of every run (computed when first indexed or sliced)."""
        if self._ends_list is None:
            self._ends_list = list(itertools.accumulate(map(_LENGTH, self.runs)))
        return self._ends_list

    def __len__(self) -> int:
        return self._length

    def _slice(self, lo: int, hi: int) -> TokenRuns:
        if hi <= lo:
            return _EMPTY
        if lo == 0 and hi >= self._length:
            return self
        memo = self._slices
        if memo is None:
            memo = self._slices = {}
        found = memo.get((lo, hi))
        if found is None:
            found = memo[(lo, hi)] = self._cut(lo, hi)
        return found

    def _cut(self, lo: int, hi: int) -> TokenRuns:
        ends, runs = self._ends, self.runs
        first = bisect.bisect_right(ends, lo)
        last = bisect.bisect_left(ends, hi)  # the run holding token hi - 1
        start = ends[first - 1] if first else 0
        if first == last:
            uid, offset, _ = runs[first]
            return TokenRuns._canonical(((uid, offset + lo - start, hi - lo),), hi - lo)
        uid, offset, length = runs[first]
        head = (uid, offset + lo - start, start + length - lo)
        uid, offset, length = runs[last]
        tail = (uid, offset, hi - ends[last - 1])
        return TokenRuns._canonical((head, *runs[first + 1:last], tail), hi - lo)

    def __getitem__(self, index: int | slice) -> int | TokenRuns:  # type: ignore[override]
        n = self._length
        if type(index) is slice:
            lo, hi = index.start or 0, index.stop
            if hi is None:
                hi = n
            if index.step is None and type(lo) is int and type(hi) is int and 0 <= lo and 0 <= hi:
                return self._slice(lo, min(hi, n))  # the scheduler's and the cache's slices: [lo:hi], [:hi], [lo:]
            lo, hi, step = index.indices(n)
            if step != 1:
                raise ValueError("TokenRuns slices take step 1 only")
            return self._slice(lo, hi)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("token index out of range")
        ends = self._ends
        k = bisect.bisect_right(ends, index)
        uid, offset, _ = self.runs[k]
        return uid << 32 | (offset + index - (ends[k - 1] if k else 0))

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(range(u << 32 | o, (u << 32 | o) + n) for u, o, n in self.runs)

    def __add__(self, other: Sequence[int]) -> TokenRuns:
        if isinstance(other, TokenRuns):
            if not other.runs:
                return self
            if not self.runs:
                return other
            a, b = self.runs[-1], other.runs[0]
            if a[0] == b[0] and a[1] + a[2] == b[1]:  # the junction continues one text
                return TokenRuns._canonical(self.runs[:-1] + ((a[0], a[1], a[2] + b[2]),) + other.runs[1:])
            return TokenRuns._canonical(self.runs + other.runs)
        if len(other):
            raise TypeError("a TokenRuns extends only with another TokenRuns")
        return self

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, TokenRuns) and self.runs == other.runs)

    def startswith(self, prefix: Sequence[int]) -> bool:
        """`self[:len(prefix)] == prefix` without building the slice: both canonical, so `prefix`'s runs are this
        sequence's first runs, its last run possibly cut short (engine/prefix_cache.py `add_tail` asks)."""
        if not isinstance(prefix, TokenRuns):
            return self[:len(prefix)] == prefix
        theirs, mine = prefix.runs, self.runs
        count = len(theirs)
        if not count:
            return True
        if count > len(mine) or theirs[:count - 1] != mine[:count - 1]:
            return False
        (uid, offset, length), (my_uid, my_offset, my_length) = theirs[-1], mine[count - 1]
        return uid == my_uid and offset == my_offset and length <= my_length

    def __hash__(self) -> int:
        return hash(self.runs)

    def key_bytes(self) -> bytes:
        if self._key is None:
            self._key = b"".join(_RUN.pack(*run) for run in self.runs)
        return self._key

    def continues(self, earlier: TokenRuns) -> None:
        """`earlier`'s runs are the first runs of this sequence (a session's previous prompt, which the next turn
        re-sends): the block encodings computed for it serve this sequence's first blocks. Checked, not trusted."""
        if len(earlier.runs) <= len(self.runs) and self.runs[:len(earlier.runs)] == earlier.runs:
            self._prefix = earlier
            earlier._prefix = None  # no chain of a session's prompts kept alive
            head = earlier._ends_list
            if head and self._ends_list is None:  # the run ends of the shared runs, then the rest's
                rest = itertools.accumulate(map(_LENGTH, self.runs[len(earlier.runs):]), initial=head[-1])
                next(rest)
                self._ends_list = head + list(rest)

    def block_key_bytes(self, block_tokens: int, first: int, num_blocks: int) -> list[bytes]:
        """`key_bytes()` of the slices [k*block_tokens, (k+1)*block_tokens) for k in first..num_blocks-1
        (engine/prefix_cache.py `chain_keys` keys a prompt's blocks with it). Equal to slicing each block and
        encoding it: a block's runs are the runs it overlaps, cut at its edges. Full blocks are remembered per
        block size (a prompt is keyed on its prefill and its decode instance) and taken over from the sequence
        this one `continues`; the rest come from one walk over the runs (from `first` only, unremembered, when
        blocks before `first` were never encoded: `chained_keys` took their keys over)."""
        if num_blocks <= first:
            return []
        if self._blocks is None:
            self._blocks = {}
        memo = self._blocks.get(block_tokens)
        if memo is None:
            memo = self._blocks[block_tokens] = []
            earlier = self._prefix
            if earlier is not None and earlier._blocks is not None:
                memo.extend(earlier._blocks.get(block_tokens, ()))  # full blocks of a prefix: the same tokens
        if first > len(memo):  # the blocks before `first` are not asked for (their keys are known): walk the rest
            return self._walk_blocks(block_tokens, first, num_blocks)
        num_full = min(num_blocks, self._length // block_tokens)
        if len(memo) < num_full:
            memo += self._walk_blocks(block_tokens, len(memo), num_full)
        if num_blocks > num_full:  # a block past the end, cut short as a slice is (never remembered)
            return memo[first:num_full] + self._walk_blocks(block_tokens, max(first, num_full), num_blocks)
        return memo[first:num_blocks]

    def chained_keys(self, block_tokens: int, num_blocks: int, fingerprint: bytes, root: bytes) -> list[bytes]:
        """engine/prefix_cache.py `chain_keys(self, block_tokens, num_blocks, fingerprint, root)`, remembered per
        (block size, fingerprint, root) for full blocks: the prefill and the decode instance of one layout key the
        same prompt alike, and a turn's prompt takes over the keys of the earlier prompt it `continues` (a chained
        key names its whole prefix, so the keys of the earlier prompt's full blocks are this prompt's first keys).
        Keys past the full blocks are chained afresh each call, never remembered."""
        if num_blocks * block_tokens > self._length:
            return chain_keys(self, block_tokens, num_blocks, fingerprint, root)
        if self._chains is None:
            self._chains = {}
        config = (block_tokens, fingerprint, root)
        memo = self._chains.get(config)
        if memo is None:
            memo = self._chains[config] = []
            earlier = self._prefix
            if earlier is not None and earlier._chains is not None:
                memo.extend(earlier._chains.get(config, ()))
        if len(memo) < num_blocks:
            memo += chain_keys(self, block_tokens, num_blocks, fingerprint, memo[-1] if memo else root, len(memo))
        return memo[:num_blocks]

    def _walk_blocks(self, block_tokens: int, first: int, num_blocks: int) -> list[bytes]:
        """The encodings of blocks first..num_blocks-1, in one walk over the runs."""
        out: list[bytes] = []
        if num_blocks <= first:
            return out
        pack, runs, ends = _RUN.pack, self.runs, self._ends
        lo = first * block_tokens
        i = bisect.bisect_right(ends, lo)  # the run holding token lo
        start = ends[i - 1] if i else 0  # its first token's position
        for _ in range(first, num_blocks):
            hi = lo + block_tokens
            parts = []
            while i < len(runs):  # (a block past the end is cut short, as a slice is)
                uid, offset, length = runs[i]
                end = start + length
                parts.append(pack(uid, offset + lo - start, min(end, hi) - lo))
                if end > hi:
                    break
                i, start, lo = i + 1, end, end
                if end == hi:
                    break
            out.append(b"".join(parts))
            lo = hi
        return out

    def extended(self, uid: int, count: int) -> TokenRuns:
        """This sequence followed by `count` more tokens of text `uid` (continuing its last run of `uid`)."""
        if count <= 0:
            return self
        last = self.runs[-1] if self.runs else None
        if last is not None and last[0] == uid:
            return TokenRuns._canonical(self.runs[:-1] + ((uid, last[1], last[2] + count),))
        return TokenRuns._canonical(self.runs + ((uid, 0, count),))


_EMPTY = TokenRuns()


class Interner:
    """Text -> uid, by content (role, hash, length): equal texts get one uid, so equal prompts share blocks.
    It also keeps each message's runs under a template (a turn re-sends every earlier message of its session)."""

    def __init__(self) -> None:
        self._uids: dict[object, int] = {}
        self._count = 0
        """Uids given so far (texts and fresh ones; a fresh uid is never looked up, so it is not kept)."""
        self.message_runs: dict[Template, dict[tuple, tuple[tuple[int, int, int], ...]]] = {}
        """Per template: (role, hash of content, tokens) -> the message's runs (header, content, end; none empty)."""

    def uid(self, key: object) -> int:
        found = self._uids.get(key)
        if found is None:
            self._count += 1
            found = self._uids[key] = self._count
        return found

    def fresh(self) -> int:
        """A uid no text shares (a request's own sampled output)."""
        self._count += 1
        return self._count


def extends(messages: Sequence[Message], earlier: Sequence[Message]) -> bool:
    """`messages` starts with `earlier` (equal messages; a session's turns share the objects, compared at once)."""
    return len(earlier) <= len(messages) and tuple(messages[:len(earlier)]) == tuple(earlier)


@dataclass(frozen=True)
class Template:
    """How messages become tokens: `kind` "bytes" (the reference engine's byte-level template, exact) or
    "words" (one token per word, `tokens_per_message` framing tokens per message and for the generation prompt)."""

    kind: str = "bytes"
    tokens_per_message: int = 4

    def __post_init__(self) -> None:
        if self.kind not in ("bytes", "words"):
            raise ValueError(f"template.kind must be 'bytes' or 'words', got {self.kind!r}")
        if self.tokens_per_message < 0:
            raise ValueError(f"template.tokens_per_message must be >= 0, got {self.tokens_per_message}")

    def _content_len(self, msg: Message) -> int:
        if self.kind == "bytes":
            return len(msg.content.encode("utf-8", "surrogatepass"))
        return msg.num_tokens

    def _header_len(self, role: str) -> int:
        if self.kind == "bytes":
            return 1 + len(role.encode()) + 1  # ROLE id, "role\n"
        return max(0, self.tokens_per_message - 1)

    def _message_runs(self, msg: Message, interner: Interner) -> tuple[tuple[int, int, int], ...]:
        runs = ((interner.uid(("hdr", msg.role)), 0, self._header_len(msg.role)),
                (interner.uid((msg.role, hash(msg.content), msg.num_tokens)), 0, self._content_len(msg)),
                (interner.uid("end"), 0, 1 if self.kind == "bytes" or self.tokens_per_message else 0))
        return tuple(run for run in runs if run[2] > 0)

    def prompt(self, messages: Sequence[Message], interner: Interner,
               earlier: tuple[Sequence[Message], TokenRuns] | None = None) -> TokenRuns:
        """The templated prompt of `messages`, generation prompt included. Every run starts at offset 0 and none
        is empty, so no two neighbours continue one text: the runs are canonical as they stand. `earlier`: the
        messages and prompt of an earlier call with this interner; when `messages` starts with those messages
        (checked), their runs are taken over and only the new messages are looked up (a session's turn re-sends
        every earlier message)."""
        memo = interner.message_runs.setdefault(self, {})
        runs: list[tuple[int, int, int]] = [(interner.uid("bos"), 0, 1)]
        interner.uid("end")  # numbered before any message's texts, as ever
        header = self._header_len("assistant")
        if earlier is not None:
            done, done_runs = earlier
            if extends(messages, done) and done_runs.runs:
                runs = list(done_runs.runs[:-1] if header else done_runs.runs)
                messages = messages[len(done):]
        for msg in messages:
            key = (msg.role, hash(msg.content), msg.num_tokens)
            found = memo.get(key)
            if found is None:
                found = memo[key] = self._message_runs(msg, interner)
            runs += found
        if header:
            runs.append((interner.uid(("hdr", "assistant")), 0, header))
        return TokenRuns._canonical(tuple(runs))
