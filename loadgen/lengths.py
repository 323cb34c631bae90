"""Seeded length and delay distributions, parsed from short specs.

Spec grammar (one string per knob, so CLI flags and env settings stay flat):
    "512"                  constant
    "uniform:LO,HI"        uniform on [LO, HI]
    "normal:MEAN,STD"      normal, clipped at the knob's minimum
    "lognormal:MEDIAN,SIGMA"  log-normal with the given median and log-space sigma
    "exp:MEAN"             exponential with the given mean

Sampling uses only the `random.Random` passed in, so a seeded generator gives the same values everywhere.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

KINDS = ("const", "uniform", "normal", "lognormal", "exp")
_ARITY = {"const": 1, "uniform": 2, "normal": 2, "lognormal": 2, "exp": 1}


@dataclass(frozen=True)
class Dist:
    """A parsed distribution: `kind` in KINDS and its parameters (see the module docstring)."""

    kind: str
    params: tuple[float, ...]

    def sample(self, rng: random.Random) -> float:
        a = self.params[0]
        if self.kind == "const":
            return a
        if self.kind == "uniform":
            return rng.uniform(a, self.params[1])
        if self.kind == "normal":
            return rng.gauss(a, self.params[1])
        if self.kind == "lognormal":
            return math.exp(rng.gauss(math.log(a), self.params[1]))
        return rng.expovariate(1.0 / a) if a > 0 else 0.0

    def sample_int(self, rng: random.Random, minimum: int = 1) -> int:
        """A sample rounded to an integer, at least `minimum` (token counts, turn counts)."""
        return max(minimum, int(round(self.sample(rng))))

    def sample_float(self, rng: random.Random, minimum: float = 0.0, cap: float | None = None) -> float:
        """A sample clipped to [minimum, cap] (delays in seconds)."""
        value = max(minimum, self.sample(rng))
        return value if cap is None else min(cap, value)

    def __str__(self) -> str:
        args = ",".join(f"{p:g}" for p in self.params)
        return args if self.kind == "const" else f"{self.kind}:{args}"


def parse_dist(spec: str, name: str = "distribution") -> Dist:
    """Parse a spec string; raises ValueError naming the knob and the bad value."""
    text = str(spec).strip()
    kind, _, args = text.partition(":") if ":" in text else ("const", "", text)
    kind = kind.strip().lower()
    if kind not in _ARITY:
        raise ValueError(f"{name}: unknown distribution {kind!r} in {spec!r} (use one of {', '.join(KINDS)})")
    parts = [p.strip() for p in args.split(",") if p.strip()]
    if len(parts) != _ARITY[kind]:
        raise ValueError(f"{name}: {kind} needs {_ARITY[kind]} number(s), got {spec!r}")
    try:
        params = tuple(float(p) for p in parts)
    except ValueError:
        raise ValueError(f"{name}: {spec!r} has a value that is not a number") from None
    if any(not math.isfinite(p) or p < 0 for p in params):
        raise ValueError(f"{name}: values must be finite and >= 0, got {spec!r}")
    if kind == "uniform" and params[0] > params[1]:
        raise ValueError(f"{name}: uniform needs LO <= HI, got {spec!r}")
    if kind == "lognormal" and params[0] <= 0:
        raise ValueError(f"{name}: lognormal median must be > 0, got {spec!r}")
    return Dist(kind, params)
