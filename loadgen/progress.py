"""A one-line live progress bar on stderr, drawn only when stderr is a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from loadgen.records import RequestRecord


class Progress:
    """Redraws at most every `interval_s`; `enabled=None` means "only on a TTY"."""

    def __init__(self, enabled: bool | None = None, stream: TextIO | None = None, interval_s: float = 0.5) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.interval_s = interval_s
        self._last = 0.0

    def update(self, concurrency: int, elapsed_s: float, duration_s: float, records: list[RequestRecord],
               in_flight: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < self.interval_s):
            return
        self._last = now
        frac = min(1.0, elapsed_s / duration_s) if duration_s > 0 else 1.0
        filled = int(frac * 24)
        ok = sum(1 for r in records if r.outcome == "ok")
        bad = len(records) - ok
        tokens = sum(r.output_tokens for r in records if r.outcome == "ok")
        rate = tokens / elapsed_s if elapsed_s > 0 else 0.0
        line = (f"\rc={concurrency:<4} [{'#' * filled}{'.' * (24 - filled)}] {elapsed_s:6.1f}/{duration_s:.0f}s "
                f"ok {ok} err/cancel {bad} in-flight {in_flight} out {rate:8.1f} tok/s")
        self.stream.write(line)
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
