"""How fast the simulator runs: one simulated hour of a 64-GPU GB300 cluster's agentx traffic (goal < 60 s wall).

Cluster sim/configs/gb300-64.yaml (3 prefill TP8, 3 decode TP8, 2 decode DCP8 = 64 GPUs, Kimi K3.1 Pro), profile
gb300-k31-pro, workload sim/workloads/agentx-gb300.yaml (loadgen agentx: 4096-word system prompt, ~500-word tool
results, 8-24 turns, up to 128K tokens) at its concurrency, without per-chunk times (`--no-chunk-times`: TTFT,
TPOT and throughput are exact, ITL is not kept), its sessions drawn ahead by two worker processes on the host's
other core (sim/prefetch.py; `--session-workers 0` draws them in this process: the same figures). Reports wall
time, simulated time, requests, events and the level's figures. CPU seconds of the process (and of its session
workers) and the load average are printed beside the wall time: on a shared machine the wall time includes other
tenants' share of the cores.

    python benchmarks/sim_speed.py [--simulated-s 3600] [--concurrency N] [--session-workers 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "sim" / "configs" / "gb300-64.yaml"
WORKLOAD = ROOT / "sim" / "workloads" / "agentx-gb300.yaml"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--simulated-s", type=float, default=3600.0, help="simulated seconds (the level's duration)")
    p.add_argument("--concurrency", type=int, default=None, help="agent sessions (default: the workload file's)")
    p.add_argument("--session-workers", type=int, default=2,
                   help="processes drawing the sessions' texts ahead (sim/prefetch.py; 0: in this process)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    started, cpu0 = time.perf_counter(), time.process_time()
    from cluster.config import load_config
    from loadgen.cli_run import build_workload
    from sim.planner import load_workload
    from sim.profile import resolve_profile
    from sim.run import SimOptions, simulate

    spec = load_workload(WORKLOAD)
    conc = args.concurrency or spec.concurrency
    workload, _ = build_workload(spec.args)
    config = load_config(CONFIG)
    gpus = sum(pool.count * pool.world_size for pool in config.pools)
    opts = SimOptions([conc], args.simulated_s, None, seed=spec.seed, gpus=gpus, record_chunks=False,
                      schedule_units=1, session_workers=args.session_workers)
    result = simulate(config, resolve_profile("gb300-k31-pro"), workload, "agentx", opts)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu0
    workers = resource.getrusage(resource.RUSAGE_CHILDREN)
    workers_cpu = workers.ru_utime + workers.ru_stime
    lv = result.summary.levels[0]
    rows = [("GPUs", gpus), ("sessions (concurrency)", conc), ("simulated s", f"{result.simulated_s:.0f}"),
            ("wall s (imports included)", f"{wall:.1f}"),
            ("CPU s of this process", f"{cpu:.1f}"),
            ("session workers (their CPU s)", f"{args.session_workers} ({workers_cpu:.1f})"),
            ("load average (1 min) at the end", f"{os.getloadavg()[0]:.1f}"), ("requests ok", lv.num_ok), ("events", result.num_events),
            ("TTFT p50 / p99 ms", f"{lv.ttft_ms.p50:.0f} / {lv.ttft_ms.p99:.0f}"),
            ("TPOT p50 ms", f"{lv.tpot_ms.p50:.1f}"), ("output tok/s", f"{lv.output_tok_s:.0f}"),
            ("total tok/s per GPU", f"{lv.total_tok_s_per_gpu:.0f}"),
            ("prompt cache hit ratio", f"{lv.prompt_cache_hit_ratio:.3f}" if lv.prompt_cache_hit_ratio else "-")]
    print("| metric | value |\n|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    if args.json:
        args.json.write_text(json.dumps({
            "headline": {"metric": "wall_s_per_simulated_hour_64_gpus", "value": wall * 3600.0 / args.simulated_s,
                         "goal": 60.0},
            "wall_s": wall, "cpu_s": cpu, "session_workers_cpu_s": workers_cpu, "load_average_1min": os.getloadavg()[0], "simulated_s": result.simulated_s, "requests_ok": lv.num_ok, "events": result.num_events,
            "gpus": gpus, "concurrency": conc, "session_workers": args.session_workers, "ttft_p50_ms": lv.ttft_ms.p50, "tpot_p50_ms": lv.tpot_ms.p50,
            "output_tok_s": lv.output_tok_s, "total_tok_s_per_gpu": lv.total_tok_s_per_gpu}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
