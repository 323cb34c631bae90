"""The simulator against real runs on this machine: each configuration run for real (`pdcluster up`'s launcher +
loadgen) and simulated (`pdcluster sim` with the same config, workload, seed, levels and duration), side by side.

Configurations (CONFIGS): topologies default (P TP=2 -> D tp TP=1 + D dcp DCP=2), P TP=2 -> D TP=1 only, and
colocated (the default pools, the router never sends a P leg: disagg_min_uncached_tokens above any prompt); loads
below and near saturation (closed-loop concurrency); workloads agentx with the prefix cache on and off, random.
Per configuration and level: relative error |sim - real| / real of TTFT p50, TPOT p50 and output tok/s, and of
TTFT p99. Headline: the median absolute relative error over TTFT p50, TPOT p50 and throughput of every level
(goal <= 10%); beside it the median error of TTFT p99 (goal <= 25%).

    python benchmarks/sim_validation.py --profile sim/profiles/cpu-mini-reference.json --json /tmp/simval.json
    python benchmarks/sim_validation.py --only default-random-low,default-agentx-on-low --duration 20   # quick look

Each real side starts its own cluster (a free router port), sends it WARMUP's untimed requests (what a fresh
cluster pays once, the simulator does not model) and writes loadgen's summary.json under --work-dir;
the simulated side writes its own beside it, so `pdcluster loadgen compare REAL SIM` shows every metric. The real
side also keeps the cluster it ran (`real/cluster.json`); `--reuse-real` simulates that cluster, so a later change
of cluster/default.yaml does not pair a saved real run with a different simulated one.

`--requests` prints, after the table, every configuration's requests real and simulated side by side, joined by
level and request id (the same seed sends the same requests): prompt and cached tokens, chunks, TTFT, TPOT and the
span from the first chunk to the last. Where a headline figure is off, this says whether the decisions differ (cached
tokens, which requests ran) or only their times, and in which part of a request.

    python benchmarks/sim_validation.py --reuse-real --work-dir DIR --only default-agentx-on-low --requests
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.config import DEFAULT_CONFIG_PATH, ClusterConfig, load_config, parse_config  # noqa: E402
from loadgen.lengths import parse_dist  # noqa: E402
from loadgen.scenarios.agentx import AgentXConfig, AgentXWorkload  # noqa: E402
from loadgen.scenarios.random_requests import RandomConfig, RandomWorkload  # noqa: E402
from sim.measure import Warmup  # noqa: E402

AGENTX = dict(system_len=parse_dist("512"), task_len=parse_dist("lognormal:256,0.5"),
              tool_len=parse_dist("lognormal:96,0.5"), output_len=parse_dist("16"), turns=parse_dist("uniform:4,8"),
              max_context=4096)
"""benchmarks/agent_sessions.py's agent workload (words; the byte tokenizer sees about five tokens per word)."""
RANDOM = dict(input_len=parse_dist("uniform:40,400"), output_len=parse_dist("uniform:16,48"))


def _topology(name: str, cache: bool) -> ClusterConfig:
    base = load_config(DEFAULT_CONFIG_PATH).model_dump(by_alias=False, exclude_none=True)
    if name == "p2-d1":
        base["pools"] = [p for p in base["pools"] if p["name"] != "dcp"]
        base["pools"][1].pop("max_context_tokens", None)
    if name == "colocated":
        base["router"]["settings"]["disagg_min_uncached_tokens"] = 10**9
    if not cache:
        for pool in base["pools"]:
            pool["settings"] = {**pool.get("settings", {}), "prefix_cache": False}
    return parse_config(base, f"{name} (sim_validation)")


@dataclass(frozen=True)
class Config:
    name: str
    topology: str
    scenario: str
    cache: bool
    levels: tuple[int, ...]

    def workload(self, seed: int):
        if self.scenario == "agentx":
            return AgentXWorkload(AgentXConfig(seed=seed, **AGENTX))
        return RandomWorkload(RandomConfig(seed=seed, **RANDOM))


CONFIGS = (
    Config("default-agentx-on-low", "default", "agentx", True, (1,)),
    Config("default-agentx-on-high", "default", "agentx", True, (4,)),
    Config("default-agentx-off", "default", "agentx", False, (2,)),
    Config("default-random-low", "default", "random", True, (1,)),
    Config("default-random-high", "default", "random", True, (6,)),
    Config("p2-d1-random", "p2-d1", "random", True, (1, 4)),
    Config("colocated-agentx", "colocated", "agentx", True, (2,)),
)

