"""The reference engine (engine/) as a rank backend of the node worker (serving/engine_worker.py).

Wraps `engine.engine.Engine`: queued prefill/decode with continuous batching (`add_request` + `step`),
prefill-for-export (`add_request(export=True)`, rows kept until `release`), import (`allocate_for_import`,
external writes into `engine.pool.buffer`, then `start_decode` with the prefill node's first token). With W ranks
the model is SPMD over the rank group: `TPModel` (heads split) or, on a DCP pool, `DCPModel` (cache split by token).
Also `load_tokenizer`, the server-side tokenizer matching the engine's (byte-level, BOS first, chat template).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engine.executor import Event, ExportedRows, ImportKV, RankStats, SamplingSpec, Submit, TokenEvent


@dataclass
class ServerTokenizer:
    """The engine's ByteTokenizer with what the OpenAI layer needs (vocab size, chat template)."""

    inner: Any
    vocab_size: int

    @property
    def eos_token_id(self) -> int:
        return self.inner.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids: Any) -> str:
        return self.inner.decode(list(ids))

    def encode_chat(self, messages: list[Any]) -> list[int]:
        from engine.model.tokenizer import ChatMessage

        return self.inner.apply_chat_template([ChatMessage(m.role, m.text()) for m in messages])


def load_tokenizer(model_config: Any) -> ServerTokenizer:
    from engine.model.tokenizer import ByteTokenizer

    return ServerTokenizer(ByteTokenizer(), model_config.vocab_size)


def _sampling(spec: SamplingSpec) -> Any:
    from engine.sampling import SamplingParams

    return SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p, seed=spec.seed,
                          stop_token_ids=tuple(spec.stop_token_ids), ignore_eos=spec.ignore_eos).validate()


class TimedModel:
    """The plain single-rank model with its prefill steps timed (mode `single`); the base of the SPMD wrappers,
    which time theirs by sharding mode. `timings` holds the steps since the last `stats()`."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.timings: list[tuple[str, str, float]] = []

    def prefill(self, token_ids: Any, cache: Any, start: int = 0, all_logits: bool = False) -> Any:
        started = time.perf_counter()
        logits = self.model.prefill(token_ids, cache, start, all_logits)
        self.timings.append(("prefill", "single", time.perf_counter() - started))
        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class TPModel(TimedModel):
    """A full model replica whose prefill and decode run SPMD over the rank group (engine/parallel):
    prefill token-sharded (steps of at least `token_threshold` tokens) or head-sharded, decode with KDA
    heads split and the attention heads split (TP). Logits are identical on every rank, so every rank's
    scheduler samples the same tokens. The pool's KDA rows hold this rank's heads (layout tp_size = W)."""

    def __init__(self, model: Any, ctx: Any, token_threshold: int) -> None:
        super().__init__(model)
        self.ctx, self.token_threshold = ctx, token_threshold
        self.cfg = model.cfg
        self.alltoall_bytes = 0

    def prefill(self, token_ids: Any, cache: Any, start: int = 0, all_logits: bool = False) -> Any:
        from engine.parallel.prefill import PrefillBatch, choose_mode, parallel_prefill

        if all_logits:
            raise ValueError("the TP prefill returns last-token logits only")
        batch = PrefillBatch((token_ids,), (start,))
        mode = choose_mode(batch, self.token_threshold)
        started = time.perf_counter()
        result = parallel_prefill(self.ctx, self.model, batch, [cache], mode)
        self.timings.append(("prefill", f"{mode}_sharded", time.perf_counter() - started))
        self.alltoall_bytes += result.stats.exchange_bytes
        return result.logits

    def decode(self, token_ids: Any, positions: list[int], caches: list[Any]) -> Any:
        from engine.parallel.dcp_decode import parallel_decode

        return parallel_decode(self.ctx, self.model, token_ids, positions, caches, mode="tp").logits


class DCPModel(TPModel):
    """A full model replica whose decode splits the cache by token over the rank group (DCP = W): each rank
    keeps its owned tokens (`engine.cache.DCPRowCache`, whose ownership rule comes from the pool layout's
    `dcp_interleave` and is the one the decode step uses),
    scores them, takes part in the exact compact top-k merge and the LSE merge (engine/parallel/dcp_decode.py).
    KDA heads are split as under TP. A local prefill (colocated requests, the `recompute` load-failure policy)
    runs the SPMD prefill into a temporary whole-sequence cache of the request, then keeps this rank's share."""

    def __init__(self, model: Any, ctx: Any, token_threshold: int, merge: str = "compact") -> None:
        super().__init__(model, ctx, token_threshold)
        self.merge = merge
        self.merge_bytes = 0
        self.merge_fallbacks = 0

    def prefill(self, token_ids: Any, cache: Any, start: int = 0, all_logits: bool = False) -> Any:
        from engine.parallel.kda_shard import rank_cache

        if start:
            raise ValueError("a DCP rank prefills whole prompts only (start = 0)")
        whole = rank_cache(self.cfg, int(token_ids.shape[0]), self.ctx.world_size, self.ctx.rank)
        logits = super().prefill(token_ids, whole, 0, all_logits)
        for i in range(self.cfg.num_mla_layers):
            rows = whole.read_attention(i, int(token_ids.shape[0]))
            cache.write_attention(i, 0, rows.latent, rows.index_key, rows.index_scale)
        for i in range(self.cfg.num_kda_layers):
            cache.write_kda(i, whole.read_kda(i))
        return logits

    def decode(self, token_ids: Any, positions: list[int], caches: list[Any]) -> Any:
        from engine.parallel.dcp_decode import parallel_decode

        result = parallel_decode(self.ctx, self.model, token_ids, positions, caches, mode="dcp",
                                 layout=caches[0].layout, merge=self.merge)
        self.merge_bytes += result.stats.merge_bytes
        self.merge_fallbacks += result.stats.merge_fallback_rows
        return result.logits

    def make_cache(self, pool: Any, table: Any) -> Any:
        from engine.cache import DCPRowCache

        return DCPRowCache(pool, table, self.ctx.rank)


