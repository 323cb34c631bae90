"""docs/METRICS.md as data: every metric's name, type, labels (with listed values) and who exports it.

Exposition names follow prometheus_client (and vLLM, which uses it): a counter named `x` or `x_total`
is scraped as `x_total`; a histogram `h` as `h_bucket`, `h_sum`, `h_count`; gauges as themselves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

METRICS_MD = Path(__file__).resolve().parents[2] / "docs" / "METRICS.md"
SCOPES = {"Nodes (": "node", "Nodes, reference engine only": "node_reference", "Router": "router"}


@dataclass(frozen=True)
class LabelSpec:
    name: str
    values: tuple[str, ...] = ()


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # histogram | gauge | counter | info
    labels: tuple[LabelSpec, ...]
    scope: str  # node | node_reference | router

    @property
    def base_name(self) -> str:
        """The name to register with prometheus_client (counters without `_total`)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name

    @property
    def exposed_names(self) -> tuple[str, ...]:
        if self.kind == "histogram":
            return tuple(self.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        if self.kind == "counter":
            return (self.base_name + "_total",)
        return (self.name,)


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [part.strip() for part in parts + [current] if part.strip()]


def _labels(cell: str) -> tuple[LabelSpec, ...]:
    labels = []
    for part in _split_top_level(cell):
        if part == "...":
            continue
        match = re.fullmatch(r"([a-z_]+)\s*(?:\((.*)\))?", part)
        assert match, f"METRICS.md: cannot read label {part!r}"
        values = tuple(v.strip() for v in match.group(2).split(",")) if match.group(2) else ()
        labels.append(LabelSpec(match.group(1), values))
    return tuple(labels)


def load_contract(path: Path = METRICS_MD) -> tuple[MetricSpec, ...]:
    specs, scope = [], None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            scope = next((s for prefix, s in SCOPES.items() if line[3:].startswith(prefix)), None)
            continue
        if scope is None or not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[0])
        kind = "info" if "info" in cells[1] else cells[1].split()[0]
        assert kind in ("histogram", "gauge", "counter", "info"), f"METRICS.md: unknown type in {line!r}"
        specs += [MetricSpec(name, kind, _labels(cells[2]), scope) for name in names]
    assert len(specs) > 30, f"METRICS.md parsed to only {len(specs)} metrics"
    return tuple(specs)


def exposed_index(specs: tuple[MetricSpec, ...]) -> dict[str, MetricSpec]:
    """Every scrapeable series name -> its contract entry."""
    return {exposed: spec for spec in specs for exposed in spec.exposed_names}