WARMUP = (Warmup(300, 2), Warmup(1400, 1))
"""Before each real configuration's levels (`--no-warmup`: none): two 300-word prompts and one of 1,400 words (past
the TP pool's context with the router's growth allowance, so the default topology's P -> DCP pair reads once
too). The first READ of a P -> D pair costs 1-2 s, and the first request of the quiet runs of 2026-12-06 (random,
c1) took 1.05-1.09 s where a later one of the same 1,038 tokens took 0.74-0.81 s: costs a fresh cluster pays
once, which the simulator does not model."""

METRICS = (("ttft_p50", "ttft_ms", "p50"), ("tpot_p50", "tpot_ms", "p50"), ("throughput", "output_tok_s", None),
           ("ttft_p99", "ttft_ms", "p99"))


def _value(level, attr: str, pct: str | None) -> float | None:
    got = getattr(level, attr)
    return getattr(got, pct) if pct else got


@dataclass
class Row:
    config: str
    concurrency: int
    metric: str
    real: float | None
    sim: float | None

    @property
    def error(self) -> float | None:
        if self.real in (None, 0) or self.sim is None:
            return None
        return abs(self.sim - self.real) / abs(self.real)


def run_config(cfg: Config, profile, work: Path, duration_s: float, seed: int, reuse: bool,
               warmup: bool = True) -> list[Row]:
    from loadgen.summary import load_summary
    from sim.measure import measure
    from sim.run import SimOptions, simulate

    cluster = _topology(cfg.topology, cfg.cache)
    real_dir = work / cfg.name / "real"
    done, used = real_dir / "summary.json", real_dir / "cluster.json"
    if reuse and done.exists() and load_summary(done).run.duration_s == duration_s:
        real = load_summary(done)
        if used.exists():  # simulate the cluster the real run had, not today's defaults
            cluster = parse_config(json.loads(used.read_text()), str(used))
        else:
            print(f"{cfg.name}: {used} is missing: simulating today's {cfg.topology} topology", file=sys.stderr)
    else:
        real = measure(cluster, cfg.workload(seed), cfg.scenario, list(cfg.levels), duration_s, real_dir, seed=seed,
                       drain_s=300.0, warmups=WARMUP if warmup else ())
        used.write_text(json.dumps(cluster.model_dump(mode="json", by_alias=True, exclude_none=True), indent=1))
    sim = simulate(cluster, profile, cfg.workload(seed), cfg.scenario,
                   SimOptions(list(cfg.levels), duration_s, work / cfg.name / "sim", seed=seed, drain_s=300.0,
                              config_name=cfg.topology)).summary
    rows = []
    for lv_real, lv_sim in zip(real.levels, sim.levels):
        for metric, attr, pct in METRICS:
            rows.append(Row(cfg.name, lv_real.concurrency, metric, _value(lv_real, attr, pct), _value(lv_sim, attr, pct)))
    return rows


def request_pairs(real, sim) -> list[tuple[int, str, object, object]]:  # noqa: ANN001 - loadgen Summary
    """(concurrency, request id, real record, simulated record) for every request both sides completed, level by
    level in the real side's start order."""
    pairs = []
    for lv_real, lv_sim in zip(real.levels, sim.levels):
        simulated = {r.request_id: r for r in lv_sim.records if r.is_ok}
        for rec in sorted((r for r in lv_real.records if r.is_ok), key=lambda r: r.start_s):
            if rec.request_id in simulated:
                pairs.append((lv_real.concurrency, rec.request_id, rec, simulated[rec.request_id]))
    return pairs


