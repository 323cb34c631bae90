"""The object each rank process runs: an engine backend plus the rank's KV transport.

`build_worker(config, ctx)` is the executor's factory (node/executor.py). The worker turns executor
commands into backend calls, and owns the transfer side of the rank:
- prefill ranks register their row pool with NIXL once and report the endpoint (served on the side
  channel); every step they drain the readers' notifications into `TransportNotice`s (the node's lease
  table frees rows on DONE);
- decode ranks, on `ImportKV`, allocate rows through the backend (which may reuse the prompt's leading blocks
  from its prefix cache: `reused_tokens`, those are not read), plan the reads with kv_transfer.remap
  (P layout rebuilt from the params and checked against its fingerprint), and post ONE READ per source P
  rank carrying one descriptor per merged row range, with the lease's DONE notification. The READs are then
  polled without blocking at the end of every round (kv_transfer.reads.PendingReads), so decode steps of
  other requests go on while a READ is in flight or stalled.
Import invariant: each rank answers exactly one `ImportOutcome` per `ImportKV` it applied - when its READs are
all DONE, when one fails or the import's deadline (`config.kv.timeout_s`) passes, at once if it cannot post,
or when an `Abort` cancels it - and it has released every READ handle by then. `uncancelled` on the outcome
says NIXL refused to cancel one: the driver then sends `HoldRows` so every rank keeps those rows out for good.
The driver merges the ranks' outcomes and only then lets the request decode.
Backends implement `Backend` (below); `config.backend` names the factory ("reference" = engine/).
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from dataclasses import dataclass
from typing import Any, Protocol

from engine.api import (
    Abort,
    Command,
    Event,
    HoldRows,
    ImportKV,
    ImportOutcome,
    Release,
    StartDecode,
    Submit,
    TransportNotice,
)
from node.protocol import RankStats
from node.runtime import RankInfo, WorkerConfig

REFERENCE_BACKEND = "node.backend:build_backend"


class Backend(Protocol):
    """One rank's engine as the worker sees it."""

    layout: Any
    """engine.layout.RowLayout of this rank's pool."""
    model_config: Any

    def begin_round(self, now: float) -> None:
        """The round's time (the driver's clock, the same on every rank): quarantines are measured in it."""

    def pool_buffer(self) -> Any: ...

    def num_rows(self) -> int: ...

    def submit(self, cmd: Submit) -> list[Event]: ...

    def allocate_import(self, cmd: ImportKV) -> tuple[list[int], list[int]]: ...

    def start_decode(self, request_id: str) -> list[Event]: ...

    def abort(self, request_id: str) -> list[Event]: ...

    def release(self, cmd: Release) -> None: ...

    def hold(self, request_id: str) -> None: ...

    def step(self) -> list[Event]: ...

    def stats(self) -> RankStats: ...

    def close(self) -> None: ...


def _factory(path: str) -> Any:
    module, func = (REFERENCE_BACKEND if path == "reference" else path).split(":")
    return getattr(importlib.import_module(module), func)


def backend_module(path: str) -> Any:
    """The backend's module; it also provides `load_tokenizer(model_config)` for the server process."""
    return importlib.import_module((REFERENCE_BACKEND if path == "reference" else path).split(":")[0])


@dataclass
class _Import:
    """An import in flight on this rank."""

    request_id: str
    reads: Any
    """kv_transfer.reads.PendingReads"""
    started: float


