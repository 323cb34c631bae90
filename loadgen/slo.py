"""Service-level objectives from `--slo ttft=MS,tpot=MS,e2e=MS` and the per-request goodput test.

A request is "good" when it completed and meets every SLO given (vllm bench serve's `--goodput` rule):
TTFT <= ttft, TPOT <= tpot (a one-token output counts as TPOT 0, as vllm does), E2E <= e2e.
Values are milliseconds; a trailing "ms" or "s" unit is accepted.
"""

from __future__ import annotations

import math

from pydantic import BaseModel

_ALIASES = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "tpot_ms", "e2e": "e2e_ms", "e2el": "e2e_ms"}


class SLO(BaseModel):
    """Latency objectives in milliseconds; None means no objective on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def is_empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None

    def is_met(self, ttft_s: float, tpot_s: float | None, e2e_s: float) -> bool:
        """Whether a completed request meets every objective (tpot None, i.e. n = 1, counts as 0)."""
        checks = ((self.ttft_ms, ttft_s), (self.tpot_ms, tpot_s or 0.0), (self.e2e_ms, e2e_s))
        return all(limit is None or value * 1000.0 <= limit for limit, value in checks)

    def __str__(self) -> str:
        parts = [f"{k[:-3]}={v:g}ms" for k, v in self.model_dump().items() if v is not None]
        return ",".join(parts) or "none"


def _parse_ms(key: str, raw: str, spec: str) -> float:
    text = raw.strip().lower()
    scale = 1.0
    if text.endswith("ms"):
        text = text[:-2]
    elif text.endswith("s"):
        text, scale = text[:-1], 1000.0
    try:
        value = float(text) * scale
    except ValueError:
        raise ValueError(f"invalid SLO {spec!r}: {key}={raw!r} is not a number of milliseconds") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"invalid SLO {spec!r}: {key}={raw!r} must be a positive number of milliseconds")
    return value


def parse_slo(spec: str | None) -> SLO:
    """Parse "ttft=500,tpot=50"; raises ValueError with a message naming the bad part."""
    if spec is None or not spec.strip():
        return SLO()
    values: dict[str, float] = {}
    for part in spec.split(","):
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        if not sep or not raw.strip():
            raise ValueError(f"invalid SLO {spec!r}: {part.strip()!r} is not KEY=MS (e.g. ttft=500,tpot=50)")
        if key not in _ALIASES:
            raise ValueError(f"invalid SLO {spec!r}: unknown metric {key!r} (use ttft, tpot or e2e)")
        field = _ALIASES[key]
        if field in values:
            raise ValueError(f"invalid SLO {spec!r}: {key} given twice")
        values[field] = _parse_ms(key, raw, spec)
    return SLO(**values)