class ReferenceBackend:
    """One rank's Engine; its model is `TimedModel` on one rank, else SPMD over the rank group: `TPModel`, or
    `DCPModel` on a DCP pool (whose cache views are `DCPRowCache`s)."""

    def __init__(self, config: Any, ctx: Any) -> None:
        from engine.engine import Engine, EngineConfig
        from engine.model.config import get_preset
        from engine.model.weights import DEFAULT_SEED, build_model

        if config.dcp_size > 1 and config.dcp_size != ctx.world_size:
            raise ValueError(f"a DCP pool runs one rank per DCP rank: dcp_size {config.dcp_size}, "
                             f"{ctx.world_size} ranks")
        seed = DEFAULT_SEED if config.seed is None else config.seed
        engine_config = EngineConfig(model=config.model, seed=seed, num_rows=config.num_rows,
                                     max_batch=config.max_num_seqs, tp_size=config.tp_size,
                                     dcp_size=config.dcp_size, block_size=config.block_size)
        make_cache = None
        built = build_model(get_preset(config.model), seed)
        if config.dcp_size > 1:
            model = DCPModel(built, ctx, config.token_shard_min_tokens)
            make_cache = model.make_cache
        elif ctx.world_size > 1:
            model = TPModel(built, ctx, config.token_shard_min_tokens)
        else:
            model = TimedModel(built)
        self.engine = Engine(engine_config, model=model, make_cache=make_cache)
        self.layout = self.engine.layout
        self.model_config = self.engine.model_config
        self._first_tokens: dict[str, int] = {}

    def pool_buffer(self) -> Any:
        return self.engine.pool.buffer

    def num_rows(self) -> int:
        return self.engine.config.num_rows

    def submit(self, cmd: Submit) -> list[Event]:
        self.engine.add_request(cmd.request_id, list(cmd.prompt_token_ids), _sampling(cmd.sampling), export=cmd.export)
        return []

    def allocate_import(self, cmd: ImportKV) -> tuple[list[int], list[int]]:
        table = self.engine.allocate_for_import(cmd.request_id, list(cmd.prompt_token_ids), _sampling(cmd.sampling))
        self._first_tokens[cmd.request_id] = cmd.first_token
        return list(table.attn_row_ids), list(table.kda_row_ids)

    def start_decode(self, request_id: str) -> list[Event]:
        """Decode from the imported rows. A request aborted after its import and before this command (the
        router's abort and the node's StartDecode race when a client leaves between the legs) has nothing to
        start: its abort already ended it."""
        first = self._first_tokens.pop(request_id, None)
        if first is None:
            return []
        return [self._token(out) for out in self.engine.start_decode(request_id, first)]

    def abort(self, request_id: str) -> list[Event]:
        self._first_tokens.pop(request_id, None)
        if not self.engine.abort(request_id):
            return []
        return [TokenEvent(request_id=request_id, token_id=None, finish_reason="abort")]

    def release_rows(self, row_ids: tuple[int, ...], request_id: str) -> None:
        if request_id:
            self.engine.release(request_id)
        if row_ids:
            self.engine.release_rows(row_ids)

    @staticmethod
    def _token(out: Any) -> TokenEvent:
        return TokenEvent(request_id=out.request_id, token_id=out.token_id, finish_reason=out.finish_reason,
                          num_prompt_tokens=out.num_prompt_tokens)

    def step(self) -> list[Event]:
        if not self.engine.has_work:
            return []
        outputs = self.engine.step()
        events: list[Event] = [self._token(out) for out in outputs.tokens]
        events += [ExportedRows(request_id=res.request_id, attn_row_ids=res.attn_row_ids, kda_row_ids=res.kda_row_ids,
                                num_tokens=res.num_tokens, first_token=res.first_token) for res in outputs.exported]
        return events

    def stats(self) -> RankStats:
        sched = self.engine.scheduler
        total = self.engine.config.num_rows
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
        return RankStats(num_running=sched.num_running, num_waiting=sched.num_waiting,
                         num_rows_used=total - self.engine.num_free_rows, num_rows_total=total,
                         has_work=self.engine.has_work, counters=counters, timings=timings)

    def close(self) -> None:
        self._first_tokens.clear()


def build_backend(config: Any, ctx: Any) -> ReferenceBackend:
    return ReferenceBackend(config, ctx)