class RankWorker:
    def __init__(self, config: WorkerConfig, ctx: Any, backend: Backend) -> None:
        self.config = config
        self.ctx = ctx
        self.backend = backend
        self.transport = None
        self._imports: dict[str, _Import] = {}
        if config.transport:
            from kv_transfer.nixl_agent import NixlTransport

            side = "p" if config.role == "prefill" else "d"
            self.transport = NixlTransport(f"{config.engine_id}-{side}{ctx.rank}", backend.pool_buffer(),
                                           backend.layout.row_bytes, config.kv)

    def startup_info(self) -> RankInfo:
        layout = self.backend.layout
        endpoint = self.transport.endpoint(self.ctx.rank) if self.transport else None
        return RankInfo(rank=self.ctx.rank, num_rows=self.backend.num_rows(), block_size=layout.block_size,
                        row_bytes=layout.row_bytes, subblock_tokens=layout.subblock_tokens,
                        layout_fingerprint=layout.fingerprint,
                        cache_dtype=f"{layout.latent_format}+{layout.index_key_format}",
                        kda_groups=layout.kda_groups, endpoint=endpoint,
                        tcp_fallback=bool(self.transport and self.transport.tcp_fallback),
                        kernels=getattr(self.backend, "kernels", "reference"))

    def begin_round(self, now: float) -> None:
        self.backend.begin_round(now)

    def apply(self, cmd: Command) -> list[Event]:
        if isinstance(cmd, Submit):
            return self.backend.submit(cmd)
        if isinstance(cmd, ImportKV):
            return self._post_import(cmd)
        if isinstance(cmd, StartDecode):
            return self.backend.start_decode(cmd.request_id)
        if isinstance(cmd, Abort):
            return self._cancel_import(cmd.request_id) + self.backend.abort(cmd.request_id)
        if isinstance(cmd, Release):
            self.backend.release(cmd)
            return []
        if isinstance(cmd, HoldRows):
            self.backend.hold(cmd.request_id)
            return []
        raise ValueError(f"unknown command {type(cmd).__name__}")

    def _error(self, request_id: str, exc: BaseException | str, uncancelled: bool = False) -> ImportOutcome:
        reason = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        return ImportOutcome(request_id=request_id, error=f"rank {self.ctx.rank}: {reason}", uncancelled=uncancelled)

    def _post_import(self, cmd: ImportKV) -> list[Event]:
        """Allocate, plan and post the READs (`cmd.params` were checked by the decode node; `cmd.peer` is the
        prefill node's side-channel InstanceMetadata); the outcome comes from a later `step`."""
        from engine.cache import OutOfRows
        from kv_transfer.importer import post_import

        started = time.perf_counter()
        try:
            if self.transport is None:
                raise ValueError("this node runs without a KV transport")
            attn_rows, kda_rows = self.backend.allocate_import(cmd)
            reused = getattr(self.backend, "reused_tokens", None)
            reads = post_import(self.transport, self.backend.model_config, self.backend.layout, self.ctx.rank,
                                cmd.params, cmd.peer, attn_rows, kda_rows, timeout_s=self.config.kv.timeout_s,
                                skip_tokens=reused(cmd.request_id) if reused is not None else 0)
        except OutOfRows as exc:  # allocate_import raises before allocating: nothing to undo, the node may retry
            return [dataclasses.replace(self._error(cmd.request_id, exc), short_of_rows=True)]
        except Exception as exc:  # noqa: BLE001 - any failure becomes this rank's import error
            return [self._error(cmd.request_id, exc)]
        self._imports[cmd.request_id] = _Import(cmd.request_id, reads, started)
        return []

    def _poll_imports(self) -> list[Event]:
        """One non-blocking poll of every import in flight; the outcomes of those that ended."""
        events: list[Event] = []
        for imp in list(self._imports.values()):
            try:
                if not imp.reads.poll():
                    continue
                results = imp.reads.results()
            except Exception as exc:  # noqa: BLE001 - a failed READ, a deadline, a NIXL error: this import's error
                del self._imports[imp.request_id]
                events.append(self._error(imp.request_id, exc, uncancelled=not imp.reads.close()))
                continue
            del self._imports[imp.request_id]
            clean = imp.reads.close()
            events.append(ImportOutcome(request_id=imp.request_id, num_bytes=sum(r.bytes for r in results),
                                        seconds=time.perf_counter() - imp.started,
                                        num_descriptors=sum(r.descriptors for r in results),
                                        post_s=tuple(r.post_s for r in results), uncancelled=not clean))
        return events

    def _cancel_import(self, request_id: str) -> list[Event]:
        """An abort reached an import in flight: cancel its READs; its one outcome says whether they were."""
        imp = self._imports.pop(request_id, None)
        if imp is None:
            return []
        return [self._error(request_id, "aborted", uncancelled=not imp.reads.close())]

    def step(self) -> list[Event]:
        events = self.backend.step()
        if self._imports:
            events += self._poll_imports()
        if self.transport is not None and self.config.role == "prefill":
            events += [TransportNotice(rank=self.ctx.rank, sender=src, message=msg)
                       for src, msg in self.transport.notifications()]
        return events

    def stats(self) -> RankStats:
        return self.backend.stats()

    def close(self) -> None:
        for imp in self._imports.values():
            imp.reads.close()
        self._imports.clear()
        if self.transport is not None:
            self.transport.close()
        self.backend.close()


def build_worker(config: WorkerConfig, ctx: Any) -> RankWorker:
    """The executor's rank factory."""
    backend = _factory(config.backend)(config, ctx)
    return RankWorker(config, ctx, backend)
