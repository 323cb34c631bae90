"""The rank protocol: the commands the node's driver sends every rank each round, the events ranks send back,
and the round's plan and reply. Frozen, picklable dataclasses; no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.outputs import PromptLogprobs, TokenEvent

# ---------------------------------------------------------------------- commands (driver -> ranks)


@dataclass(frozen=True)
class SamplingSpec:
    """Per-request sampling: temperature 0 is greedy."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """Alternatives to report beside each sampled token's log-prob (None: no log-probs asked)."""
    prompt_logprobs: int | None = None
    """Prompt-token log-probs with this many alternatives (None: none asked)."""


@dataclass(frozen=True)
class Submit:
    """Prefill and decode locally; with `export`, prefill only and keep the rows for a remote reader."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    export: bool = False
    session: str = ""
    """Opaque session key (x-pdcluster-session); the node reports per session what its prefix cache holds."""


@dataclass(frozen=True)
class ImportKV:
    """Allocate rows for the prompt and post the READs from the prefill node (`params`: KVTransferParams, already
    checked by the decode node; `peer`: the prefill node's side-channel metadata). Every rank answers exactly one
    `ImportOutcome` per ImportKV, in a later round's step when its reads are done, failed or past their deadline
    (or at once when it cannot post, or on `Abort`); the rows wait for `StartDecode`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    first: TokenEvent
    """The token the prefill node sampled (id, log-prob, alternatives), the first one this request streams."""
    params: Any
    peer: Any
    session: str = ""
    """Opaque session key, as in `Submit`."""


@dataclass(frozen=True)
class StartDecode:
    """Every rank imported its share: decode from the imported rows, starting after `ImportKV.first`."""

    request_id: str


@dataclass(frozen=True)
class Abort:
    """Drop a request wherever it is (queued, running, exported or imported) and free its rows."""

    request_id: str


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


Command = Submit | ImportKV | StartDecode | Abort | Release | HoldRows


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
    """The request cannot continue (bad input found by the engine, or a rank died)."""

    request_id: str
    error: str
    status: int = 500
    is_final: bool = True


@dataclass(frozen=True)
class TransportNotice:
    """A transport notification a rank received (lease DONE / ABORT message from a reader)."""

    rank: int
    sender: str
    message: bytes
    request_id: str = ""
    is_final: bool = False


Event = TokenEvent | PromptLogprobs | ExportedRows | ImportOutcome | EngineFailure | TransportNotice


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


@dataclass(frozen=True)
class StepPlan:
    round_id: int
    commands: tuple[Command, ...]
    run_step: bool = True
    now: float = 0.0
    """The driver's clock (time.monotonic) for this round: ranks measure quarantines in it, so they agree."""


@dataclass(frozen=True)
class StepReply:
    rank: int
    events: list[Event]
    stats: RankStats
