"""summary.json: the run's settings, one LevelSummary per concurrency level (with raw records), the Pareto
points and anything that went wrong. Written after every level so an interrupted sweep keeps its results."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from loadgen.metrics import LevelSummary, ParetoPoint, pareto_points
from loadgen.slo import SLO

SUMMARY_VERSION = 1


class RunInfo(BaseModel):
    url: str
    endpoint: str
    model: str
    scenario: str
    seed: int
    concurrency_levels: list[int]
    duration_s: float
    gpus: int | None = None
    slo: SLO = Field(default_factory=SLO)
    schedule_hash: str
    schedule_units: int
    workload: dict[str, str] = Field(default_factory=dict)
    started_at: str
    command: list[str] = Field(default_factory=list)


class Summary(BaseModel):
    version: int = SUMMARY_VERSION
    run: RunInfo
    levels: list[LevelSummary] = Field(default_factory=list)
    pareto: list[ParetoPoint] = Field(default_factory=list)
    input_errors: list[str] = Field(default_factory=list)
    aborted: str | None = None
    plots: list[str] = Field(default_factory=list)

    def refresh(self) -> None:
        self.pareto = pareto_points(self.levels)


def write_summary(summary: Summary, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(summary.model_dump_json(indent=1))
    tmp.replace(path)
    return path


def load_summary(path: Path) -> Summary:
    """Parse a summary.json; ValueError with the path if it is not one."""
    try:
        return Summary.model_validate_json(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not a loadgen summary.json: {str(exc).splitlines()[0]}") from None
