"""A concurrency sweep: preflight the endpoint, run each level, write summary.json after every level, and
report.md + PNGs at the end (also after an interrupt or a failed preflight, with what was measured)."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx

from loadgen.client import Target
from loadgen.metrics import summarize_level
from loadgen.progress import Progress
from loadgen.records import RequestRecord
from loadgen.report import write_report
from loadgen.runner import run_level
from loadgen.schedule import Workload, schedule_hash
from loadgen.slo import SLO
from loadgen.summary import RunInfo, Summary, write_summary


@dataclass
class SweepOptions:
    target: Target
    concurrency_levels: list[int]
    duration_s: float
    out_dir: Path
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    gpus: int | None = None
    gpu_split: tuple[int, int] | None = None
    drain_s: float = 60.0
    max_requests: int | None = None
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    schedule_units: int = 64
    plots: bool = True
    progress: Progress = field(default_factory=lambda: Progress(enabled=False))
    command: list[str] = field(default_factory=list)


class PreflightError(Exception):
    """The endpoint cannot be used at all (unreachable, or no model name obtainable)."""


async def resolve_model(client: httpx.AsyncClient, target: Target) -> str:
    """Check the endpoint answers; return the model to use (asks /v1/models when none was given)."""
    url = target.base_url.rstrip("/") + "/v1/models"
    try:
        resp = await client.get(url, headers=target.headers_base())
    except httpx.ConnectError as exc:
        raise PreflightError(f"cannot reach {target.base_url}: {exc or 'connection refused'}") from None
    except httpx.TimeoutException:
        raise PreflightError(f"cannot reach {target.base_url}: timed out connecting") from None
    except httpx.HTTPError as exc:
        raise PreflightError(f"cannot reach {target.base_url}: {type(exc).__name__}: {exc}") from None
    if target.model:
        return target.model
    try:
        models = resp.json().get("data", []) if resp.status_code == 200 else []
        return str(models[0]["id"])
    except (ValueError, AttributeError, IndexError, KeyError, TypeError):
        raise PreflightError(f"--model not given and GET {url} gave no model id (HTTP {resp.status_code}); "
                             "pass --model") from None


def new_summary(workload: Workload, opts: SweepOptions, scenario: str) -> Summary:
    run = RunInfo(url=opts.target.base_url, endpoint=opts.target.endpoint, model=opts.target.model or "?",
                  scenario=scenario, seed=opts.seed, concurrency_levels=opts.concurrency_levels,
                  duration_s=opts.duration_s, gpus=opts.gpus, slo=opts.slo,
                  schedule_hash=schedule_hash(workload, opts.schedule_units), schedule_units=opts.schedule_units,
                  workload=workload.describe(), started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  command=opts.command)
    return Summary(run=run)


def finish(summary: Summary, opts: SweepOptions) -> None:
    """Write summary.json, the plots and report.md from whatever the summary holds."""
    summary.refresh()
    if opts.plots and summary.levels:
        try:
            from loadgen.plots import write_plots
        except ImportError:
            summary.plots = []
            print("loadgen: matplotlib is not installed (pip install 'pdcluster[plot]'); no PNG plots",
                  file=sys.stderr)
        else:
            summary.plots = write_plots(summary, opts.out_dir)
    write_summary(summary, opts.out_dir)
    write_report(summary, opts.out_dir)


async def _levels(client: httpx.AsyncClient, workload: Workload, opts: SweepOptions, summary: Summary) -> None:
    for conc in opts.concurrency_levels:
        records: list[RequestRecord] = []
        started_unix, t0 = time.time(), time.perf_counter()
        try:
            result = await run_level(client, opts.target, workload, conc, opts.duration_s, opts.drain_s,
                                     opts.max_requests, opts.progress, records)
        except asyncio.CancelledError:
            summary.levels.append(summarize_level(conc, records, time.perf_counter() - t0, opts.slo, opts.gpus,
                                                  started_unix, opts.gpu_split))
            summary.aborted = f"interrupted during concurrency {conc}; that level is partial"
            raise
        summary.levels.append(summarize_level(conc, result.records, result.duration_s, opts.slo, opts.gpus,
                                              result.started_unix, opts.gpu_split))
        summary.refresh()
        write_summary(summary, opts.out_dir)


async def run_sweep(workload: Workload, opts: SweepOptions, scenario: str, input_errors: list[str]) -> Summary:
    """Run every level; always leaves summary.json and report.md in opts.out_dir."""
    timeout = httpx.Timeout(opts.request_timeout_s, connect=opts.connect_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        try:
            opts.target.model = await resolve_model(client, opts.target)
        except PreflightError as exc:
            summary = new_summary(workload, opts, scenario)
            summary.input_errors, summary.aborted = input_errors, str(exc)
            finish(summary, opts)
            raise
        summary = new_summary(workload, opts, scenario)
        summary.input_errors = input_errors
        try:
            await _levels(client, workload, opts, summary)
        finally:
            finish(summary, opts)
    return summary
