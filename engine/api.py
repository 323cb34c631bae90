"""The engine's torch-free API: what a node hands an engine, and what crosses between a node's driver and its ranks.

- `SamplingParams`: one request's sampling, the one definition (the node builds it from the OpenAI request, the
  engine samples with it); constructing one checks its ranges and raises `SamplingParamsError` naming the field.
- `EngineConfig`: how an engine is built (engine/engine.py).
- The rank protocol: the commands the node's driver sends every rank each round and the events ranks send back
  (node/executor.py, node/worker.py), the rows an import got (`ImportRows`) and a rank's load (`RankStats`).
  Frozen, picklable dataclasses; no behaviour. The per-token events are engine/outputs.py's `TokenEvent` and
  `PromptLogprobs`.
- `RankEngine`: the surface of a rank's engine that applies those commands (engine/engine.py `Engine`, built by
  engine/rank_engine.py `build_rank_engine`); the node's rank worker and rank roles drive nothing else.
Invariant: imports no torch, nor any module that does (tests/test_layering.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from engine.kernels import REQUESTS
from engine.outputs import PromptLogprobs, TokenEvent

DEFAULT_SEED = 31
"""Random-init seed of the weights when none is given."""
MAX_LOGPROBS = 20
"""Most alternatives a request may ask for per position (OpenAI's limit)."""


class SamplingParamsError(ValueError):
    """A sampling parameter out of its range; `field` names it (the HTTP edge answers 400 with that param)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling; temperature 0 is greedy. Valid once constructed (`SamplingParamsError`)."""

    max_tokens: int = 16
    """Tokens to generate (0 only with `prompt_logprobs`: the prompt is scored, nothing generated)."""
    temperature: float = 0.0
    """0 = greedy (argmax, ties to the lower id)."""
    top_p: float = 1.0
    top_k: int = 0
    """Sample among the k most likely tokens only (0: no limit)."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one (0: keep all)."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends once the output text contains one (the text is cut before it). A node
    leaves this empty: its HTTP layer ends the stream on stop strings (node/textgen.py)."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """How many most-likely alternatives to report beside each sampled token's log-prob (None: none asked)."""
    prompt_logprobs: int | None = None
    """Log-probs of the prompt tokens (each under the prefix before it) with this many alternatives (None: none)."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted once from the logit of every token generated so far, in [-2, 2] (0: off)."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per time it was generated so far, in [-2, 2] (0: off)."""
    repetition_penalty: float = 1.0
    """vLLM's: the logit of every token in the prompt or generated so far is divided by it when positive,
    multiplied when not; > 0 (1: off)."""
    num_resumed: int = 0
    """The prompt's last `num_resumed` tokens are this request's own earlier outputs (a stream resumed on another
    instance after its first one failed): the sampler's output step counts from them and the penalties and stop
    strings see them as output, so the resumed request draws exactly the tokens the lost one would have.
    `max_tokens` counts the new tokens only."""

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise SamplingParamsError("max_tokens", "max_tokens must be at least 1 (0 only with echo or "
                                                    f"prompt_logprobs: the prompt is scored), got {self.max_tokens}")
        if self.temperature < 0:
            raise SamplingParamsError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingParamsError("top_k", f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise SamplingParamsError(name, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise SamplingParamsError(name, f"{name} must be in [-2, 2], got {value}")
        if self.num_resumed < 0:
            raise SamplingParamsError("num_resumed", f"num_resumed must be >= 0, got {self.num_resumed}")
        if not self.repetition_penalty > 0:
            raise SamplingParamsError("repetition_penalty", f"repetition_penalty must be > 0, got "
                                                            f"{self.repetition_penalty}")


@dataclass(frozen=True)
class EngineConfig:
    """How an engine is built. A node's settings hold one as their `engine` section (node/settings.py) and its
    ranks get it whole, completed with what the node decides (node/runtime.py `worker_config`); valid once
    constructed."""

    model: str = "kimi-k3.1-mini"
    """Preset name (engine.model.config.PRESETS), ModelConfig .json file, or checkpoint directory
    (engine.model.config.resolve_model)."""
    exact_index_scores: bool = False
    """Score the DSA indexer exactly (fp32 index keys, no FP8 rounding: index_key_dtype fp32), so selections equal
    an unquantised implementation's; off: FP8 index keys as the model config says."""
    seed: int = DEFAULT_SEED
    """Random-init seed of the weights (every process with the same seed has the same weights)."""
    weights: str | None = None
    """Optional safetensors file loaded over the random init."""
    num_rows: int = 256
    """Rows in the pool (each layout.row_bytes bytes)."""
    max_batch: int = 64
    """Most requests in one decode step."""
    tp_size: int = 1
    """TP size the pool layout is planned for (KDA heads per rank)."""
    dcp_size: int = 1
    """DCP size the pool layout is planned for (tokens per row = block_size / dcp_size)."""
    subblock_tokens: int = 64
    block_size: int | None = None
    """Force a larger power-of-two block size (None: the smallest legal one)."""
    quarantine_s: float = 30.0
    """How long rows stay out of the pool after an export or import is given up (lease expired, aborted): a
    remote READ posted before may still target them until the reader's transfer timeout."""
    device: str = "cpu"
    """Where the weights (when the engine builds them), the row pool and every intermediate live: "cpu" or
    "cuda[:N]". A passed-in `model` must already be on this device."""
    prefix_cache: bool = True
    """Keep finished blocks and reuse the longest cached prefix of a prompt (engine/prefix_cache.py)."""
    max_step_tokens: int | None = None
    """Chunked prefill: tokens one step computes, running decodes first, then a chunk of the prompt being
    prefilled (at least scheduler.MIN_CHUNK). None: every prompt prefills in one step."""
    decode_first_tokens: int | None = None
    """Decode priority: while every running request is at most this many tokens from its max_tokens, a prompt
    waiting to prefill here lets them finish first (one step each, for at most this many steps in all per prompt),
    so their last tokens come at decode-step pace instead of each sharing a step with a prefill chunk; a batch with
    a longer answer to go shares every step with a chunk, as without it. None: a chunk joins every step."""
    kernels: str | None = "auto"
    """Kernel set asked for: "reference" (engine/model/), "fast" (engine/fast/) or "auto" (None: auto);
    engine/kernels.py `resolve` decides (what each set runs per parallelism and phase, where auto picks fast, and
    the refusals naming their reason: an explicit "fast" never falls back)."""

    def __post_init__(self) -> None:
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be positive, got {self.max_step_tokens}")
        if self.decode_first_tokens is not None and self.decode_first_tokens < 0:
            raise ValueError(f"decode_first_tokens must be >= 0, got {self.decode_first_tokens}")
        if self.num_rows < 1 or self.max_batch < 1:
            raise ValueError(f"num_rows and max_batch must be positive, got {self.num_rows}, {self.max_batch}")
        if self.kernels is not None and self.kernels not in REQUESTS:
            raise ValueError(f"kernels must be one of {', '.join(REQUESTS)} (or None: auto), got {self.kernels!r}")


# ---------------------------------------------------------------------- commands (driver -> ranks)


@dataclass(frozen=True)
class Submit:
    """Prefill and decode locally; with `export`, prefill only and keep the rows for a remote reader."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    export: bool = False
    session: str = ""
    """Opaque session key (x-pdcluster-session); the node reports per session what its prefix cache holds."""
    cache_salt: str = ""
    """The prefix cache's salt for this request (the node's hex digest of its tenant and `cache_salt`; "" for
    none): cached blocks are shared only between requests with the same salt (engine/prefix_cache.py)."""


@dataclass(frozen=True)
class ImportKV:
    """Allocate rows for the prompt and post the READs from the prefill node (`params`: KVTransferParams, already
    checked by the decode node; `peer`: the prefill node's side-channel metadata). Every rank answers exactly one
    `ImportOutcome` per ImportKV, in a later round's step when its reads are done, failed or past their deadline
    (or at once when it cannot post, or on `Abort`); the rows wait for `StartDecode`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    first: TokenEvent
    """The token the prefill node sampled (id, log-prob, alternatives), the first one this request streams."""
    params: Any
    peer: Any
    session: str = ""
    """Opaque session key, as in `Submit`."""
    notify_key: bytes = b""
    """The lease's notification key (kv_transfer/signing.py `lease_key`): the ranks sign their DONE notifications
    with it, so they need no cluster secret; empty on an insecure node."""
    cache_salt: str = ""
    """The prefix cache's salt, as in `Submit`: the blocks this import reuses are those of the same salt."""


@dataclass(frozen=True)
class StartDecode:
    """Every rank imported its share: decode from the imported rows, starting after `ImportKV.first`."""

    request_id: str


@dataclass(frozen=True)
class Abort:
    """Drop a request wherever it is (queued, running, exported or imported) and free its rows. An exported or
    importing request's rows are quarantined for the read timeout (a READ posted before may still target them)
    unless `reads_done`: no READ can (a prefill node's export that no reader claimed: its exporter knows), so
    they are free at once."""

    request_id: str
    reads_done: bool = False


@dataclass(frozen=True)
class HandOffAbort:
    """What a hand-off owner's `abort` found (node/runtime.py `HandOff`; the ranks' `Abort` carries `reads_done`)."""

    ended: bool
    """Something the hand-off kept for the request ended (a lease)."""
    reads_done: bool
    """No READ can target the request's rows from now on: the ranks' `Abort` frees them at once, not into
    quarantine (engine/api.py `Abort`)."""


@dataclass(frozen=True)
class Release:
    """End export `generation` of `request_id` (its lease ended). Never by row ids: a release that names an
    export no longer live frees nothing. `reads_done`: every READ finished, the rows are free at once; else
    (lease expired or aborted) they stay quarantined for the read timeout."""

    request_id: str
    generation: int
    reads_done: bool = False


@dataclass(frozen=True)
class HoldRows:
    """A READ into this request's rows could not be cancelled on some rank: keep them out of the pool for good
    on every rank (the driver sends it, so all ranks agree)."""

    request_id: str


@dataclass(frozen=True)
class MoveOut:
    """Hand a running request to another decode instance (a planned move: a drain): its next decode step writes the
    KV of its last token as usual, but the token it samples is not emitted: the request is exported instead
    (`ExportedRows`: prompt + outputs so far, that token as the first one the next instance streams) and its rows
    wait for a reader, as a prefill node's export does. A request not decoding yet (queued, prefilling, importing)
    moves at its first decode step; one that ends first (or is unknown) is left as it is."""

    request_id: str


Command = Submit | ImportKV | StartDecode | Abort | Release | HoldRows | MoveOut


@dataclass(frozen=True)
class ImportRows:
    """The rows an `ImportKV` got on one rank (`RankEngine.import_kv`): a transport writes the attention rows past
    the first `num_reused_tokens` prompt tokens (those blocks came from this rank's prefix cache) and every KDA row."""

    attn_row_ids: tuple[int, ...]
    kda_row_ids: tuple[int, ...]
    num_reused_tokens: int = 0


# ---------------------------------------------------------------------- events (ranks -> driver)


@dataclass(frozen=True)
class ExportedRows:
    """A prefill-for-export finished: the rows stay allocated until `Release`."""

    request_id: str
    attn_row_ids: tuple[int, ...]
    kda_row_ids: tuple[int, ...]
    num_tokens: int
    first: TokenEvent
    """The sampled first token (id, log-prob, alternatives)."""
    num_cached_tokens: int = 0
    generation: int = 0
    """Names this export in `Release` (the engine's per-export counter)."""
    is_final: bool = True


@dataclass(frozen=True)
class ImportOutcome:
    """A rank's (and after merging, the node's) result of an `ImportKV`."""

    request_id: str
    error: str | None = None
    num_bytes: int = 0
    seconds: float = 0.0
    num_descriptors: int = 0
    post_s: tuple[float, ...] = ()
    """Posting time of each READ (one per source rank per destination rank)."""
    uncancelled: bool = False
    """A READ of this import could not be cancelled (its rows must never be reused; the driver sends HoldRows)."""
    short_of_rows: bool = False
    """The rank had too few free rows: it allocated and posted nothing (merged: every rank said so), so the node
    may queue the import and send it again (decode_node/admission.py)."""

    @property
    def is_final(self) -> bool:
        return self.error is not None


@dataclass(frozen=True)
class EngineFailure:
    """The request cannot continue (bad input found by the engine, or a rank died), or it continues elsewhere."""

    request_id: str
    error: str
    status: int = 500
    is_final: bool = True
    kv_transfer_params: dict | None = None
    """A stream moved out on drain (decode_node/moves.py): the signed params another decode instance continues it
    with, sent to the router in the stream's last (error) event."""


@dataclass(frozen=True)
class TransportNotice:
    """A transport notification a rank received (lease DONE / ABORT message from a reader)."""

    rank: int
    sender: str
    message: bytes
    request_id: str = ""
    is_final: bool = False


@dataclass(frozen=True)
class RowsExposed:
    """A prefill rank registered one export's rows with its transport, and only those (per-lease exposure):
    `metadata` is what a reader needs to address them (the transport's partial metadata of those regions), handed
    to the decode node that claims the lease; `error` says why the rank could not expose them."""

    request_id: str
    generation: int
    rank: int
    metadata: bytes = b""
    error: str | None = None
    is_final: bool = False


Event = TokenEvent | PromptLogprobs | ExportedRows | ImportOutcome | EngineFailure | TransportNotice | RowsExposed


@dataclass(frozen=True)
class RankStats:
    """One rank's load after a round."""

    num_running: int = 0
    num_waiting: int = 0
    num_rows_used: int = 0
    num_rows_total: int = 0
    has_work: bool = False
    counters: tuple[tuple[str, float], ...] = ()
    """Cumulative counters (name, total) since the rank started."""
    timings: tuple[tuple[str, str, float], ...] = ()
    """Durations measured since the last round (name, label, seconds), e.g. ("prefill", "token", 1.2)."""
    cache: Any = None
    """Rank 0's prefix-cache report (engine.engine.CacheReport) when it changed since the last round, else None."""


# ---------------------------------------------------------------------- the rank's engine


class RankEngine(Protocol):
    """What a node's rank worker (node/worker.py) and its rank role drive: one rank's engine, every rank of a node
    applying the same commands in the same order (engine/engine.py `Engine`; the node tests' toy engine)."""

    config: EngineConfig
    """What the engine was built from (`num_rows`: the pool's rows)."""
    layout: Any
    """engine.layout.RowLayout of the rank's pool."""
    model_config: Any
    """engine.model.config.ModelConfig of the served model."""
    kernels: str
    """The kernel set the engine runs ("reference" | "fast")."""
    pool: Any
    """The row pool; `pool.buffer` is the one contiguous tensor a transport registers."""

    def apply(self, cmd: Command) -> list[Event]:
        """A command's events (`ImportKV` excepted: `import_kv`); ValueError naming bad input."""

    def import_kv(self, cmd: ImportKV) -> ImportRows:
        """Rows for an import, kept (with `cmd.first`) until `StartDecode`; engine.cache.OutOfRows, allocating
        nothing, when the pool is short of rows."""

    def step_events(self) -> list[Event]:
        """Free the quarantines whose time is up, then one step when there is work; its events."""

    def rank_stats(self, report_cache: bool = False) -> RankStats:
        """The rank's load; `report_cache`: also the prefix cache's counters and report (one rank speaks for all)."""
