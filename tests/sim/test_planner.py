"""The planner: SLO parsing, candidates, a small search end to end, and its Helm values rendered by the real chart
over the GB300 values (helm from .tools/bin, as tests/deploy render it)."""

from __future__ import annotations

import pytest
import yaml

from sim.helm_values import render_values
from sim.planner import Outcome, Shape, candidates, load_workload, parse_objectives, winner
from sim.plan_cli import main as plan_main
from sim.profile import resolve_profile


def test_objectives_parse_and_refuse() -> None:
    got = parse_objectives("ttft_p99=2s,tpot_p50=30ms")
    assert [(o.metric, o.percentile, o.limit_ms) for o in got] == [("ttft", 99, 2000.0), ("tpot", 50, 30.0)]
    for bad in ("ttft_p95=2s", "ttfb_p99=2s", "ttft_p99=2", ""):
        with pytest.raises(ValueError, match="slo"):
            parse_objectives(bad)


def test_candidates_use_every_gpu_and_only_profiled_parallelism() -> None:
    profile = resolve_profile("gb300-k31-pro")
    shapes = candidates(64, profile)
    assert shapes and all(s.gpus == 64 for s in shapes)
    assert {s.prefill_tp for s in shapes} == {4, 8}
    assert all(8 <= s.prefill_tp * s.num_prefill <= 32 for s in shapes)


def test_workload_file_takes_only_loadgen_flags(tmp_path) -> None:
    good = tmp_path / "w.yaml"
    good.write_text(yaml.safe_dump({"scenario": "random", "concurrency": 4, "duration": 5, "input-len": "64"}))
    assert load_workload(good).concurrency == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"scenario": "random", "url": "http://x"}))
    with pytest.raises(ValueError, match="'url' is not a loadgen workload flag"):
        load_workload(bad)


def test_capacity_plan_unchanged_without_workload(capsys) -> None:
    assert plan_main(["--model", "kimi-k3.1-pro", "--gpu", "gb300", "--gpus", "8", "--parallel", "tp8"]) == 0
    assert "tokens_per_instance" in capsys.readouterr().out


def test_search_end_to_end_writes_values(tmp_path) -> None:
    workload = tmp_path / "w.yaml"
    workload.write_text(yaml.safe_dump({"scenario": "random", "concurrency": 8, "duration": 3, "input-len": "2000",
                                        "output-len": "32", "seed": 1}))
    values, table = tmp_path / "plan.yaml", tmp_path / "plan.json"
    rc = plan_main(["--workload", str(workload), "--slo", "ttft_p99=2s,tpot_p50=30ms", "--gpus", "16",
                    "--gpu", "gb300", "--top", "1", "--values-out", str(values), "--json", str(table)])
    assert rc == 0
    rows = yaml.safe_load(table.read_text())
    assert sum(r["winner"] for r in rows) == 1 and any(r["on_frontier"] for r in rows)
    pools = yaml.safe_load(values.read_text())["pools"]
    assert sum(p["replicas"] * max(p["tp"], p["dcp"]) for p in pools) == 16


@pytest.mark.process
def test_plan_values_render_over_the_gb300_values(tmp_path) -> None:
    from tests.deploy.helm_support import arg_value, render

    shape = Shape(prefill_tp=4, num_prefill=4, num_tp8=5, num_dcp8=1, chunk=4096)
    outcome = Outcome(shape, level=None, goodput_tok_s_per_gpu=1.0, attainment=1.0,  # type: ignore[arg-type]
                      latencies={"ttft_p99": 1000.0}, meets_slo=True)
    path = tmp_path / "plan.yaml"
    path.write_text(render_values(outcome, 131072, 128, "ttft_p99=2s", "gb300-k31-pro"))
    out = render("values-gb300-tp8-dcp8.yaml", path)
    sets = {d["metadata"]["labels"]["pdcluster.io/pool"]: d for d in out.of_kind("LeaderWorkerSet")}
    deployments = {d["metadata"]["labels"].get("pdcluster.io/pool"): d for d in out.of_kind("Deployment")}
    assert sets["decode-tp8"]["spec"]["replicas"] == 5 and sets["decode-dcp8"]["spec"]["replicas"] == 1
    assert deployments["prefill-tp4"]["spec"]["replicas"] == 4  # TP4 fits one 4-GPU node: a Deployment
    (dcp,) = [p for p in out.pool_pods("decode-dcp8") if p.part == "leader"]
    assert arg_value(dcp.container["args"], "--decode-context-parallel-size") == "8"
    (prefill,) = out.pool_pods("prefill-tp4")
    assert arg_value(prefill.container["args"], "--tensor-parallel-size") == "4"
    assert arg_value(prefill.container["args"], "--max-num-batched-tokens") == "4096"
    assert winner([outcome]) is outcome
