"""The agent workload's frontier of one cluster, disaggregated against colocated on the same hardware:
`pdcluster loadgen --scenario agentx` swept over several concurrencies against a cluster config twice in one
invocation, with the same seed and the prefix cache on:

- `pd`: the config as it is (the router sends a prompt with enough uncached tokens through a prefill instance and
  hands its KV to a decode instance over NIXL);
- `colocated`: the same processes on the same devices, with the router's `disagg_min_uncached_tokens` above any
  prompt, so every request is computed where it decodes (the prefill instance idles).

Each side starts its own cluster on free ports, runs the sweep, and stops it. Per side and concurrency it prints
the p50 TTFT, p50 TPOT, tok/s per user (1 / TPOT) and tok/s per GPU (prompt + output tokens of ok requests over
the level's duration, over `--gpus`), marks the Pareto points of (per-user, per-GPU), then `loadgen compare`
(A = colocated, B = pd). `--json FILE`: every level, both frontiers, and a headline: the best tok/s per GPU of pd
over that of colocated (reported; no goal: which wins depends on the model, the hardware and the load).

    python benchmarks/agentx_frontier.py --config cluster/gpu1.yaml --concurrency 1,4,16 --duration 60 \
        --gpus 1 --out runs/agentx-gpu1 --json runs/agentx-gpu1.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.config import DEFAULT_CONFIG_PATH, load_config  # noqa: E402
from cluster.launcher import Cluster  # noqa: E402

SIDES = ("colocated", "pd")
NEVER_DISAGGREGATE = 1 << 40
"""`disagg_min_uncached_tokens` of the colocated side: more uncached tokens than any prompt can have."""


def config_for(side: str, base: Path):
    config = load_config(base)
    data = config.model_dump(by_alias=False)
    data["router"]["port"] = None
    if side == "colocated":
        data["router"]["settings"] = {**data["router"].get("settings", {}),
                                      "disagg_min_uncached_tokens": NEVER_DISAGGREGATE}
    for pool in data["pools"]:
        pool["settings"] = {**pool.get("settings", {}), "prefix_cache": True}
    return type(config).model_validate(data)


def run_side(side: str, args: argparse.Namespace) -> dict:
    out = args.out / side
    cluster = Cluster(config_for(side, args.config), out / "logs").start()
    try:
        started = time.monotonic()
        argv = [sys.executable, "-m", "pdcluster.cli", "loadgen", "--url", cluster.router_url, "--scenario", "agentx",
                "--seed", str(args.seed), "--concurrency", args.concurrency, "--duration", str(args.duration),
                "--gpus", str(args.gpus), "--out", str(out), "--no-plots", "--progress", "off",
                "--request-timeout", "600", "--drain", str(args.drain), *args.loadgen_args]
        subprocess.run(argv, cwd=ROOT, check=True)
        wall_s = time.monotonic() - started
    finally:
        cluster.stop()
    summary = json.loads((out / "summary.json").read_text())
    levels = []
    for level in summary["levels"]:
        tpot = level["tpot_ms"]["p50"]
        levels.append({"concurrency": level["concurrency"], "requests": level["num_requests"], "ok": level["num_ok"],
                       "errors": level["num_errors"], "ttft_p50_ms": level["ttft_ms"]["p50"],
                       "ttft_p90_ms": level["ttft_ms"]["p90"], "tpot_p50_ms": tpot,
                       "tok_s_per_user": 1000.0 / tpot if tpot else None,
                       "tok_s_per_gpu": level.get("total_tok_s_per_gpu"),
                       "output_tok_s_per_gpu": level.get("output_tok_s_per_gpu")})
    frontier = {p["concurrency"] for p in summary.get("pareto", []) if p.get("on_frontier")}
    for level in levels:
        level["on_frontier"] = level["concurrency"] in frontier
    return {"side": side, "summary": str(out / "summary.json"), "wall_s": round(wall_s, 1), "levels": levels}


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def table(results: list[dict]) -> str:
    cols = ["concurrency", "ok", "errors", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tok_s_per_user",
            "tok_s_per_gpu", "on_frontier"]
    lines = ["| side | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for result in results:
        for level in result["levels"]:
            lines.append(f"| {result['side']} | " + " | ".join(_cell(level[c]) for c in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH)
    p.add_argument("--out", type=Path, default=Path("agentx-frontier-out"))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", default="1,4,16", help="live sessions per level, comma-separated")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per level")
    p.add_argument("--drain", type=float, default=120.0, help="seconds a level waits for its last requests")
    p.add_argument("--gpus", default="1", help="GPUs behind the router (loadgen --gpus: G or P+D)")
    p.add_argument("--sides", default=",".join(SIDES), help="which sides to run (colocated, pd)")
    p.add_argument("loadgen_args", nargs=argparse.REMAINDER,
                   help="after --: further `pdcluster loadgen` flags for both sides (lengths, turns, ...)")
    args = p.parse_args(argv)
    args.loadgen_args = [a for a in args.loadgen_args if a != "--"]
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown or not sides:
        p.error(f"--sides takes {', '.join(SIDES)}; got {args.sides!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_side(side, args) for side in sides]
    print(table(results))
    by_side = {r["side"]: r for r in results}
    best = {s: max((lv["tok_s_per_gpu"] or 0.0 for lv in r["levels"]), default=0.0) for s, r in by_side.items()}
    headline = {"metric": "pd_over_colocated_best_tok_s_per_gpu",
                "value": best["pd"] / best["colocated"] if best.get("pd") and best.get("colocated") else None,
                "goal": None, "best_tok_s_per_gpu": best}
    compare = ""
    if len(results) == 2:
        compare = subprocess.run([sys.executable, "-m", "pdcluster.cli", "loadgen", "compare",
                                  by_side["colocated"]["summary"], by_side["pd"]["summary"]],
                                 cwd=ROOT, capture_output=True, text=True).stdout
        print("\nloadgen compare (A = colocated, B = pd):\n" + compare)
    print("headline:", json.dumps(headline))
    if args.json:
        args.json.write_text(json.dumps({"headline": headline, "sides": results, "compare": compare,
                                         "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
