"""The reference engine (engine/) as a rank backend of the node worker (node/worker.py).

Wraps `engine.engine.Engine`: queued prefill/decode with continuous batching (`add_request` + `step`),
prefill-for-export (`add_request(export=True)`, rows kept until `Release` names the export's request id and
generation; aborted exports and imports are quarantined for `config.engine.quarantine_s`, the node's read timeout,
measured in the round's time that every rank shares), import (`allocate_for_import`,
external writes into `engine.pool.buffer`, then `start_decode` with the prefill node's first token). With W ranks
the model is SPMD over the rank group: `TPModel` (heads split) or, on a DCP pool, `DCPModel` (cache split by token).
The engine is built from `config.engine` whole (engine/api.py `EngineConfig`; no field is copied here), its `device`
"cuda" placed on the rank's own GPU (`ctx.device`): weights, the row pool and every intermediate there.
`config.engine.kernels` ("auto" | "reference" | "fast"): the engine's kernel set (engine/fast/backend.py): auto is
fast on a CUDA rank of a single-rank node, reference otherwise; fast on W > 1 TP ranks is the fast SPMD prefill and
the fast TP decode; on a DCP pool the fast DCP decode (its local prefill the reference one).
Also `load_tokenizer`: the server-side tokenizer of the served model (the presets' byte tokenizer or a checkpoint's
own, engine/model/tokenizer.py), with the chat template and the EOS set.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from engine.api import Event, ExportedRows, ImportKV, Release, Submit, TokenEvent
from engine.parallel.spmd import DCPModel, TimedModel, TPModel
from node.protocol import RankStats


@dataclass
class ServerTokenizer:
    """The served model's tokenizer (engine/model/tokenizer.py `load_tokenizer`: the presets' byte tokenizer or a
    checkpoint's own) with what the OpenAI layer needs: the model's vocabulary size (token-id prompts are checked
    against it), the EOS ids the engine does not stop on by itself, the chat template over request messages and
    incremental decoders."""

    inner: Any
    vocab_size: int
    """The model's vocabulary (embedding rows), which may exceed the tokenizer's."""
    engine_eos_id: int
    """The EOS the engine stops on (ModelConfig.eos_token_id)."""

    @property
    def eos_token_id(self) -> int:
        return self.inner.eos_token_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The checkpoint's other EOS ids (generation_config.json lists several): a node adds them to a request's
        stop_token_ids unless it sets ignore_eos, as vLLM does."""
        return tuple(sorted(self.inner.eos_token_ids - {self.engine_eos_id}))

    @property
    def fingerprint(self) -> str:
        return self.inner.fingerprint

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inner.encode(text, add_special_tokens)

    def decode(self, ids: Any) -> str:
        return self.inner.decode(list(ids))

    def token_bytes(self, token_id: int) -> bytes:
        return self.inner.token_bytes(token_id)

    def encode_chat(self, messages: list[Any], add_generation_prompt: bool = True) -> list[int]:
        """Request messages (serving.protocol.ChatMessage) through the model's chat template; a template's refusal
        is a ValueError with its message."""
        from engine.model.tokenizer import ChatMessage

        return self.inner.apply_chat_template([ChatMessage(m.role, m.text()) for m in messages], add_generation_prompt)

    def decoder(self, context_ids: Any = ()) -> Any:
        return self.inner.decoder(list(context_ids))


def load_tokenizer(model_config: Any) -> ServerTokenizer:
    """The tokenizer of the model the ranks serve: a checkpoint's own files (`model_config.checkpoint`), else the
    byte tokenizer. A tokenizer whose ids reach past the model's vocabulary is refused (ValueError naming both)."""
    from engine.model.tokenizer import ByteTokenizer
    from engine.model.tokenizer_checkpoint import load_checkpoint_tokenizer

    inner = load_checkpoint_tokenizer(model_config.checkpoint) if model_config.checkpoint else ByteTokenizer()
    if inner.vocab_size > model_config.vocab_size:
        raise ValueError(f"the tokenizer has {inner.vocab_size} ids but the model's vocab_size is "
                         f"{model_config.vocab_size}: the checkpoint's tokenizer does not belong to its weights")
    return ServerTokenizer(inner, model_config.vocab_size, model_config.eos_token_id)