def request_table(name: str, real, sim) -> list[str]:  # noqa: ANN001 - loadgen Summary
    """`--requests`: one configuration's requests, real / simulated (markdown rows)."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1000 * v:,.0f}"

    def span(r) -> str:  # noqa: ANN001
        return ms(r.chunk_s[-1] - r.chunk_s[0]) if r.chunk_s else "-"

    def tpot(r) -> str:  # noqa: ANN001
        return "-" if r.tpot_s is None else f"{1000 * r.tpot_s:.1f}"

    pairs = request_pairs(real, sim)
    lines = [f"### {name}", "", "| conc | request | prompt | cached real / sim | chunks | TTFT ms | TPOT ms | "
             "first-to-last chunk ms |", "|---:|---|---:|---|---|---|---|---|"]
    for conc, rid, a, b in pairs:
        lines.append(f"| {conc} | {rid} | {a.prompt_tokens} | {a.cached_tokens or 0} / {b.cached_tokens or 0} | "
                     f"{len(a.chunk_s)} / {len(b.chunk_s)} | {ms(a.ttft_s)} / {ms(b.ttft_s)} | {tpot(a)} / {tpot(b)} | "
                     f"{span(a)} / {span(b)} |")
    num_real = sum(1 for lv in real.levels for r in lv.records if r.is_ok)
    num_sim = sum(1 for lv in sim.levels for r in lv.records if r.is_ok)
    lines.append(f"\n{len(pairs)} requests on both sides; {num_real} completed for real, {num_sim} simulated")
    return lines


def _median(rows: list[Row], metrics: tuple[str, ...]) -> float | None:
    errors = [r.error for r in rows if r.metric in metrics and r.error is not None]
    return statistics.median(errors) if errors else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", default="cpu-mini-reference", help="profile JSON or name in sim/profiles/")
    p.add_argument("--duration", type=float, default=120.0, help="seconds per level, real and simulated")
    p.add_argument("--only", default=None, help="comma-separated configuration names (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, default=Path("sim-validation"))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-warmup", action="store_true", help="measure each real configuration from a cold start")
    p.add_argument("--reuse-real", action="store_true",
                   help="take a configuration's real side from --work-dir when a run of the same duration is there")
    p.add_argument("--requests", action="store_true",
                   help="print each configuration's requests, real and simulated side by side, after the table")
    args = p.parse_args(argv)
    from sim.profile import resolve_profile

    profile = resolve_profile(args.profile)
    names = set(args.only.split(",")) if args.only else {c.name for c in CONFIGS}
    unknown = names - {c.name for c in CONFIGS}
    if unknown:
        p.error(f"--only: unknown configuration(s) {sorted(unknown)}; known: {[c.name for c in CONFIGS]}")
    started = time.time()
    from cluster.launcher import ClusterStartError

    rows: list[Row] = []
    failed: dict[str, str] = {}
    for cfg in CONFIGS:
        if cfg.name in names:
            print(f"== {cfg.name}", file=sys.stderr)
            try:
                rows += run_config(cfg, profile, args.work_dir, args.duration, args.seed, args.reuse_real,
                                   warmup=not args.no_warmup)
            except ClusterStartError as exc:  # the real cluster did not start: say so, go on
                failed[cfg.name] = str(exc).splitlines()[0]
                print(f"{cfg.name}: real cluster failed to start: {failed[cfg.name]}", file=sys.stderr)
    head = _median(rows, ("ttft_p50", "tpot_p50", "throughput"))
    p99 = _median(rows, ("ttft_p99",))
    print(f"| config | conc | metric | real | sim | error |\n|---|---:|---|---:|---:|---:|")
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"| {r.config} | {r.concurrency} | {r.metric} | {fmt(r.real)} | {fmt(r.sim)} | "
              f"{'-' if r.error is None else f'{100 * r.error:.1f}%'} |")
    print(f"headline: median |rel error| over TTFT p50, TPOT p50, throughput = "
          f"{'-' if head is None else f'{100 * head:.1f}%'} (goal <= 10%); TTFT p99 "
          f"{'-' if p99 is None else f'{100 * p99:.1f}%'} (goal <= 25%); {len(names) - len(failed)} of {len(names)} "
          f"configurations, {time.time() - started:.0f} s")
    for name, why in failed.items():
        print(f"not run: {name}: {why}")
    if args.requests:
        from loadgen.summary import load_summary

        for cfg in CONFIGS:
            side = args.work_dir / cfg.name
            if cfg.name in names and cfg.name not in failed:
                print("\n" + "\n".join(request_table(cfg.name, load_summary(side / "real" / "summary.json"),
                                                     load_summary(side / "sim" / "summary.json"))))
    if args.json:
        args.json.write_text(json.dumps({
            "headline": {"metric": "median_abs_rel_error_ttft_p50_tpot_p50_throughput", "value": head, "goal": 0.10},
            "ttft_p99": {"metric": "median_abs_rel_error_ttft_p99", "value": p99, "goal": 0.25},
            "profile": profile.name, "duration_s": args.duration, "configs": sorted(set(names) - set(failed)),
            "failed": failed,
            "rows": [dict(asdict(r), error=r.error) for r in rows], "command": ["benchmarks/sim_validation.py", *(argv or sys.argv[1:])],
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
