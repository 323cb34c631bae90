"""`pdcluster loadgen` against the real `pdcluster up` cluster: a short agentx sweep through the router.

Runs the CLI as a subprocess (through the `pdcluster` dispatcher), then checks that every report file
exists and is complete, that no request failed, that token counts came from the router's usage chunks,
and that the percentiles in summary.json and report.md equal those recomputed from the raw per-request
chunk times. Needs the `cluster` fixture of tests/e2e/conftest.py (a missing fixture is an error).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadgen.summary import load_summary
from tests.loadgen.helpers import check_report_matches_records

pytestmark = pytest.mark.e2e

PLOTS = ("pareto.png", "ttft_cdf.png", "tpot_cdf.png", "throughput.png")
MAX_TOKENS = 4


def test_loadgen_agentx_sweep_through_router(cluster, tmp_path):
    out = tmp_path / "agentx"
    cmd = [sys.executable, "-m", "pdcluster.cli", "loadgen", "--url", cluster.router_url, "--model", cluster.model,
           "--scenario", "agentx", "--concurrency", "1,2", "--duration", "120", "--max-requests", "6",
           "--drain", "120", "--request-timeout", "120", "--system-len", "6", "--task-len", "uniform:4,8",
           "--tool-len", "uniform:2,6", "--output-len", str(MAX_TOKENS), "--turns", "uniform:2,3",
           "--think-time", "exp:0.05", "--subagent-prob", "0.5", "--subagents", "2", "--subagent-turns", "1",
           "--slo", "ttft=60000,tpot=10000", "--gpus", "5", "--seed", "1", "--out", str(out), "--progress", "off"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"loadgen failed:\n{proc.stdout}\n{proc.stderr}"

    summary = load_summary(out / "summary.json")
    assert [lv.concurrency for lv in summary.levels] == [1, 2] and summary.aborted is None
    for lv in summary.levels:
        assert lv.num_requests == 6 and lv.num_ok == 6, lv.errors_by_kind
        assert all(r.tokens_from_usage and 1 <= r.output_tokens <= MAX_TOKENS for r in lv.records)
        assert all(r.session_id and r.session_id.startswith("agentx-1-") for r in lv.records)
        assert lv.ttft_ms.count == 6 and lv.e2e_ms.count == 6 and lv.total_tok_s_per_gpu > 0
        assert lv.goodput_req_s is not None
    assert len(summary.pareto) == 2 and all(p.tok_s_per_gpu > 0 for p in summary.pareto)
    assert sorted(summary.plots) == sorted(PLOTS)
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    report = (out / "report.md").read_text()
    for heading in ("## Pareto points", "## Concurrency 1", "## Concurrency 2", "## Plots"):
        assert heading in report
    assert summary.run.schedule_hash in report
    check_report_matches_records(out)
    raw = json.loads((out / "summary.json").read_text())
    assert len(raw["levels"][1]["records"]) == 6 and raw["levels"][1]["records"][0]["chunk_s"]
    print(proc.stdout)