def _rank_device(device: str, ctx: Any) -> Any:
    """Where this rank computes: the CPU, or the GPU its context bound (rank r: the node's local GPU r)."""
    import torch

    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if ctx.device.type != "cuda":
        raise ValueError("device cuda needs a rank context bound to a GPU (NCCL group); this rank got "
                         f"{ctx.device}")
    return ctx.device


class ReferenceBackend:
    """One rank's Engine; its model is `TimedModel` on one rank, else SPMD over the rank group: `TPModel`, or
    `DCPModel` on a DCP pool (whose cache views are `DCPRowCache`s)."""

    def __init__(self, config: Any, ctx: Any) -> None:
        from engine.engine import Engine
        from engine.model.config import resolve_model
        from engine.model.weights import build_model

        engine_config = config.engine  # whole, as the node completed it (node/runtime.py `worker_config`)
        if engine_config.dcp_size > 1 and engine_config.dcp_size != ctx.world_size:
            raise ValueError(f"a DCP pool runs one rank per DCP rank: dcp_size {engine_config.dcp_size}, "
                             f"{ctx.world_size} ranks")
        device = _rank_device(engine_config.device, ctx)
        engine_config = dataclasses.replace(engine_config, device=str(device))
        # kernels (resolved by the engine, engine/fast/backend.py): auto is fast on a CUDA rank of a single-rank
        # node (TimedModel over FastModel: fast prefill and decode), else reference (always on CPU). Explicit fast
        # also runs on a TP group (TPModel: the fast SPMD prefill and TP decode of engine/parallel/fast_prefill.py
        # and fast_tp.py) and a DCP pool (DCPModel: the fast decode of engine/parallel/fast_dcp.py, the reference
        # local prefill, logged at start); on CPU without the Triton interpreter it raises here naming why
        make_cache = None
        model_cfg = resolve_model(engine_config.model, engine_config.exact_index_scores)
        built = build_model(model_cfg, engine_config.seed, engine_config.weights, device=device)
        if engine_config.dcp_size > 1:
            model = DCPModel(built, ctx, config.token_shard_min_tokens)
            make_cache = model.make_cache
        elif ctx.world_size > 1:
            model = TPModel(built, ctx, config.token_shard_min_tokens)
        else:
            model = TimedModel(built)
        self._now = 0.0
        self.engine = Engine(engine_config, model=model, make_cache=make_cache, clock=lambda: self._now)
        self.layout = self.engine.layout
        self.model_config = self.engine.model_config
        self.kernels = self.engine.kernels
        started = time.perf_counter()
        # before the rank reports in: compilation and (not on a prefill node) decode graphs (fast, CUDA)
        warmed = self.engine.warm_up(decode=config.role != "prefill")
        if warmed is not None and ctx.rank == 0:
            logging.getLogger("pdcluster.node").info("fast kernels warmed up in %.1f s (decode graphs for batches "
                                                     "%s)", time.perf_counter() - started, warmed)
        self._first_tokens: dict[str, TokenEvent] = {}
        self._rank = ctx.rank
        self._cache_sig: tuple | None = None

    def begin_round(self, now: float) -> None:
        self._now = now

    def pool_buffer(self) -> Any:
        return self.engine.pool.buffer

    def num_rows(self) -> int:
        return self.engine.config.num_rows

    def submit(self, cmd: Submit) -> list[Event]:
        self.engine.add_request(cmd.request_id, list(cmd.prompt_token_ids), cmd.sampling, export=cmd.export,
                                session=cmd.session)
        return []

    def allocate_import(self, cmd: ImportKV) -> tuple[list[int], list[int]]:
        table = self.engine.allocate_for_import(cmd.request_id, list(cmd.prompt_token_ids), cmd.sampling,
                                                session=cmd.session)
        buffer = self.engine.pool.buffer
        if buffer.is_cuda:  # the KDA rows' zeroing is queued on the GPU: done before a READ may write them
            import torch

            torch.cuda.synchronize(buffer.device)
        self._first_tokens[cmd.request_id] = cmd.first
        return list(table.attn_row_ids), list(table.kda_row_ids)

    def reused_tokens(self, request_id: str) -> int:
        """Leading prompt tokens of an import this rank's prefix cache already holds (not to be read)."""
        return self.engine.num_reused_tokens(request_id)

    def start_decode(self, request_id: str) -> list[Event]:
        """Decode from the imported rows. A request aborted after its import and before this command (the
        router's abort and the node's StartDecode race when a client leaves between the legs) has nothing to
        start: its abort already ended it."""
        first = self._first_tokens.pop(request_id, None)
        if first is None:
            return []
        return list(self.engine.start_decode(request_id, int(first.token_id or 0), first.logprob,
                                             first.top_logprobs))

    def abort(self, request_id: str) -> list[Event]:
        self._first_tokens.pop(request_id, None)
        if not self.engine.abort(request_id):
            return []
        return [TokenEvent(request_id=request_id, token_id=None, finish_reason="abort")]

    def release(self, cmd: Release) -> None:
        self.engine.release(cmd.request_id, cmd.generation, reads_done=cmd.reads_done)

    def hold(self, request_id: str) -> None:
        self.engine.hold(request_id)

    def step(self) -> list[Event]:
        self.engine.reclaim()  # quarantines end in lockstep, busy or idle
        if not self.engine.has_work:
            return []
        outputs = self.engine.step()
        events: list[Event] = [*outputs.prompt_logprobs, *outputs.tokens]
        events += [ExportedRows(request_id=res.request_id, attn_row_ids=res.attn_row_ids, kda_row_ids=res.kda_row_ids,
                                num_tokens=res.num_tokens, generation=res.generation,
                                num_cached_tokens=res.num_cached_tokens,
                                first=TokenEvent(request_id=res.request_id, token_id=res.first_token,
                                                 logprob=res.first_logprob, top_logprobs=res.first_top_logprobs,
                                                 finish_reason="length", num_prompt_tokens=res.num_tokens,
                                                 num_cached_tokens=res.num_cached_tokens))
                   for res in outputs.exported]
        return events

    def stats(self) -> RankStats:
        sched = self.engine.scheduler
        total = self.engine.pool.num_usable  # config.num_rows less rows the engine set aside for itself
        model = self.engine.model
        counters: tuple[tuple[str, float], ...] = ()
        if isinstance(model, TPModel):
            counters += (("alltoall_bytes", float(model.alltoall_bytes)),)
        if isinstance(model, DCPModel):
            counters += ((f"dcp_merge_bytes_{model.merge}", float(model.merge_bytes)),
                         ("dcp_merge_fallbacks", float(model.merge_fallbacks)))
        timings: tuple[tuple[str, str, float], ...] = ()
        if model.timings:
            timings, model.timings = tuple(model.timings), []
        cache = None
        if self._rank == 0:  # every rank's cache makes the same decisions: rank 0 speaks for the node
            cache_counters = self.engine.cache.counters
            counters += (("prefix_cache_queried_tokens", float(cache_counters.queried_tokens)),
                         ("prefix_cache_hit_tokens", float(cache_counters.hit_tokens)),
                         ("prefix_cache_evicted_blocks", float(cache_counters.evicted_blocks)),
                         ("kv_transfer_blocks_read", float(cache_counters.blocks_read)),
                         ("kv_transfer_blocks_reused", float(cache_counters.blocks_reused)))
            cache = self._cache_report()
        # rows only the prefix cache holds (evictable on demand) count as free, as vLLM counts its cached blocks
        return RankStats(num_running=sched.num_running, num_waiting=sched.num_waiting,
                         num_rows_used=total - self.engine.pool.num_available - self.engine.num_quarantined_rows,
                         num_rows_total=total,
                         has_work=self.engine.has_work, counters=counters, timings=timings, cache=cache)

    def _cache_report(self) -> Any:
        """The engine's CacheReport when anything it depends on moved since the last one sent, else None."""
        engine = self.engine
        last_session = next(reversed(engine.sessions), None) if engine.sessions else None
        sig = (engine.cache.num_blocks, engine.pool.num_free, tuple(vars(engine.cache.counters).values()),
               len(engine.sessions), last_session, engine.cache.counters.evicted_blocks)
        if sig == self._cache_sig:
            return None
        self._cache_sig = sig
        return engine.cache_report()

    def close(self) -> None:
        self._first_tokens.clear()


def build_backend(config: Any, ctx: Any) -> ReferenceBackend:
    return ReferenceBackend(config, ctx)
