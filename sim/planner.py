"""`pdcluster plan --workload FILE --slo ... --gpus N --gpu gb300`: search cluster shapes by simulating each.

Candidates (`candidates`): prefill instances of TP4 or TP8 (their GPU share from 1/8 to 1/2 of the GPUs), the
rest decode instances of 8 GPUs split between a TP8 pool (sessions up to `tp_context` tokens) and 0-2 DCP8
instances; then, for the best shapes, the chunked-prefill budget, the block size (smallest legal, or twice it)
and the KV latent dtype (FP8 or NVFP4: the capacity planner's rows per GPU, and a decode step's per-context cost
scaled by the bytes a token's KV takes). Each candidate is a `ClusterConfig` run by the simulator (sim/run.py) on
the workload file's stream; its score is goodput per GPU (prompt + output tokens of requests meeting every
SLO, per second, per GPU) against its latency (the SLO metrics). The Pareto set is printed; the winner (the
highest goodput per GPU among candidates meeting every SLO at its percentile, else the highest SLO attainment)
is written as Helm values (`sim/helm_values.py`).

Workload file (YAML or JSON): loadgen's flags by name, e.g. `{scenario: agentx, concurrency: 256, duration: 300,
seed: 0, system-len: "4096", tool-len: "lognormal:1024,0.8"}`; every key must be a loadgen flag (`pdcluster
loadgen --help`); `concurrency` one level.
SLOs: `ttft_p99=2s,tpot_p50=30ms`: METRIC_pNN=VALUE with METRIC in ttft, tpot, itl, e2e, NN in 50, 90, 99, and
VALUE in s or ms.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from cluster.config import ClusterConfig, parse_config
from engine.layout import plan_layout
from engine.model.config import resolve_model
from loadgen.metrics import LevelSummary
from sim.profile import Profile, StepCost
from sim.run import SimOptions, simulate

SLO_METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2e": "e2e_ms"}


@dataclass(frozen=True)
class Objective:
    metric: str
    percentile: int
    limit_ms: float

    @property
    def label(self) -> str:
        return f"{self.metric}_p{self.percentile}"

    def value_ms(self, level: LevelSummary) -> float | None:
        return getattr(getattr(level, SLO_METRICS[self.metric]), f"p{self.percentile}")


def parse_objectives(text: str) -> list[Objective]:
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        m = re.fullmatch(r"(ttft|tpot|itl|e2e)_p(50|90|99)=([0-9.]+)(ms|s)", part)
        if not m:
            raise ValueError(f"--slo: {part!r} is not METRIC_pNN=VALUE(ms|s) with METRIC one of "
                             f"{', '.join(SLO_METRICS)} and NN 50, 90 or 99 (e.g. ttft_p99=2s)")
        value = float(m.group(3)) * (1000.0 if m.group(4) == "s" else 1.0)
        out.append(Objective(m.group(1), int(m.group(2)), value))
    if not out:
        raise ValueError("--slo is empty; give e.g. ttft_p99=2s,tpot_p50=30ms")
    return out


@dataclass(frozen=True)
class Shape:
    """One candidate cluster."""

    prefill_tp: int
    num_prefill: int
    num_tp8: int
    num_dcp8: int
    chunk: int = 8192
    block_scale: int = 1
    latent: str = "fp8"

    @property
    def gpus(self) -> int:
        return self.prefill_tp * self.num_prefill + 8 * (self.num_tp8 + self.num_dcp8)

    def describe(self) -> str:
        return (f"P {self.num_prefill}xTP{self.prefill_tp} | D {self.num_tp8}xTP8 + {self.num_dcp8}xDCP8 | chunk "
                f"{self.chunk} | block x{self.block_scale} | {self.latent}")


@dataclass
class Outcome:
    shape: Shape
    level: LevelSummary
    goodput_tok_s_per_gpu: float
    attainment: float
    latencies: dict[str, float | None]
    meets_slo: bool
    on_frontier: bool = False


@dataclass
class Workload:
    args: object
    scenario: str
    concurrency: int
    duration_s: float
    seed: int


def load_workload(path: Path) -> Workload:
    """Parse a workload file into loadgen's flags (validated by loadgen's own parser)."""
    from loadgen.cli import build_parser
    from loadgen.settings import Settings

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read workload {path}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"workload {path}: a mapping of loadgen flags is expected")
    parser = build_parser(Settings(url=None, api_key=None))
    known = {a.dest: a for a in parser._actions}
    argv = []
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in known or dest in ("url", "out", "help", "dry_run"):
            raise ValueError(f"workload {path}: {key!r} is not a loadgen workload flag")
        if isinstance(value, list):
            value = ",".join(map(str, value))
        argv += [f"--{dest.replace('_', '-')}", str(value)]
    args = parser.parse_args(argv)
    if len(args.concurrency) != 1:
        raise ValueError(f"workload {path}: concurrency must be one level, got {args.concurrency}")
    return Workload(args, args.scenario, args.concurrency[0], args.duration, args.seed)


def config_for(shape: Shape, model: str, base_block: dict[int, int], tp_context: int, max_batch: int) -> ClusterConfig:
    def settings(world: int, dcp: int) -> dict:
        block = base_block[(world, dcp)] * shape.block_scale
        return {"max_num_seqs": max_batch, "max_step_tokens": shape.chunk, "block_size": block}

    pools = [{"name": "prefill", "role": "prefill", "count": shape.num_prefill, "tp": shape.prefill_tp,
              "settings": settings(shape.prefill_tp, 1)}]
    if shape.num_tp8:
        pools.append({"name": "tp", "role": "decode", "count": shape.num_tp8, "tp": 8,
                      "max_context_tokens": tp_context, "settings": settings(8, 1)})
    if shape.num_dcp8:
        pools.append({"name": "dcp", "role": "decode", "count": shape.num_dcp8, "dcp": 8, "settings": settings(8, 8)})
    return parse_config({"model": model, "router": {"port": None, "settings": {"session_growth_tokens": 8192}},
                         "pools": pools}, shape.describe())


def profile_for(profile: Profile, latent: str, model: str) -> Profile:
    """The profile with `latent` KV: decode's per-context cost scaled by the bytes per token."""
    cfg = resolve_model(model)
    base = plan_layout(cfg, latent_format=profile.latent or "fp8", index_key_format=profile.index_key or "fp8")
    new = plan_layout(cfg, latent_format=latent, index_key_format=profile.index_key or "fp8")
    scale = new.attn_bytes_per_token / base.attn_bytes_per_token
    steps = [StepCost(**{**s.model_dump(), "decode_ctx_s": s.decode_ctx_s * scale}) for s in profile.steps]
    return profile.model_copy(update={"latent": latent, "steps": steps})


