"""The reference engine on one rank: model + row pool + scheduler + runner behind a small typed API.

Serving (colocated):
    engine = Engine(EngineConfig(model="kimi-k3.1-mini"))
    engine.add_request("r1", prompt_token_ids, SamplingParams(max_tokens=32))   # ValueError on bad input
    while engine.has_work: outputs = engine.step()    # StepOutputs: TokenEvent per generated token
    engine.abort("r1")                                  # frees its rows wherever it is
Disaggregation, prefill side:
    res = engine.prefill_and_keep("r1", prompt_token_ids, sampling)   # runs now -> PrefillResult
      (attention row ids, KDA row ids, num_tokens, first token + logprob, generation); the rows stay allocated
    engine.release("r1", res.generation, reads_done=True)   # the reader is done: the rows are free at once
    engine.release("r1", res.generation)                    # given up (lease expired, aborted): quarantined
    (or queue it: add_request(..., export=True); the step that prefills it returns the PrefillResult)
    An export is released by request id AND generation, never by row ids: a stale release frees nothing.
    `abort` of an exported or importing request quarantines its rows for `config.quarantine_s` (a READ posted
    before may still target them; `abort(..., reads_done=True)` frees them at once when none can); `hold(request_id)` keeps them out for good (a READ that could not be
    cancelled). Quarantine times come from `clock` (a node passes the round's time, shared by its ranks).
Disaggregation, decode side:
    table = engine.allocate_for_import("r1", prompt_token_ids, sampling)  # rows for prompt + max_tokens;
      an external writer (NIXL) fills the attention rows and KDA rows of `table` inside engine.pool.buffer
    outputs = engine.start_decode("r1", first_token, first_logprob)       # emits the first token, then decodes
Admission outside the queue (`prefill_and_keep`, `allocate_for_import`) raises engine.cache.OutOfRows when the
pool is short of rows; bad input raises ValueError with a message naming the bad value.
Oracle: `engine.generate(request_id, prompt_token_ids, sampling) -> GenerationResult`.
Token events are `engine.outputs.TokenEvent(request_id, token_id, index, logprob, ..., finish_reason)`; finish_reason is "stop"
(EOS, stop token or stop string), "length" (max_tokens) or "abort" on the last one.
The pool buffer (`engine.pool.buffer`) is the one contiguous tensor a transport registers, on `config.device` (a CPU
tensor, or VRAM of one GPU).
Parallel wrappers (engine/parallel/) may pass their own `model` (any object with KimiModel's prefill/decode).
A node's rank (engine/rank_engine.py builds its engine) applies the rank commands of engine/api.py here
(`RankEngine`): `apply(cmd) -> list[Event]` (Submit, StartDecode, Abort, Release, HoldRows), `import_kv(ImportKV)
-> ImportRows` (the rows, the prompt blocks reused from the prefix cache, the prefill node's first token kept for
StartDecode), `step_events()` (a step's events: tokens, prompt log-probs, ExportedRows) and `rank_stats()`.
`EngineConfig` and `SamplingParams` are engine/api.py's (torch-free, imported here for callers).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from engine.api import (
    Abort,
    Command,
    EngineConfig,
    Event,
    HoldRows,
    ImportKV,
    ImportRows,
    MoveOut,
    RankStats,
    Release,
    SamplingParams,
    StartDecode,
    Submit,
)
from engine.cache import BlockTable, RowPool
from engine.prefix_cache import CachedTail, PrefixCache
from engine.kernels import KernelChoice, interpreter_active, parallelism_of, resolve, triton_installed
from engine.layout import RowLayout, plan_layout
from engine.model.checkpoint import weights_fingerprint as model_weights_fingerprint
from engine.model.config import ModelConfig, resolve_model
from engine.model.model import KimiModel
from engine.model.tokenizer import load_tokenizer
from engine.model.tokenizer_files import vocab_file
from engine.model.weights import build_model
from engine.outputs import PromptLogprobs, TokenEvent
from engine.parallel.spmd import TimedModel
from engine.results import CacheReport, GenerationResult, PrefillResult, StepOutputs
from engine.runner import ModelRunner
from engine.sampling import SampledToken, prompt_logprobs, request_seed, sample
from engine.scheduler import Request, RequestState, Scheduler


MAX_SESSIONS = 1024


def weights_fingerprint(config: EngineConfig, layout_fingerprint: str, model_config: ModelConfig | None = None,
                        tokenizer: str = "byte") -> str:
    """Model preset, weights (seed, file), tokenizer and row layout: KV is interchangeable only between equals.
    A checkpoint's model is named by its checkpoint fingerprint (engine/model/checkpoint.py), not its path;
    `tokenizer`: the tokenizer's fingerprint (`byte` for the presets' byte tokenizer)."""
    model = config.model
    if model_config is not None and model_config.checkpoint is not None:
        model = model_weights_fingerprint(model_config, config.seed)
    text = f"{model}|seed={config.seed}|weights={config.weights}|tokenizer={tokenizer}|layout={layout_fingerprint}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _split_resumed(req: Request) -> tuple[list[int], list[int]]:
    """(prompt, outputs) as the sampler sees them: a resumed request's last `num_resumed` prompt tokens are
    outputs of the stream it continues."""
    k = req.sampling.num_resumed
    if not k:
        return req.prompt_token_ids, req.output_token_ids
    return req.prompt_token_ids[:-k], req.prompt_token_ids[-k:] + req.output_token_ids


class Engine:
    def __init__(self, config: EngineConfig, model: KimiModel | None = None,
                 make_cache: Callable[[RowPool, BlockTable], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`model`: a built model or SPMD wrapper (default: built from the preset); `make_cache`: the per-request
        cache view over the pool (default RowSequenceCache; a DCP rank passes its DCPRowCache); `clock`: the time
        quarantines are measured in."""
        self.config = config
        self.clock = clock
        self.model_config: ModelConfig = resolve_model(config.model, config.exact_index_scores)
        self.model = model if model is not None else build_model(self.model_config, config.seed, config.weights,
                                                                 device=config.device)
        checkpoint = self.model_config.checkpoint
        weights_only = checkpoint is not None and vocab_file(checkpoint) is None
        self.tokenizer = None if weights_only else load_tokenizer(checkpoint or config.model)
        """The model's tokenizer (a checkpoint's own files, else the byte tokenizer); None for a checkpoint that ships
        weights only (token ids in and out; stop strings are refused)."""
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        self.eos_token_ids = frozenset({self.model_config.eos_token_id, *eos})
        """What ends a request unless it sets ignore_eos: the model's EOS and every EOS id of its tokenizer (a
        checkpoint's configs may name several)."""
        self.layout: RowLayout = plan_layout(self.model_config, tp_size=config.tp_size, dcp_size=config.dcp_size,
                                             subblock_tokens=config.subblock_tokens, block_size=config.block_size)
        self.pool = RowPool(self.layout, self.model_config, config.num_rows, device=config.device)
        self.kernel_choice: KernelChoice = resolve(
            config.kernels, self._parallelism, getattr(self.model, "device", "cpu"), interpreter_active(),
            has_triton=triton_installed(), unfit=self._fast_unfit(model, make_cache))
        """What runs each phase (engine/kernels.py); `kernels` is its set."""
        self.kernels = self.kernel_choice.kernels
        if self.kernels == "fast":
            self.model = self._fast_model()
        self.fingerprint = weights_fingerprint(config, self.layout.fingerprint, self.model_config,
                                               self.tokenizer.fingerprint if self.tokenizer else "none")
        self.cache = PrefixCache(self.pool, self.layout.block_size, self.fingerprint.encode(), config.prefix_cache)
        self.pool.spare = self.cache
        self.scheduler = Scheduler(self.pool, config.max_batch, self.cache, config.max_step_tokens,
                                   resume=getattr(self.model, "supports_resume", True),
                                   decode_first_tokens=config.decode_first_tokens)
        self.runner = ModelRunner(self.model, self.pool, make_cache)
        self.sessions: OrderedDict[str, tuple[list[bytes], list[CachedTail]]] = OrderedDict()
        """Session key -> (block keys of its last finished turn (prompt + answer), that turn's tails), most recent
        last."""
        self._import_firsts: dict[str, TokenEvent] = {}
        """Imports waiting for StartDecode -> the prefill node's first token (`import_kv`)."""
        self._reported_cache: tuple | None = None
        """What the last CacheReport of `rank_stats` depended on."""
        self._moving: set[str] = set()
        """Running requests to export at their next decode step (`MoveOut`)."""

    @property
    def _parallelism(self) -> str:
        return parallelism_of(self.config.tp_size, self.config.dcp_size)

    def _fast_unfit(self, model: Any, make_cache: Any) -> str | None:
        """Why this engine's model cannot switch to the fast set (None: it can): a passed-in wrapper
        (engine/parallel/spmd.py, switched by `fast_kernels(layout)`) must run the engine's parallelism; the plain
        model (built here or passed in) runs one rank."""
        runs = getattr(model, "parallelism", None) if hasattr(model, "fast_kernels") else (
            "single" if (model is None or isinstance(model, KimiModel)) and make_cache is None else None)
        name = type(model).__name__
        from engine.fast.support import fast_unsupported

        lacks = fast_unsupported(self.model_config, self._parallelism)
        if lacks is not None:
            return lacks
        if runs is None:
            return f"the engine's model ({name}{' with its own cache views' if make_cache else ''}) has no fast path"
        if runs != self._parallelism:
            return (f"the engine's model ({name}) runs {runs}, the engine {self._parallelism} (tp_size="
                    f"{self.config.tp_size}, dcp_size={self.config.dcp_size}): pass engine/parallel/spmd.py's wrapper")
        return None

    def _fast_model(self) -> Any:
        if isinstance(self.model, KimiModel):
            from engine.fast.model import FastModel

            return FastModel(self.model, self.layout)
        return self.model.fast_kernels(self.layout)

    # ---- requests ----
    def _make_request(self, request_id: str, prompt: list[int] | tuple[int, ...], sampling: SamplingParams,
                      export: bool = False, session: str = "", cache_salt: str = "") -> Request:
        prompt = [int(t) for t in prompt]
        cfg = self.model_config
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range 0..{cfg.vocab_size - 1}: {bad[:5]}")
        if sampling.num_resumed >= len(prompt):
            raise ValueError(f"num_resumed ({sampling.num_resumed}) must leave at least one prompt token of the "
                             f"{len(prompt)}")
        if sampling.stop and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer; the checkpoint {cfg.checkpoint} ships none (use "
                             "stop_token_ids)")
        total = len(prompt) + (1 if export else sampling.max_tokens)
        if total > cfg.max_context:
            raise ValueError(f"the model's maximum context length is {cfg.max_context} tokens; the request needs "
                             f"{total} ({len(prompt)} prompt + {total - len(prompt)} completion)")
        return Request(request_id, prompt, sampling, request_seed(sampling, request_id), export=export,
                       session=session, cache_salt=cache_salt)

    def add_request(self, request_id: str, prompt_token_ids: list[int] | tuple[int, ...],
                    sampling: SamplingParams, export: bool = False, session: str = "", cache_salt: str = "") -> None:
        self.scheduler.add(self._make_request(request_id, prompt_token_ids, sampling, export, session, cache_salt))

    def abort(self, request_id: str, reads_done: bool = False) -> bool:
        """End a request wherever it is; an exported or importing one's rows are quarantined, not freed, unless
        `reads_done` (no READ can target them: an export no reader claimed)."""
        self._import_firsts.pop(request_id, None)
        self._moving.discard(request_id)
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        remote = not reads_done and req.state in (RequestState.EXPORTED, RequestState.IMPORTING)
        self.scheduler.finish(req, "abort", self._quarantine_until() if remote else None)
        return True

    def _quarantine_until(self) -> float:
        return self.clock() + self.config.quarantine_s

    def reclaim(self) -> list[int]:
        """Free the quarantined rows whose time is up (every step and admission does it first)."""
        now = self.clock()
        self.cache.now = now
        return self.pool.reclaim(now)

    # ---- stepping ----
    def step(self) -> StepOutputs:
        out = StepOutputs()
        self.reclaim()
        plan = self.scheduler.schedule()
        if plan.prefill is not None:
            req = plan.prefill
            logits = self._prefill(req, plan.prefill_end, out)
            if logits is None:
                pass  # more chunks to go
            elif req.sampling.max_tokens == 0:  # scoring only: the prompt's log-probs are the answer
                self.scheduler.finish(req, "length")
                out.tokens.append(TokenEvent(request_id=req.request_id, token_id=None, finish_reason="length",
                                             num_prompt_tokens=len(req.prompt_token_ids),
                                             num_cached_tokens=req.num_cached_tokens))
            else:
                self._first_token(req, self._sample(req, logits), out)
        if plan.decode:
            logits = self.runner.decode(plan.decode)
            bt = self.layout.block_size
            for i, req in enumerate(plan.decode):
                written = req.num_tokens  # the step wrote the KV of position num_tokens - 1
                if written % bt == 0:
                    self.scheduler.publish(req, written, snapshot=True)
                tok = self._sample(req, logits[i])
                if req.request_id in self._moving:
                    out.exported.append(self._move_out(req, tok))
                else:
                    out.tokens.append(self._append(req, tok))
        return out

    def _move_out(self, req: Request, tok: SampledToken) -> PrefillResult:
        """Export a running request (`MoveOut`): the rows hold the KV of prompt + outputs (this step wrote the
        last one's) and the KDA state after them; `tok` is the next token, which the reader streams first."""
        self._moving.discard(req.request_id)
        self.scheduler.export(req)
        assert req.table is not None
        num_tokens = req.num_tokens
        num_attn = -(-num_tokens // self.layout.block_size)
        return PrefillResult(req.request_id, tuple(req.table.attn_row_ids[:num_attn]), tuple(req.table.kda_row_ids),
                             num_tokens, tok.token_id, tok.logprob, req.generation, tok.top_logprobs,
                             req.num_cached_tokens)

    @staticmethod
    def _sample(req: Request, logits: torch.Tensor) -> SampledToken:
        """The request's next token from its logits [V], given the tokens it has so far (a resumed request's
        earlier outputs, the prompt's last `num_resumed` tokens, count as outputs: step and penalties)."""
        prompt, outputs = _split_resumed(req)
        return sample(logits, req.sampling, req.seed, len(outputs), prompt, outputs)

    def _first_token(self, req: Request, tok: SampledToken, out: StepOutputs) -> None:
        if req.export:
            req.output_token_ids.append(tok.token_id)
            req.output_logprobs.append(tok.logprob)
            self._remember_session(req)
            self.scheduler.export(req)
            out.exported.append(self._prefill_result(req, tok))
        else:
            self.scheduler.start_running(req)
            out.tokens.append(self._append(req, tok))

    def _prefill(self, req: Request, end: int, out: StepOutputs) -> torch.Tensor | None:
        """Prefill prompt positions [req.num_computed, end) of `req` -> None while more chunks remain, else the
        last position's logits [V]; with `prompt_logprobs`, every position's logits are computed and the
        prompt's log-probs go to `out`."""
        count = req.sampling.prompt_logprobs
        start, n = req.num_computed, len(req.prompt_token_ids)
        chunk = self.runner.prefill(req, start, end, all_logits=count is not None)
        req.num_computed = end
        self.scheduler.publish(req, end, snapshot=end == self.scheduler.snapshot_boundary(req) > 0)
        if end < n:
            if count is not None:
                req.prompt_logits.append(chunk)
            return None
        self.scheduler.prefill_done(req)
        self.scheduler.keep_prompt_state(req)
        if count is None:
            return chunk
        logits = torch.cat([*req.prompt_logits, chunk]) if req.prompt_logits else chunk
        req.prompt_logits = []
        entries = [TokenEvent(request_id=req.request_id, token_id=req.prompt_token_ids[0], index=0)]
        for i, scored in enumerate(prompt_logprobs(logits, req.prompt_token_ids, count), start=1):
            entries.append(TokenEvent(request_id=req.request_id, token_id=scored.token_id, index=i,
                                      logprob=scored.logprob, top_logprobs=scored.top_logprobs, rank=scored.rank))
        out.prompt_logprobs.append(PromptLogprobs(req.request_id, tuple(entries)))
        return logits[-1]

    def _append(self, req: Request, tok: SampledToken) -> TokenEvent:
        req.output_token_ids.append(tok.token_id)
        req.output_logprobs.append(tok.logprob)
        reason = self._finish_reason(req, tok.token_id)
        if reason is not None:
            self._moving.discard(req.request_id)  # it ended before its move
            self._remember_session(req, self.scheduler.keep_tail(req))
            self.scheduler.finish(req, reason)
        return TokenEvent(request_id=req.request_id, token_id=tok.token_id, index=req.num_emitted - 1,
                          logprob=tok.logprob, top_logprobs=tok.top_logprobs, rank=tok.rank, finish_reason=reason,
                          num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.reported_cached_tokens)

    def _finish_reason(self, req: Request, token: int) -> str | None:
        params = req.sampling
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return "stop"
        if params.stop:
            text = self.tokenizer.decode(_split_resumed(req)[1])
            if any(s and s in text for s in params.stop):
                return "stop"
        if len(req.output_token_ids) >= params.max_tokens:
            return "length"
        return None

    # ---- disaggregation ----
    def prefill_and_keep(self, request_id: str, prompt_token_ids: list[int] | tuple[int, ...],
                         sampling: SamplingParams, session: str = "", cache_salt: str = "") -> PrefillResult:
        """Prefill now (outside the queue, from the longest cached prefix) and keep the rows until `release`."""
        req = self._make_request(request_id, prompt_token_ids, sampling, export=True, session=session,
                                 cache_salt=cache_salt)
        self.reclaim()
        self.scheduler.admit_now(req)
        try:
            n, logits = len(req.prompt_token_ids), None
            while logits is None:
                boundary = self.scheduler.snapshot_boundary(req)
                logits = self._prefill(req, boundary if req.num_computed < boundary else n, StepOutputs())
            tok = self._sample(req, logits)
        except BaseException:
            self.scheduler.finish(req, "abort")  # no rows leak when the prefill fails
            raise
        req.output_token_ids.append(tok.token_id)
        req.output_logprobs.append(tok.logprob)
        self._remember_session(req)
        self.scheduler.export(req)
        return self._prefill_result(req, tok)

    def _prefill_result(self, req: Request, first: SampledToken) -> PrefillResult:
        assert req.table is not None
        return PrefillResult(req.request_id, tuple(req.table.attn_row_ids), tuple(req.table.kda_row_ids),
                             len(req.prompt_token_ids), first.token_id, first.logprob, req.generation,
                             first.top_logprobs, req.num_cached_tokens)

    def release(self, request_id: str, generation: int, reads_done: bool = False) -> bool:
        """End export `generation` of `request_id`: its rows are freed when `reads_done` (every READ of them
        finished), else quarantined. False, freeing nothing, if that export is not live (already released,
        aborted, or the id now names another export)."""
        until = None if reads_done else self._quarantine_until()
        return self.scheduler.release(request_id, generation, until)

    def hold(self, request_id: str) -> bool:
        """A READ into this request's rows could not be cancelled: keep them out of the pool for good (now if
        the request already ended, else when it ends). False if the engine knows nothing of it."""
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            req.held = True
            return True
        return self.pool.hold(request_id)

    def allocate_for_import(self, request_id: str, prompt_token_ids: list[int] | tuple[int, ...],
                            sampling: SamplingParams, session: str = "", cache_salt: str = "") -> BlockTable:
        """Rows for a request whose prompt KV an external writer puts into the pool; decode waits for start.
        The first `num_reused_tokens(request_id)` tokens' attention rows are cached blocks this engine already
        holds: the writer must fill only the rows past them (and every KDA row)."""
        req = self._make_request(request_id, prompt_token_ids, sampling, session=session, cache_salt=cache_salt)
        self.reclaim()
        return self.scheduler.add_imported(req, len(req.prompt_token_ids))

    def num_reused_tokens(self, request_id: str) -> int:
        """Prompt tokens of an import (or a local prefill) that came from the prefix cache."""
        req = self.scheduler.requests.get(request_id)
        return 0 if req is None else req.num_cached_tokens

    def start_decode(self, request_id: str, first_token: int, first_logprob: float = math.nan,
                     first_top_logprobs: tuple[tuple[int, float], ...] = ()) -> list[TokenEvent]:
        """The imported rows are complete: emit the first token and put the request in the decode batch."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.state != RequestState.IMPORTING:
            raise ValueError(f"request {request_id!r} is not waiting for an import")
        if not 0 <= first_token < self.model_config.vocab_size:
            raise ValueError(f"first token {first_token} is out of range")
        n = len(req.prompt_token_ids)
        req.num_computed = n
        self.scheduler.publish(req, n, snapshot=n % self.layout.block_size == 0)
        self.scheduler.keep_prompt_state(req)
        self.scheduler.start_running(req)
        return [self._append(req, SampledToken(first_token, first_logprob, first_top_logprobs))]

    def generate(self, request_id: str, prompt_token_ids: list[int] | tuple[int, ...],
                 sampling: SamplingParams, max_steps: int = 1_000_000) -> GenerationResult:
        """Run one request to completion (with whatever else is queued) and return its tokens: the oracle path."""
        self.add_request(request_id, prompt_token_ids, sampling)
        tokens: list[TokenEvent] = []
        for _ in range(max_steps):
            if not self.has_work or (tokens and tokens[-1].finish_reason):
                break
            tokens += [t for t in self.step().tokens if t.request_id == request_id]
        return GenerationResult(request_id, [int(t) for t in prompt_token_ids], [t.token_id for t in tokens],
                                [t.logprob for t in tokens], tokens[-1].finish_reason if tokens else None)

    # ---- the rank protocol (engine/api.py `RankEngine`) ----
    def apply(self, cmd: Command) -> list[Event]:
        """One rank command's events (bad input: ValueError naming it). `ImportKV` is `import_kv`'s: its rows wait
        for a transport's writes, which the decode node's rank role posts."""
        if isinstance(cmd, Submit):
            self.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.sampling, export=cmd.export,
                             session=cmd.session, cache_salt=cmd.cache_salt)
            return []
        if isinstance(cmd, StartDecode):
            first = self._import_firsts.pop(cmd.request_id, None)
            if first is None:  # aborted between its import and this command (a client that left between the legs)
                return []
            return list(self.start_decode(cmd.request_id, int(first.token_id or 0), first.logprob,
                                          first.top_logprobs))
        if isinstance(cmd, Abort):
            ended = self.abort(cmd.request_id, reads_done=cmd.reads_done)
            return [TokenEvent(request_id=cmd.request_id, token_id=None, finish_reason="abort")] if ended else []
        if isinstance(cmd, Release):
            self.release(cmd.request_id, cmd.generation, reads_done=cmd.reads_done)
            return []
        if isinstance(cmd, HoldRows):
            self.hold(cmd.request_id)
            return []
        if isinstance(cmd, MoveOut):  # a stream not decoding yet (queued, prefilling, importing) moves at its first
            req = self.scheduler.requests.get(cmd.request_id)  # decode step
            if req is not None and not req.export and req.state not in (RequestState.EXPORTED,
                                                                          RequestState.FINISHED):
                self._moving.add(cmd.request_id)
            return []
        if isinstance(cmd, ImportKV):
            raise ValueError(f"ImportKV {cmd.request_id!r} needs a transport to fill its rows: import_kv allocates them")
        raise ValueError(f"unknown command {type(cmd).__name__}")

    def import_kv(self, cmd: ImportKV) -> ImportRows:
        """Rows for an import (`allocate_for_import`; OutOfRows allocates nothing), ready for a transport's writes
        once this returns; `cmd.first` waits for its `StartDecode`."""
        table = self.allocate_for_import(cmd.request_id, cmd.prompt_token_ids, cmd.sampling, session=cmd.session,
                                         cache_salt=cmd.cache_salt)
        if self.pool.buffer.is_cuda:  # the KDA rows' zeroing is queued on the GPU: done before a READ may write them
            torch.cuda.synchronize(self.pool.buffer.device)
        self._import_firsts[cmd.request_id] = cmd.first
        return ImportRows(tuple(table.attn_row_ids), tuple(table.kda_row_ids), self.num_reused_tokens(cmd.request_id))

    def step_events(self) -> list[Event]:
        """Free the quarantines whose time is up (in lockstep, busy or idle), then one step when there is work."""
        self.reclaim()
        if not self.has_work:
            return []
        outputs = self.step()
        return [*outputs.prompt_logprobs, *outputs.tokens, *(res.event() for res in outputs.exported)]

    def rank_stats(self, report_cache: bool = False) -> RankStats:
        """The rank's load; rows only the prefix cache holds (evictable on demand) count as free, as vLLM counts its
        cached blocks. The SPMD wrapper's counters and timings (taken: each is reported once). `report_cache`
        (every rank's cache decides alike: one rank speaks for the node): the prefix cache's counters, and its
        CacheReport when anything it depends on moved since the last one reported."""
        counters = self.model.counters() if isinstance(self.model, TimedModel) else ()
        timings = self.model.take_timings() if isinstance(self.model, TimedModel) else ()
        cache = None
        if report_cache:
            totals = self.cache.counters
            counters += (("prefix_cache_queried_tokens", float(totals.queried_tokens)),
                         ("prefix_cache_hit_tokens", float(totals.hit_tokens)),
                         ("prefix_cache_evicted_blocks", float(totals.evicted_blocks)),
                         ("kv_transfer_blocks_read", float(totals.blocks_read)),
                         ("kv_transfer_blocks_reused", float(totals.blocks_reused)),
                         ("num_preemptions", float(self.scheduler.num_preemptions)))
            last_session = next(reversed(self.sessions), None)
            depends = (self.cache.num_blocks, self.pool.num_free, tuple(vars(totals).values()), len(self.sessions),
                       last_session)
            if depends != self._reported_cache:
                self._reported_cache, cache = depends, self.cache_report()
        total = self.pool.num_usable  # config.num_rows less rows the engine set aside for itself
        return RankStats(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                         num_rows_used=total - self.pool.num_available - self.pool.num_quarantined,
                         num_rows_total=total, has_work=self.has_work, counters=counters, timings=timings,
                         cache=cache)

    # ---- sessions and the cache report ----
    def _remember_session(self, req: Request, tails: list[CachedTail] | None = None) -> None:
        if not req.session or not self.cache.enabled:
            return
        self.sessions[req.session] = (list(req.block_keys), tails or [])
        self.sessions.move_to_end(req.session)
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)

    def cache_report(self) -> CacheReport:
        cache, recent = self.cache, list(reversed(self.sessions.items()))
        counters = cache.counters
        figures = [(s, cache.held_figures(keys, tails)) for s, (keys, tails) in recent]
        return CacheReport(
            block_tokens=self.layout.block_size, fingerprint=self.fingerprint,
            sessions=tuple((s, held) for s, (held, _) in figures),
            resumable=tuple((s, resumable) for s, (_, resumable) in figures),
            blocks_cached=cache.num_blocks, rows_free=self.pool.num_free, hits_tokens=counters.hit_tokens,
            queried_tokens=counters.queried_tokens, evicted_blocks=counters.evicted_blocks,
            blocks_read=counters.blocks_read, blocks_reused=counters.blocks_reused,
            tails=cache.enabled and self.scheduler.resume)

    # ---- introspection ----
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def warm_up(self, decode: bool = True) -> list[int] | None:
        """Before the first request: the model's one-time costs where it has them (FastModel with CUDA graphs:
        the torch.compile of its segments and, with `decode`, the decode graph of each batch bucket up to
        max_batch; rows used meanwhile are freed). Returns the batch sizes decoded, None where there was
        nothing to do."""
        warm = getattr(self.model, "warm_up", None)
        if warm is None or not getattr(self.model, "graphs", False):
            return None
        return warm(self.pool, self.config.max_batch if decode else 0)

    @property
    def num_free_rows(self) -> int:
        return self.pool.num_free

    @property
    def num_available_rows(self) -> int:
        """Free rows plus those the prefix cache gives up on demand (unreferenced blocks, tails)."""
        return self.pool.num_available

    @property
    def num_quarantined_rows(self) -> int:
        return self.pool.num_quarantined

    def request_state(self, request_id: str) -> RequestState | None:
        req = self.scheduler.requests.get(request_id)
        return None if req is None else req.state
