"""Chaos run: agent sessions keep their answers while nodes die and drain (router/migration.py, docs/ROUTER.md).

The cluster of cluster/default.yaml (`pdcluster up`: P TP=2, D `tp` TP=1, D `dcp` DCP=2) serves a loadgen agentx
run (`--concurrency` sessions, chat, greedy, log-probs on) for `--duration` seconds, twice with the same sessions:
once while a schedule SIGKILLs a decode node (at 15% of the run), SIGKILLs the prefill node (35%), drains a decode
node with SIGTERM (55%) and SIGKILLs a decode node again (75%), each restarted by this harness as soon as it is
gone; then once with no faults (the baseline). The decode victim is the decode node running the most requests at
that moment. Changes to the default config, so that faults are seen quickly and drains hand off at once: the
router's `health_interval_s` 0.5 and `breaker_recovery_s` 2, the decode pools' `drain_hand_off_s` 0, and leg
bounds for two shared cores (LEG_BOUNDS). The agentx lengths are smaller than loadgen's defaults (`--system-len`
and the rest: a 2-core machine, and an oracle that computes every answer from its first token) and bounded by
`--max-context` (200 words), so every session fits either decode pool while the other is down.

Every completed answer is compared token for token (the log-prob token names) with the oracle: tests/soak/oracle.py
`Oracle`, the soak's (one torch thread, every distinct request batched through one single-rank reference engine in
waves, prefix cache off, each request from its first token; a few answers rerun alone through tests/oracle.py as a
check that batching changed no bit: `oracle_batched`). It runs after each side's cluster stopped, so it has the
machine to itself; the baseline side's answers are mostly the faults side's, already known.

Headline (`--json FILE`): requests failed (goal 0), answers that differ from the oracle (goal 0), rows leaked
(every node's `pdcluster_node_kv_rows_used` and leases once it is quiet: goal 0), moves by reason, resume latency
p50/p99 (the router's `pdcluster_resume_latency_seconds`, as bucket upper bounds) and the client TTFT / TPOT
p50 / p99 of both sides with their ratios.

`faults_during_load` says how many faults fired while the load ran: each restart holds the schedule up (about 30 s
on a busy machine), so a run much shorter than 240 s sees its last faults (the drain among them) after the load.

    .venv/bin/python benchmarks/chaos.py --duration 240 --json /tmp/chaos.json

Time: two sides of `--duration` plus each cluster's start and quiet-down, plus the oracle. Measured beside other
runs (load average 15 to 27 on two cores): `--duration 45` took 400 s (oracle 126 s for 65 answers; 2 of the 4
faults during the load), `--duration 120` 655 s (oracle 116 s for the faults side's 50 answers, 78 s for the
baseline's 71; 4 of 4 faults during the load). `--duration 240` should take about 15 minutes on a quiet 2-core
machine and under 25 on a busy one, the oracle about a third of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.config import DEFAULT_CONFIG_PATH, load_config  # noqa: E402
from cluster.launcher import Cluster  # noqa: E402
from loadgen.client import Target  # noqa: E402
from loadgen.lengths import parse_dist  # noqa: E402
from loadgen.metrics import percentile  # noqa: E402
from loadgen.runner import run_level  # noqa: E402
from loadgen.scenarios.agentx import AgentXConfig, AgentXWorkload  # noqa: E402
from loadgen.schedule import Fork, RequestSpec  # noqa: E402
from tests.soak.oracle import Oracle, prompt_ids_of  # noqa: E402

SCHEDULE = ((0.15, "kill", "decode"), (0.35, "kill", "prefill"), (0.55, "drain", "decode"), (0.75, "kill", "decode"))
"""(fraction of the run, action, role): the fault schedule."""
LEG_BOUNDS = {"prefill_timeout_s": 300.0, "first_token_timeout_s": 300.0, "stream_idle_timeout_s": 300.0}
"""Two shared cores: a decode instance that takes every moved stream at once recomputes each prompt (in
`max_step_tokens` chunks between its streams' steps), so its streams' gaps can pass the default 60 s idle bound."""


def config_for(base: Path):
    config = load_config(base)
    data = config.model_dump(by_alias=False)
    data["router"]["port"] = None
    data["router"]["settings"] = {**data["router"].get("settings", {}), "health_interval_s": 0.5,
                                  "breaker_recovery_s": 2.0, **LEG_BOUNDS}
    for pool in data["pools"]:
        if pool["role"] == "decode":
            pool["settings"] = {**pool.get("settings", {}), "drain_hand_off_s": 0}
    return type(config).model_validate(data)


def scrape(url: str, timeout_s: float = 10.0) -> list:
    text = httpx.get(url, timeout=timeout_s).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list, name: str) -> float:
    return sum(s.value for s in samples if s.name == name)


def node_loads(cluster: Cluster) -> dict[str, dict]:
    """Every node's running / waiting requests, rows used and leases outstanding (an error string if unreachable)."""
    loads = {}
    for plan in cluster.node_plans:
        try:
            samples = scrape(cluster.metrics_urls[plan.name])
        except httpx.HTTPError as exc:
            loads[plan.name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        loads[plan.name] = {key: total(samples, name) for key, name in (
            ("running", "vllm:num_requests_running"), ("waiting", "vllm:num_requests_waiting"),
            ("rows_used", "pdcluster_node_kv_rows_used"), ("leases", "pdcluster_node_leases_outstanding"))}
    return loads


def wait_idle(cluster: Cluster, timeout_s: float) -> dict[str, dict]:
    """Poll until every node answers with nothing running, queued, leased or held; the loads then (or at the
    deadline: a node still holding rows is a leak)."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = node_loads(cluster)
        if all("error" not in load and not any(load.values()) for load in loads.values()) \
                or time.monotonic() > deadline:
            return loads
        time.sleep(1.0)


def busiest_decode(cluster: Cluster) -> str:
    decode = [p.name for p in cluster.node_plans if p.role == "decode"]

    def running(name: str) -> float:
        try:
            return total(scrape(cluster.metrics_urls[name]), "vllm:num_requests_running")
        except httpx.HTTPError:
            return -1.0
    return max(decode, key=running)


def faults(cluster: Cluster, duration_s: float, log: list[str], fired_at: list[float]) -> None:
    """The schedule (SCHEDULE), each victim restarted as soon as it is gone (a restart holds the schedule up: in a
    short run the last faults may come after the load; `fired_at`, seconds into the run, tells)."""
    started = time.monotonic()
    prefill = next(p.name for p in cluster.node_plans if p.role == "prefill")
    for at, action, role in SCHEDULE:
        time.sleep(max(0.0, started + at * duration_s - time.monotonic()))
        name = prefill if role == "prefill" else busiest_decode(cluster)
        fired_at.append(time.monotonic() - started)
        log.append(f"{fired_at[-1]:.1f} s: {action} {name}")
        if action == "kill":
            cluster.kill(name)
        else:
            child = cluster.children[name]
            child.popen.send_signal(signal.SIGTERM)
            code = child.popen.wait(600)
            log.append(f"{time.monotonic() - started:.1f} s: {name} exited {code} after its drain")
        cluster.restart(name)
        log.append(f"{time.monotonic() - started:.1f} s: {name} back")


def specs_by_id(workload: AgentXWorkload, num_sessions: int) -> dict[str, RequestSpec]:
    """Every request of the first `num_sessions` sessions (a session is a pure function of its index)."""
    found: dict[str, RequestSpec] = {}

    def walk(steps) -> None:
        for step in steps:
            if isinstance(step, Fork):
                for branch in step.branches:
                    walk(branch)
            else:
                found[step.request_id] = step
    for index in range(num_sessions):
        walk(workload.session(index).steps)
    return found


def oracle_key(spec: RequestSpec) -> tuple[list[int], int]:
    """(prompt ids, max_tokens) of an agentx request, as a node feeds them to its engine."""
    return prompt_ids_of([{"role": m.role, "content": m.content} for m in spec.messages]), spec.max_tokens


def stats(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": round(percentile(values, 50), 4), "p99": round(percentile(values, 99), 4)}


def bucket_quantile(samples: list, name: str, q: float) -> float | None:
    buckets = sorted((float(s.labels["le"]), s.value) for s in samples if s.name == f"{name}_bucket")
    count = buckets[-1][1] if buckets else 0
    if not count:
        return None
    return next(le for le, seen in buckets if seen >= q * count)


async def load(cluster: Cluster, workload: AgentXWorkload, args) -> tuple:
    target = Target(cluster.router_url, cluster.model_name, "chat", logprobs=True, ignore_eos=True)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0)) as client:
        return await run_level(client, target, workload, args.concurrency, args.duration, drain_s=args.drain)


def side(with_faults: bool, workload: AgentXWorkload, oracle: Oracle, args) -> dict:
    name = "faults" if with_faults else "baseline"
    cluster = Cluster(config_for(args.config), args.out / name / "logs").start()
    try:
        before = wait_idle(cluster, 120)
        log: list[str] = []
        fired_at: list[float] = []
        chaos = threading.Thread(target=faults, args=(cluster, args.duration, log, fired_at), name="chaos") \
            if with_faults else None
        if chaos is not None:
            chaos.start()
        level = asyncio.run(load(cluster, workload, args))
        if chaos is not None:
            chaos.join()
        after = wait_idle(cluster, args.idle_timeout)
        router = scrape(cluster.metrics_urls["router"])
    finally:
        cluster.stop()
    specs = specs_by_id(workload, level.num_sessions)
    records = level.records
    done = [r for r in records if r.outcome == "ok"]
    failed = [r for r in records if r.outcome == "error"]
    oracle_started = time.monotonic()
    oracle.run_all([oracle_key(specs[r.request_id]) for r in done])
    mismatched = [r.request_id for r in done
                  if r.tokens != oracle.token_names(oracle.generate(*oracle_key(specs[r.request_id])).token_ids)]
    oracle_s = round(time.monotonic() - oracle_started, 1)
    print(f"[chaos] {name}: oracle for {len(done)} answers in {oracle_s:.0f} s", file=sys.stderr, flush=True)
    leaked = {node: load for node, load in after.items() if "error" in load or any(load.values())}
    return {
        "requests": len(records), "completed": len(done), "failed": len(failed),
        "cancelled_at_end": sum(r.outcome == "cancelled" for r in records), "mismatched": len(mismatched),
        "mismatch_ids": mismatched[:10], "sessions": level.num_sessions, "duration_s": round(level.duration_s, 1),
        "nodes_before": before, "nodes_after": after, "leaking_nodes": sorted(leaked),
        "rows_leaked": sum(load.get("rows_used", 0) for load in after.values()),
        "moves": {s.labels["reason"]: s.value for s in router if s.name == "pdcluster_migrations_total" and s.value},
        "resume_latency_s": {q: bucket_quantile(router, "pdcluster_resume_latency_seconds", f)
                             for q, f in (("p50", 0.5), ("p99", 0.99))},
        "ttft_s": stats([r.ttft_s for r in done]), "tpot_s": stats([r.tpot_s for r in done]),
        "oracle_s": oracle_s, "schedule": log,
        "faults_during_load": f"{sum(t < level.duration_s for t in fired_at)} of {len(SCHEDULE)}"
        if with_faults else "-",
        "errors": sorted({f"{r.error_kind}: {r.error}"[:200] for r in failed})[:10],
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def table(report: dict) -> str:
    f, b = report["faults"], report["baseline"]
    rows = [("requests (completed)", f"{f['requests']} ({f['completed']})", f"{b['requests']} ({b['completed']})"),
            ("failed", f["failed"], b["failed"]), ("oracle mismatches", f["mismatched"], b["mismatched"]),
            ("rows leaked / leaking nodes", f"{f['rows_leaked']:.0f} / {len(f['leaking_nodes'])}",
             f"{b['rows_leaked']:.0f} / {len(b['leaking_nodes'])}"),
            ("faults during the load", f["faults_during_load"], "-"),
            ("moves", json.dumps(f["moves"]), json.dumps(b["moves"])),
            ("resume latency p50 / p99 (s, bucket)", f"{f['resume_latency_s']['p50']} / {f['resume_latency_s']['p99']}",
             "-")]
    for metric in ("ttft_s", "tpot_s"):
        for q in ("p50", "p99"):
            rows.append((f"{metric[:-2].upper()} {q} (s)", f"{f[metric][q]} (x{ratio(f[metric][q], b[metric][q])})",
                         b[metric][q]))
    lines = ["| | faults | baseline |", "|---|---|---|"] + [f"| {a} | {x} | {y} |" for a, x, y in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH)
    parser.add_argument("--duration", type=float, default=240.0, help="seconds of load per side")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent agent sessions")
    parser.add_argument("--drain", type=float, default=300.0, help="seconds in-flight requests get after the load")
    parser.add_argument("--idle-timeout", type=float, default=180.0,
                        help="seconds every node gets to become idle after the load (then what it holds is leaked)")
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument("--system-len", default="32",
                        help="agentx lengths (loadgen's distributions, in its words: about 6 byte tokens each "
                             "for the reference tokenizer; output lengths are max_tokens)")
    parser.add_argument("--task-len", default="lognormal:24,0.5")
    parser.add_argument("--tool-len", default="lognormal:16,0.5")
    parser.add_argument("--output-len", default="lognormal:32,0.3")
    parser.add_argument("--turns", default="uniform:3,6")
    parser.add_argument("--max-context", type=int, default=200,
                        help="agentx's bound (words): every session fits either decode pool while the other is down")
    parser.add_argument("--out", type=Path, default=Path("/tmp/chaos"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    started = time.monotonic()
    config = config_for(args.config)
    workload = AgentXWorkload(AgentXConfig(
        seed=args.seed, system_len=parse_dist(args.system_len), task_len=parse_dist(args.task_len),
        tool_len=parse_dist(args.tool_len), output_len=parse_dist(args.output_len), turns=parse_dist(args.turns),
        max_context=args.max_context))
    oracle = Oracle(config.model, ignore_eos=True)
    sides = {}
    for name, with_faults in (("faults", True), ("baseline", False)):
        sides[name] = side(with_faults, workload, oracle, args)
        (args.out / f"{name}.json").write_text(json.dumps(sides[name], indent=2))  # kept if the other side fails
    alone = oracle.check_alone()  # a few batched answers again, one at a time: the batch changed no bit
    f, b = sides["faults"], sides["baseline"]
    report = {"headline": {
        "metric": "requests_failed", "value": f["failed"], "goal": 0,
        "answers_mismatched": f["mismatched"], "answers_mismatched_goal": 0, "rows_leaked": f["rows_leaked"],
        "leaking_nodes": f["leaking_nodes"], "faults_during_load": f["faults_during_load"], "moves": f["moves"],
        "resume_latency_s": f["resume_latency_s"],
        **{f"{m}_{q}_ratio": ratio(f[m][q], b[m][q]) for m in ("ttft_s", "tpot_s") for q in ("p50", "p99")}},
        **sides, "oracle_batched": alone}
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["args"] = {k: str(v) for k, v in vars(args).items()}
    text = json.dumps(report, indent=2)
    print(text)
    print(table(report))
    if args.json:
        args.json.write_text(text)
    bad = f["failed"] or f["mismatched"] or f["leaking_nodes"] or b["failed"] or b["mismatched"] \
        or not alone["batched_equals_alone"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
