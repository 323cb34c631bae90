"""A small deterministic engine for testing the node layer (executor, HTTP, leases, NIXL plumbing): the rank surface
of engine/api.py `RankEngine` (`apply`, `import_kv`, `step_events`, `rank_stats`), built by `build_engine`, the
engine factory a node names with `backend="tests.node.toy_backend:build_engine"`.

It is not a model: it owns a real row pool laid out by engine.layout, fills a request's rows with
bytes derived from its prompt at prefill, and derives every output token from a CRC of the request's rows
(plus the previous token). So a decode that continues from transferred rows produces the colocated tokens
only if every row byte arrived intact, which is what the P -> D tests check. Rows are allocated lowest id
first, so every rank of a node makes the same choices (SPMD). Row ownership follows the engine's rules: an
export is released by request id and generation; aborted exports and imports are quarantined for
`quarantine_s` in the round's time, unless the `Abort` says `reads_done` (rows in quarantine count neither as used
nor as free); `HoldRows` keeps a request's rows out for good.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.api import (
    Abort,
    Command,
    EngineConfig,
    Event,
    ExportedRows,
    HoldRows,
    ImportKV,
    ImportRows,
    RankStats,
    Release,
    StartDecode,
    Submit,
    TokenEvent,
)
from engine.layout import plan_layout
from engine.results import CacheReport
from engine.model.config import get_preset
from engine.model.tokenizer_stream import IncrementalDecoder

EOS = 257
PROCESS_GROUP = False
"""Its ranks run no collective (each makes the same choices alone), so they join no torch process group and never
import torch (node/executor.py `WorkerSpec.process_group`): a toy node starts in a fraction of a second."""


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (no BOS); ids above 255 decode to nothing; chats as
    `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`."""

    eos_token_id = EOS
    stop_token_ids: tuple[int, ...] = ()
    fingerprint = "toy-bytes"

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Any) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def encode_chat(self, messages: list[Any], add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"<|{m.role}|>\n{m.text()}\n" for m in messages)
        return self.encode(text + ("<|assistant|>\n" if add_generation_prompt else ""))

    def decoder(self, context_ids: Any = ()) -> IncrementalDecoder:
        return IncrementalDecoder(self.decode, context_ids)


def load_tokenizer(model_config: Any) -> ByteTokenizer:
    return ByteTokenizer(model_config.vocab_size)


@dataclass
class _Req:
    cmd: Any
    attn_rows: list[int] = field(default_factory=list)
    kda_rows: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    state: str = "waiting"
    generation: int = 0
    held: bool = False


@dataclass(frozen=True)
class ToyPool:
    buffer: np.ndarray
    """The rows, `num_rows * row_bytes` bytes (what a transport registers)."""


