"""Agent sessions with and without the prefix cache: `pdcluster loadgen --scenario agentx` on the reference
cluster (`pdcluster up`'s cluster/default.yaml), run twice in one invocation with the same seed: first with the
node cache switched off (`prefix_cache: false` on every pool), then on (the default). Each side starts its own
cluster on free ports, runs the same agentx schedule, and stops it.

Measured per side (all from what the run itself produced, nothing assumed):
- mean client TTFT of turns >= 2 (every request of a session but its first, `.t0`; sub-agent turns included:
  they extend the session's context), from loadgen's summary.json records;
- P->D bytes per turn: the decode nodes' `vllm:nixl_bytes_transferred_sum` (bytes READ from prefill nodes)
  over the run / ok requests, and the P->D blocks read vs reused (`pdcluster_kv_transfer_blocks_total`);
- prompt cache hit ratio: the router's `pdcluster_cached_prompt_tokens_total / pdcluster_prompt_tokens_total`
  over the run (the cached_tokens clients saw), and the nodes' hit/queried tokens;
then `loadgen compare` of the two summaries. `--json FILE` writes everything with a headline:
metric ttft_turn2plus_ratio (on / off, goal <= 0.3), beside it pd_bytes_per_turn_reduction (off / on, goal >= 5),
itl_p99_ratio (on / off, goal <= 1.2: the client inter-token gaps, from loadgen's records; a turn prefilled on
the decode instance runs in `max_step_tokens` chunks between the other streams' decode steps) and whether both sides
ran the same requests. The TTFT and ITL ratios are taken over the requests both sides completed (by request id):
the closed loop cut at --max-requests may send a few different requests on each side; the bytes per turn are the
nodes' counters over each side's whole run.
Both sides run the router with `--disagg-min-uncached-tokens` (default 2048, two kimi-k3.1-mini blocks;
conditional disaggregation): with the cache off nothing is resumable, so every turn of more than that takes a P
leg; with it on, a turn that extends its last turn by fewer tokens is computed on the decode instance that holds
the session, from the turn's tail (agentx sends its own text of each answer, so that is the prompt tail: the
previous prompt's exact end). A P leg ships the whole KDA state at the new prompt's end (384 KiB per request at
TP1) plus every block the new tokens touch, which for agentx's 0.5-2K new tokens a turn costs more bytes and
more time than computing them where the session's KV already is.

    .venv/bin/python benchmarks/agent_sessions.py --out /tmp/agent-sessions --json /tmp/agent-sessions.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.config import DEFAULT_CONFIG_PATH, load_config  # noqa: E402
from cluster.launcher import Cluster  # noqa: E402
from loadgen.metrics import percentile  # noqa: E402

NODE_SERIES = {"pd_bytes": ("vllm:nixl_bytes_transferred_sum", {}),
               "blocks_read": ("pdcluster_kv_transfer_blocks_total", {"kind": "read"}),
               "blocks_reused": ("pdcluster_kv_transfer_blocks_total", {"kind": "reused"}),
               "node_hit_tokens": ("pdcluster_prefix_cache_hit_tokens_total", {}),
               "node_queried_tokens": ("pdcluster_prefix_cache_queried_tokens_total", {}),
               "evicted_blocks": ("pdcluster_prefix_cache_evicted_blocks_total", {})}
ROUTER_SERIES = {"prompt_tokens": ("pdcluster_prompt_tokens_total", {}),
                 "cached_tokens": ("pdcluster_cached_prompt_tokens_total", {}),
                 "prefill_skipped": ("pdcluster_prefill_skipped_total", {})}


def scrape(url: str, series: dict[str, tuple[str, dict]]) -> dict[str, float]:
    text = httpx.get(url, timeout=30).text
    out = dict.fromkeys(series, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key, (name, labels) in series.items():
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    out[key] += sample.value
    return out


def totals(cluster: Cluster) -> dict[str, float]:
    found = dict.fromkeys([*NODE_SERIES, *ROUTER_SERIES], 0.0)
    for name, url in cluster.metrics_urls.items():
        for key, value in scrape(url, ROUTER_SERIES if name == "router" else NODE_SERIES).items():
            found[key] += value
    return found


def config_for(cache_on: bool, base: Path, min_uncached: int | None = None):
    config = load_config(base)
    data = config.model_dump(by_alias=False)
    data["router"]["port"] = None
    if min_uncached is not None:
        data["router"]["settings"] = {**data["router"].get("settings", {}), "disagg_min_uncached_tokens": min_uncached}
    for pool in data["pools"]:
        pool["settings"] = {**pool.get("settings", {}), "prefix_cache": cache_on}
    return type(config).model_validate(data)


def loadgen(url: str, out: Path, args: argparse.Namespace) -> None:
    argv = [sys.executable, "-m", "pdcluster.cli", "loadgen", "--url", url, "--scenario", "agentx",
            "--seed", str(args.seed), "--concurrency", str(args.concurrency), "--duration", str(args.duration),
            "--max-requests", str(args.max_requests), "--out", str(out), "--no-plots", "--progress", "off",
            "--system-len", args.system_len, "--task-len", args.task_len, "--tool-len", args.tool_len,
            "--output-len", args.output_len, "--turns", args.turns, "--think-time", args.think_time,
            "--max-context", str(args.max_context), "--request-timeout", "900", "--drain", "900"]
    subprocess.run(argv, cwd=ROOT, check=True)


def side(cache_on: bool, args: argparse.Namespace) -> dict:
    name = "cache_on" if cache_on else "cache_off"
    out = args.out / name
    cluster = Cluster(config_for(cache_on, args.config, args.disagg_min_uncached_tokens), out / "logs").start()
    try:
        before = totals(cluster)
        started = time.monotonic()
        loadgen(cluster.router_url, out, args)
        wall_s = time.monotonic() - started
        time.sleep(2.0)  # the last cache reports and metric updates
        after = totals(cluster)
    finally:
        cluster.stop()
    delta = {k: after[k] - before[k] for k in after}
    summary = json.loads((out / "summary.json").read_text())
    records = [r for level in summary["levels"] for r in level["records"]]
    ok = [r for r in records if r["outcome"] == "ok"]
    later = [r["ttft_s"] for r in ok if not r["request_id"].endswith(".t0") and r["ttft_s"] is not None]
    first = [r["ttft_s"] for r in ok if r["request_id"].endswith(".t0") and r["ttft_s"] is not None]
    itl_ms = [gap * 1000 for r in ok for gap in r["itl_s"]]
    return {"side": name, "summary": str(out / "summary.json"), "wall_s": round(wall_s, 1), "ok_records": ok,
            "itl_p50_ms": percentile(itl_ms, 50) if itl_ms else None,
            "itl_p99_ms": percentile(itl_ms, 99) if itl_ms else None,
            "requests": len(records), "ok": len(ok), "turns_2plus": len(later),
            "mean_ttft_turn1_s": sum(first) / len(first) if first else None,
            "mean_ttft_turn2plus_s": sum(later) / len(later) if later else None,
            "pd_bytes_per_turn": delta["pd_bytes"] / len(ok) if ok else None,
            "router_hit_ratio": delta["cached_tokens"] / delta["prompt_tokens"] if delta["prompt_tokens"] else None,
            "node_hit_ratio": delta["node_hit_tokens"] / delta["node_queried_tokens"]
            if delta["node_queried_tokens"] else None, **{k: delta[k] for k in delta}}


def on_common_requests(off_ok: list[dict], on_ok: list[dict]) -> dict:
    """The client-side figures over the requests both sides completed (by request id): a closed loop cut at
    --max-requests can send a few different requests on each side (which session forks first depends on
    timing), and one long turn more on one side moves a mean or a p99 of about a hundred gaps."""
    off_by_id = {r["request_id"]: r for r in off_ok}
    on_by_id = {r["request_id"]: r for r in on_ok}
    common = sorted(off_by_id.keys() & on_by_id.keys())

    def figures(by_id: dict) -> dict:
        rows = [by_id[i] for i in common]
        later = [r["ttft_s"] for r in rows if not r["request_id"].endswith(".t0") and r["ttft_s"] is not None]
        itl_ms = [gap * 1000 for r in rows for gap in r["itl_s"]]
        return {"mean_ttft_turn2plus_s": sum(later) / len(later) if later else None,
                "itl_p99_ms": percentile(itl_ms, 99) if itl_ms else None}

    return {"requests": len(common), "only_off": sorted(off_by_id.keys() - on_by_id.keys()),
            "only_on": sorted(on_by_id.keys() - off_by_id.keys()), "off": figures(off_by_id),
            "on": figures(on_by_id)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(off: dict, on: dict) -> str:
    rows = ["requests", "ok", "turns_2plus", "mean_ttft_turn1_s", "mean_ttft_turn2plus_s", "pd_bytes_per_turn",
            "blocks_read", "blocks_reused", "router_hit_ratio", "node_hit_ratio", "prefill_skipped",
            "evicted_blocks", "itl_p50_ms", "itl_p99_ms", "wall_s"]

    def cell(value) -> str:
        return "-" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))

    lines = [f"{'':<24}{'cache off':>14}{'cache on':>14}", "-" * 52]
    lines += [f"{row:<24}{cell(off.get(row)):>14}{cell(on.get(row)):>14}" for row in rows]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH, help="cluster config (the reference topology)")
    p.add_argument("--out", type=Path, default=Path("agent-sessions-out"))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--duration", type=float, default=900.0,
                   help="seconds per side at most: long enough that the cache-off side also runs all --max-requests "
                        "(else the two means cover different turns; the headline says whether they match)")
    p.add_argument("--max-requests", type=int, default=40)
    p.add_argument("--system-len", default="512")
    p.add_argument("--task-len", default="lognormal:256,0.5")
    p.add_argument("--tool-len", default="lognormal:96,0.5")
    p.add_argument("--output-len", default="16")
    p.add_argument("--turns", default="uniform:4,8")
    p.add_argument("--think-time", default="exp:0.5")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--disagg-min-uncached-tokens", type=int, default=2048,
                   help="router setting on both sides: a turn whose decode instance can resume all but fewer prompt "
                        "tokens is computed there instead of through a P leg (which ships the whole KDA state "
                        "again: 384 KiB per request at TP1 for kimi-k3.1-mini); the config's value with -1")
    args = p.parse_args()
    if args.disagg_min_uncached_tokens < 0:
        args.disagg_min_uncached_tokens = None
    args.out.mkdir(parents=True, exist_ok=True)
    off = side(False, args)
    on = side(True, args)
    compare = subprocess.run([sys.executable, "-m", "pdcluster.cli", "loadgen", "compare", off["summary"],
                              on["summary"]], cwd=ROOT, capture_output=True, text=True).stdout
    common = on_common_requests(off.pop("ok_records"), on.pop("ok_records"))
    ttft = _ratio(common["on"]["mean_ttft_turn2plus_s"], common["off"]["mean_ttft_turn2plus_s"])
    reduction = _ratio(off["pd_bytes_per_turn"], on["pd_bytes_per_turn"])
    itl = _ratio(common["on"]["itl_p99_ms"], common["off"]["itl_p99_ms"])
    headline = {"metric": "ttft_turn2plus_ratio", "value": ttft, "goal": 0.3,
                "pd_bytes_per_turn_reduction": reduction, "pd_bytes_goal": 5.0, "hit_ratio": on["router_hit_ratio"],
                "same_requests": off["requests"] == on["requests"] == off["ok"] == on["ok"] == common["requests"],
                "common_requests": common["requests"],
                "meets_ttft_goal": ttft is not None and ttft <= 0.3,
                "meets_bytes_goal": reduction is not None and reduction >= 5,
                "itl_p99_ratio": itl, "itl_p99_goal": 1.2, "meets_itl_goal": itl is not None and itl <= 1.2}
    print(table(off, on))
    print(f"\nover the {common['requests']} requests both sides completed (the headline's TTFT and ITL): mean TTFT "
          f"turns >= 2 {common['off']['mean_ttft_turn2plus_s']:.4g} s / {common['on']['mean_ttft_turn2plus_s']:.4g} s, "
          f"ITL p99 {common['off']['itl_p99_ms']:.4g} / {common['on']['itl_p99_ms']:.4g} ms; only cache off: "
          f"{common['only_off'] or '-'}; only cache on: {common['only_on'] or '-'}")
    print("\nheadline:", json.dumps(headline))
    print("\nloadgen compare (A = cache off, B = cache on):\n" + compare)
    if args.json:
        args.json.write_text(json.dumps({"headline": headline, "cache_off": off, "cache_on": on, "common": common,
                                         "compare": compare, "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