def candidates(total_gpus: int, profile: Profile) -> list[Shape]:
    have = {(s.tp, s.dcp) for s in profile.steps}
    out = []
    for p_tp in (4, 8):
        if (p_tp, 1) not in have:
            continue
        for num_p in range(1, total_gpus // p_tp + 1):
            p_gpus = num_p * p_tp
            if not total_gpus / 8 <= p_gpus <= total_gpus / 2:
                continue
            rest = total_gpus - p_gpus
            if rest % 8:
                continue
            for num_dcp in (0, 1, 2):
                num_tp8 = rest // 8 - num_dcp
                if num_tp8 < 1 and num_dcp < 1 or num_tp8 < 0:
                    continue
                if num_dcp and (1, 8) not in have or num_tp8 and (8, 1) not in have:
                    continue
                out.append(Shape(p_tp, num_p, num_tp8, num_dcp))
    return out


@dataclass
class Planner:
    profile: Profile
    workload: Workload
    objectives: list[Objective]
    total_gpus: int
    tp_context: int = 131072
    max_batch: int = 128
    top: int = 3
    log: object = None
    outcomes: list[Outcome] = field(default_factory=list)

    def _base_blocks(self, model: str, latent: str) -> dict[tuple[int, int], int]:
        cfg = resolve_model(model)
        blocks = {}
        for world, dcp in ((4, 1), (8, 1), (8, 8)):
            blocks[(world, dcp)] = plan_layout(cfg, tp_size=world, dcp_size=dcp, latent_format=latent,
                                               index_key_format=self.profile.index_key or "fp8").block_size
        return blocks

    def evaluate(self, shape: Shape) -> Outcome:
        from loadgen.cli_run import build_workload
        from loadgen.slo import SLO

        model = self.profile.model
        config = config_for(shape, model, self._base_blocks(model, shape.latent), self.tp_context, self.max_batch)
        profile = profile_for(self.profile, shape.latent, model)
        workload, _ = build_workload(self.workload.args)
        opts = SimOptions([self.workload.concurrency], self.workload.duration_s, None, seed=self.workload.seed,
                          gpus=shape.gpus, slo=SLO(), drain_s=120.0,
                          record_chunks=not profile.stream.is_every_token or any(
                              o.metric == "itl" for o in self.objectives))
        level = simulate(config, profile, workload, self.workload.scenario, opts).summary.levels[0]
        return self._score(shape, level)

    def _score(self, shape: Shape, level: LevelSummary) -> Outcome:
        ok = [r for r in level.records if r.is_ok]
        good_tokens = 0
        num_good = 0
        for r in ok:
            values = {"ttft": r.ttft_s, "tpot": r.tpot_s or 0.0, "e2e": r.e2e_s,
                      "itl": max(r.itl_s) if r.itl_s else 0.0}
            if all(values[o.metric] * 1000 <= o.limit_ms for o in self.objectives):
                num_good += 1
                good_tokens += (r.prompt_tokens or 0) + r.output_tokens
        duration = max(level.duration_s, 1e-9)
        latencies = {o.label: o.value_ms(level) for o in self.objectives}
        meets = bool(ok) and all(v is not None and v <= o.limit_ms for o, v in zip(self.objectives, latencies.values()))
        return Outcome(shape, level, good_tokens / duration / shape.gpus, num_good / max(1, level.num_requests),
                       latencies, meets)

    def _run(self, shapes: list[Shape]) -> list[Outcome]:
        got = []
        for shape in shapes:
            outcome = self.evaluate(shape)
            got.append(outcome)
            if self.log:
                self.log(f"{shape.describe():<70} goodput/GPU {outcome.goodput_tok_s_per_gpu:9.1f} tok/s  "
                         + "  ".join(f"{k} {'-' if v is None else f'{v:.0f} ms'}" for k, v in outcome.latencies.items())
                         + ("  meets SLO" if outcome.meets_slo else ""))
        return got

    def search(self) -> list[Outcome]:
        shapes = candidates(self.total_gpus, self.profile)
        if not shapes:
            raise ValueError(f"no candidate cluster of {self.total_gpus} GPUs for profile {self.profile.name!r} "
                             "(instances of 4 or 8 GPUs: --gpus must be a multiple of 8, at least 16)")
        first = self._run(shapes)
        best = sorted(first, key=_rank)[: self.top]
        variants = []
        for outcome in best:
            for chunk, scale, latent in itertools.product((4096, 8192, 16384), (1, 2), ("fp8", "nvfp4")):
                shape = replace(outcome.shape, chunk=chunk, block_scale=scale, latent=latent)
                if shape != outcome.shape and shape not in variants:
                    variants.append(shape)
        self.outcomes = first + self._run(variants)
        mark_frontier(self.outcomes, self.objectives[0])
        return self.outcomes


def _rank(outcome: Outcome) -> tuple:
    return (not outcome.meets_slo, -outcome.goodput_tok_s_per_gpu if outcome.meets_slo else -outcome.attainment)


def winner(outcomes: list[Outcome]) -> Outcome:
    return min(outcomes, key=_rank)


def mark_frontier(outcomes: list[Outcome], latency: Objective) -> None:
    """Pareto set over (goodput per GPU: higher, the first SLO metric: lower)."""
    def lat(o: Outcome) -> float:
        value = o.latencies.get(latency.label)
        return float("inf") if value is None else value

    for o in outcomes:
        o.on_frontier = not any(
            q is not o and q.goodput_tok_s_per_gpu >= o.goodput_tok_s_per_gpu and lat(q) <= lat(o)
            and (q.goodput_tok_s_per_gpu > o.goodput_tok_s_per_gpu or lat(q) < lat(o)) for q in outcomes)