class ToyEngine:
    kernels = "reference"
    """What a rank reports as its kernel set (the toy runs no model kernels; "reference" is the node default)."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.model_config = get_preset(config.model)
        self.layout = plan_layout(self.model_config, tp_size=config.tp_size, dcp_size=config.dcp_size,
                                  block_size=config.block_size)
        self.pool = ToyPool(np.zeros(config.num_rows * self.layout.row_bytes, dtype=np.uint8))
        self.free = list(range(config.num_rows))
        self.reqs: dict[str, _Req] = {}
        self.quarantined: list[list] = []  # [until, rows, request id]
        self.clock = clock
        self.generations = 0

    def _row(self, row: int) -> np.ndarray:
        size = self.layout.row_bytes
        return self.pool.buffer[row * size:(row + 1) * size]

    def _alloc(self, num_tokens: int) -> tuple[list[int], list[int]]:
        num_attn, num_kda = self.layout.rows_per_request(num_tokens)
        if num_attn + num_kda > len(self.free):
            from engine.cache import OutOfRows  # the engine's contract for admission outside the queue

            raise OutOfRows(f"out of rows: {num_attn + num_kda} needed, {len(self.free)} free")
        self.free.sort()
        rows, self.free = self.free[:num_attn + num_kda], self.free[num_attn + num_kda:]
        return rows[:num_attn], rows[num_attn:]

    def _extents(self, req: _Req) -> list[tuple[int, int]]:
        """(row, bytes) holding the request's state: whole sub-blocks up to the last prompt token in each
        attention row, `kda_state_bytes` of each KDA row (the rest of a row is padding nobody reads)."""
        lay, num_tokens = self.layout, len(req.cmd.prompt_token_ids)
        out = []
        for j, row in enumerate(req.attn_rows):
            tokens = min(lay.tokens_per_row, num_tokens - j * lay.tokens_per_row)
            out.append((row, -(-tokens // lay.subblock_tokens) * lay.subblock_bytes))
        return out + [(row, lay.kda_state_bytes) for row in req.kda_rows]

    def _fill(self, req: _Req) -> None:
        prompt = np.array(req.cmd.prompt_token_ids, dtype=np.int64)
        seed = int((prompt * np.arange(1, len(prompt) + 1)).sum() % 65521)
        for k, (row, size) in enumerate(self._extents(req)):
            ramp = np.arange(size, dtype=np.int64)
            self._row(row)[:size] = ((seed * (k + 1) + 131 * k + ramp) % 256).astype(np.uint8)

    def _token(self, req: _Req, prev: int) -> int:
        crc = 0
        for row, size in self._extents(req):
            crc = zlib.crc32(self._row(row)[:size].tobytes(), crc)
        return zlib.crc32(prev.to_bytes(4, "little") + len(req.out).to_bytes(4, "little"), crc) % 256

    def apply(self, cmd: Command) -> list[Event]:
        if isinstance(cmd, Submit):
            if not cmd.prompt_token_ids:
                raise ValueError("empty prompt")
            self.reqs[cmd.request_id] = _Req(cmd)
            return []
        if isinstance(cmd, StartDecode):
            req = self.reqs.get(cmd.request_id)
            if req is None:  # aborted between its import and this command, as the engine allows
                return []
            req.state = "running"
            return self._emit(req, int(req.cmd.first.token_id))
        if isinstance(cmd, Abort):
            return self._abort(cmd)
        if isinstance(cmd, Release):
            self._release(cmd)
            return []
        if isinstance(cmd, HoldRows):
            self._hold(cmd.request_id)
            return []
        raise ValueError(f"the toy engine applies no {type(cmd).__name__} (ImportKV: import_kv)")

    def import_kv(self, cmd: ImportKV) -> ImportRows:
        attn, kda = self._alloc(len(cmd.prompt_token_ids))
        self.reqs[cmd.request_id] = _Req(cmd, attn, kda, state="importing")
        return ImportRows(tuple(attn), tuple(kda))

    def _emit(self, req: _Req, token: int) -> list[Event]:
        req.out.append(token)
        done = len(req.out) >= req.cmd.sampling.max_tokens
        if done:
            self._drop(req.cmd.request_id)
        return [TokenEvent(request_id=req.cmd.request_id, token_id=token, finish_reason="length" if done else None,
                           num_prompt_tokens=len(req.cmd.prompt_token_ids))]

    def _drop(self, request_id: str, quarantine: bool = False) -> None:
        req = self.reqs.pop(request_id, None)
        if req is not None:
            rows = req.attn_rows + req.kda_rows
            if req.held or quarantine:
                until = math.inf if req.held else self.clock() + self.config.quarantine_s
                self.quarantined.append([until, rows, request_id])
            else:
                self.free += rows
            req.attn_rows, req.kda_rows = [], []

    def _abort(self, cmd: Abort) -> list[Event]:
        request_id = cmd.request_id
        req = self.reqs.get(request_id)
        if req is None:
            return []
        self._drop(request_id, quarantine=not cmd.reads_done and req.state in ("exported", "importing"))
        return [TokenEvent(request_id=request_id, token_id=None, finish_reason="abort")]

    def _release(self, cmd: Release) -> None:
        req = self.reqs.get(cmd.request_id)
        if req is not None and req.state == "exported" and req.generation == cmd.generation:
            self._drop(cmd.request_id, quarantine=not cmd.reads_done)

    def _hold(self, request_id: str) -> None:
        if request_id in self.reqs:
            self.reqs[request_id].held = True
        for entry in self.quarantined:
            if entry[2] == request_id:
                entry[0] = math.inf

    def step_events(self) -> list[Event]:
        now = self.clock()
        due = [entry for entry in self.quarantined if entry[0] <= now]
        self.quarantined = [entry for entry in self.quarantined if entry[0] > now]
        self.free += [row for entry in due for row in entry[1]]
        events: list[Event] = []
        for req in list(self.reqs.values()):
            if req.state == "waiting":
                if sum(self.layout.rows_per_request(len(req.cmd.prompt_token_ids))) > len(self.free):
                    continue  # waits for rows (some may be in quarantine), as the engine's queue does
                req.attn_rows, req.kda_rows = self._alloc(len(req.cmd.prompt_token_ids))
                self._fill(req)
                first = self._token(req, -1 % 256)
                if req.cmd.export:
                    req.state = "exported"
                    self.generations += 1
                    req.generation = self.generations
                    events.append(ExportedRows(request_id=req.cmd.request_id, attn_row_ids=tuple(req.attn_rows),
                                               kda_row_ids=tuple(req.kda_rows),
                                               num_tokens=len(req.cmd.prompt_token_ids),
                                               first=TokenEvent(request_id=req.cmd.request_id, token_id=first),
                                               generation=req.generation))
                else:
                    req.state = "running"
                    events += self._emit(req, first)
            elif req.state == "running":
                events += self._emit(req, self._token(req, req.out[-1]))
        return events

    def rank_stats(self, report_cache: bool = False) -> RankStats:
        """The toy keeps no prefix cache: with `report_cache` it reports an empty one (no sessions, no blocks) and its
        free rows, so its node answers `/v1/cache` (with its engine id, which the router binds hand-offs to) as a
        reference node with its cache off does."""
        running = sum(r.state == "running" for r in self.reqs.values())
        waiting = sum(r.state == "waiting" for r in self.reqs.values())
        num_quarantined = sum(len(entry[1]) for entry in self.quarantined)
        cache = CacheReport(block_tokens=self.layout.block_size, fingerprint=f"toy-{self.layout.fingerprint}",
                            sessions=(), resumable=(), blocks_cached=0, rows_free=len(self.free), hits_tokens=0,
                            queried_tokens=0, evicted_blocks=0, blocks_read=0, blocks_reused=0) if report_cache else None
        return RankStats(num_running=running, num_waiting=waiting,
                         num_rows_used=self.config.num_rows - len(self.free) - num_quarantined,
                         num_rows_total=self.config.num_rows, has_work=bool(running or waiting), cache=cache)


def build_engine(config: EngineConfig, ctx: Any, clock: Callable[[], float], token_shard_min_tokens: int = 1,
                 warm_decode: bool = True) -> ToyEngine:
    """The toy's engine factory, with engine/rank_engine.py `build_rank_engine`'s signature. Its ranks shard no
    prefill (a threshold other than the default is refused, not ignored) and have nothing to warm up (a prefill
    node's `warm_decode=False` skips nothing)."""
    if token_shard_min_tokens != 1:
        raise ValueError(f"the toy engine shards no prefill: token_shard_min_tokens {token_shard_min_tokens}")
    return ToyEngine(config, clock)
