"""End-to-end runs of `pdcluster loadgen` against a real uvicorn process serving the streaming stub.

The stub (a test double, tests/loadgen/stub_server.py) streams on a known clock, so measured TTFT, ITL
and TPOT are checked against the delays it was told to use; it also injects HTTP errors, dropped
connections and missing usage chunks.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time

import pytest

from loadgen.cli import main
from loadgen.summary import load_summary
from tests.conftest import REPO_ROOT, free_port
from tests.loadgen.conftest import start_stub
from tests.loadgen.helpers import check_report_matches_records

FAST = ["--input-len", "uniform:5,15", "--no-plots", "--progress", "off"]


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def ok_records(summary):
    return [r for lv in summary.levels for r in lv.records if r.is_ok]


@pytest.mark.process
def test_timing_matches_known_delays(stub, tmp_path, capsys):
    stub.configure(ttft_s=0.15, itl_s=0.03)
    rc, out, err = run(capsys, "--url", stub.url, "--scenario", "random", "--output-len", "6", "--concurrency", "1",
                       "--duration", "30", "--max-requests", "4", "--out", tmp_path, *FAST)
    assert rc == 0, err
    level = load_summary(tmp_path / "summary.json").levels[0]
    recs = sorted(level.records, key=lambda r: r.start_s)
    log = stub.log()
    assert len(recs) == len(log) == 4 and all(r.is_ok for r in recs)
    # The stub emits token i at its arrival + 0.15 + 0.03 i and logs the wall-clock times: the client's
    # clock must agree with that (causality both ways), whatever the machine's load.
    for rec, entry in zip(recs, log):  # concurrency 1: the stub saw the requests in start order
        sent = level.started_unix + rec.start_s
        seen = [level.started_unix + t for t in rec.chunk_s]
        assert sent <= entry["arrival_unix"] + 0.005
        assert len(seen) == len(entry["emit_unix"]) == 6
        assert all(client >= server - 0.005 for client, server in zip(seen, entry["emit_unix"]))
        # the role chunk arrives at once and must not count as the first token
        assert rec.ttft_s >= 0.15 - 0.005 and rec.e2e_s >= 0.15 + 5 * 0.03 - 0.005
        assert rec.ttft_s >= entry["emit_unix"][0] - entry["arrival_unix"] - 0.005
        assert rec.output_tokens == 6 and rec.tokens_from_usage
        assert rec.tpot_s == pytest.approx(sum(rec.itl_s) / 5)
    # typical values, with slack for a loaded machine
    assert statistics.median(r.ttft_s for r in recs) == pytest.approx(0.15, abs=0.25)
    assert statistics.median(g for r in recs for g in r.itl_s) == pytest.approx(0.03, abs=0.02)
    assert {e["max_tokens"] for e in log} == {6} and all(e["ignore_eos"] for e in log)
    assert "TTFT p50" in out


@pytest.mark.process
def test_bundled_chunks_with_and_without_usage(stub, tmp_path, capsys):
    stub.configure(ttft_s=0.05, itl_s=0.02, tokens_per_chunk=3)
    rc, _, err = run(capsys, "--url", stub.url, "--scenario", "random", "--output-len", "7", "--endpoint",
                     "completions", "--duration", "30", "--max-requests", "3", "--out", tmp_path / "usage", *FAST)
    assert rc == 0, err
    recs = ok_records(load_summary(tmp_path / "usage" / "summary.json"))
    assert recs and all(r.output_tokens == 7 and len(r.chunk_s) == 3 and len(r.itl_s) == 2 for r in recs)
    assert all(r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 6) for r in recs)
    assert {e["endpoint"] for e in stub.log()} == {"completions"}

    stub.configure(ttft_s=0.05, itl_s=0.02, tokens_per_chunk=3, include_usage=False)
    rc, _, err = run(capsys, "--url", stub.url, "--scenario", "random", "--output-len", "7", "--endpoint",
                     "completions", "--duration", "30", "--max-requests", "3", "--out", tmp_path / "chunks", *FAST)
    summary = load_summary(tmp_path / "chunks" / "summary.json")
    recs = ok_records(summary)
    assert rc == 0 and recs
    assert all(r.output_tokens == 3 and not r.tokens_from_usage and r.completion_tokens is None for r in recs)
    assert summary.levels[0].num_counted_by_chunks == len(recs)


@pytest.mark.process
def test_errors_and_disconnects_by_kind(stub, tmp_path, capsys):
    stub.configure(ttft_s=0.02, itl_s=0.005, error_every=3, error_status=503, disconnect_every=4, disconnect_after=2)
    rc, out, err = run(capsys, "--url", stub.url, "--scenario", "random", "--output-len", "5", "--concurrency", "2",
                       "--duration", "30", "--max-requests", "12", "--out", tmp_path, *FAST)
    assert rc == 0, err
    level = load_summary(tmp_path / "summary.json").levels[0]
    served = [e["n"] for e in stub.log()]
    assert len(served) == level.num_requests == 12
    expect_503 = sum(1 for n in served if n % 3 == 0)
    expect_drop = sum(1 for n in served if n % 4 == 0 and n % 3 != 0)
    assert level.errors_by_kind == {"disconnect": expect_drop, "http_503": expect_503}
    assert level.num_ok == len(served) - expect_503 - expect_drop
    drops = [r for r in level.records if r.error_kind == "disconnect"]
    assert all(len(r.chunk_s) == 2 and r.ttft_s is None for r in drops)  # partial stream kept, not measured
    assert all("injected error" in r.error and r.http_status == 503
               for r in level.records if r.error_kind == "http_503")
    assert level.ttft_ms.count == level.num_ok
    assert "errors: disconnect" in out


@pytest.mark.process
def test_non_streaming_answer_is_a_bad_response(stub, tmp_path, capsys):
    stub.configure(plain_json=True)
    rc, _, err = run(capsys, "--url", stub.url, "--scenario", "random", "--output-len", "3", "--duration", "30",
                     "--max-requests", "2", "--out", tmp_path, *FAST)
    level = load_summary(tmp_path / "summary.json").levels[0]
    assert rc == 1 and level.errors_by_kind == {"bad_response": 2}
    assert "without SSE data lines" in level.records[0].error and "application/json" in level.records[0].error


@pytest.mark.process
def test_cancelled_streams(stub, tmp_path, capsys):
    stub.configure(ttft_s=0.02, itl_s=0.01)
    rc, _, err = run(capsys, "--url", stub.url, "--scenario", "agentx", "--cancel-prob", "1", "--output-len", "8",
                     "--system-len", "10", "--task-len", "10", "--tool-len", "5", "--think-time", "0",
                     "--subagent-prob", "0", "--duration", "30", "--max-requests", "4", "--out", tmp_path / "interrupt",
                     *FAST)
    level = load_summary(tmp_path / "interrupt" / "summary.json").levels[0]
    assert rc == 1 and "no request succeeded" in err  # every reply was interrupted by the client
    assert level.num_cancelled == level.num_requests == 4 and level.errors_by_kind == {"cancelled": 4}
    assert all(len(r.chunk_s) == 4 for r in level.records)

    stub.configure(ttft_s=0.02, itl_s=2.0)  # the second token is due 2 s after arrival: never seen
    rc, _, err = run(capsys, "--url", stub.url, "--scenario", "random", "--output-len", "50", "--concurrency", "3",
                     "--duration", "0.2", "--drain", "0.6", "--out", tmp_path / "drain", *FAST)
    level = load_summary(tmp_path / "drain" / "summary.json").levels[0]
    assert level.num_cancelled == 3 and all("drain deadline" in r.error for r in level.records)
    assert all(len(r.chunk_s) <= 1 for r in level.records) and level.ttft_ms.count == 0
    assert level.duration_s < 1.9


@pytest.mark.process
def test_agentx_sessions_reports_and_plots(stub, tmp_path, capsys):
    stub.configure(ttft_s=0.03, itl_s=0.005)
    rc, out, err = run(capsys, "--url", stub.url, "--scenario", "agentx", "--concurrency", "1,3", "--duration", "20",
                       "--max-requests", "12",
                       "--output-len", "uniform:3,8", "--system-len", "40", "--task-len", "20", "--tool-len", "10",
                       "--think-time", "exp:0.02", "--subagent-prob", "0.5", "--turns", "uniform:2,5",
                       "--slo", "ttft=200,tpot=50", "--gpus", "1+1", "--seed", "11", "--out", tmp_path,
                       "--progress", "off")
    assert rc == 0, err
    summary = load_summary(tmp_path / "summary.json")
    assert [lv.concurrency for lv in summary.levels] == [1, 3] and len(summary.pareto) == 2
    log = stub.log()
    assert all(e["session_id"] and e["session_id"].startswith("agentx-11-") for e in log)
    sessions = {e["session_id"] for e in log}
    assert len(sessions) >= 3
    first = [e["num_messages"] for e in log if e["session_id"] == "agentx-11-0"]
    assert len(first) >= 2 and first[0] == 2 and max(first) > 2  # system + task, then a growing conversation
    for name in ("summary.json", "report.md", "pareto.png", "ttft_cdf.png", "tpot_cdf.png", "throughput.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    for name in summary.plots:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    raw = json.loads((tmp_path / "summary.json").read_text())
    assert raw["run"]["schedule_hash"] == summary.run.schedule_hash and raw["levels"][0]["records"]
    lv = summary.levels[1]
    assert lv.total_tok_s_per_gpu == pytest.approx(lv.total_tok_s / 2)
    assert lv.output_tok_s_per_decode_gpu == pytest.approx(lv.output_tok_s) and lv.prefill_gpus == 1
    assert lv.goodput_req_s is not None and lv.goodput_req_s <= lv.request_throughput
    check_report_matches_records(tmp_path)
    # the run's schedule hash is the one --dry-run prints for the same flags
    rc, dry, _ = run(capsys, "--scenario", "agentx", "--dry-run", "--output-len", "uniform:3,8", "--system-len", "40",
                     "--task-len", "20", "--tool-len", "10", "--think-time", "exp:0.02", "--subagent-prob", "0.5",
                     "--turns", "uniform:2,5", "--seed", "11")
    assert rc == 0 and f"schedule hash {summary.run.schedule_hash}" in dry


@pytest.mark.process
def test_progress_bar_forced_on_and_auto_off(stub, tmp_path, capsys):
    stub.configure(ttft_s=0.01, itl_s=0.2)
    base = ["--url", stub.url, "--scenario", "random", "--output-len", "4", "--input-len", "5", "--duration", "30",
            "--max-requests", "2", "--no-plots"]
    rc, _, err = run(capsys, *base, "--out", tmp_path / "on", "--progress", "on")
    assert rc == 0 and "\rc=1" in err and "in-flight" in err and err.endswith("\n")
    rc, _, err = run(capsys, *base, "--out", tmp_path / "auto")  # captured stderr is not a terminal
    assert rc == 0 and "\r" not in err


@pytest.mark.process
def test_trace_replay_open_loop_with_bad_lines(stub, tmp_path, capsys):
    stub.configure(ttft_s=0.02, itl_s=0.005)
    trace = tmp_path / "trace.jsonl"
    rows = [json.dumps({"timestamp": 1000 + 200 * i, "input_length": 40, "output_length": 3, "hash_ids": [1, 2, i]})
            for i in range(6)]
    rows.insert(2, '{"timestamp": 5, "input_length": 3')
    rows.insert(4, '{"timestamp": 5, "input_length": 3, "output_length": "x", "hash_ids": []}')
    trace.write_text("\n".join(rows) + "\n")
    rc, _, err = run(capsys, "--url", stub.url, "--scenario", "trace", "--trace", trace, "--trace-block-size", "16",
                     "--trace-speed", "2", "--concurrency", "4", "--duration", "5", "--out", tmp_path / "out", *FAST)
    assert rc == 0, err
    assert "skipping" in err and "line 3" in err and "line 5" in err
    summary = load_summary(tmp_path / "out" / "summary.json")
    assert len(summary.input_errors) == 2 and "output_length must be an integer" in summary.input_errors[1]
    recs = sorted(summary.levels[0].records, key=lambda r: r.start_s)
    assert len(recs) == 6 and all(r.is_ok for r in recs)
    for i, r in enumerate(recs):  # sent on the trace's clock: 100 ms apart at speed 2
        assert 0.1 * i - 0.005 <= r.start_s <= 0.1 * i + 0.5
    assert "Skipped 2 bad input line(s)" in (tmp_path / "out" / "report.md").read_text()


def test_unreachable_url_is_clear_and_leaves_summary(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    rc, _, err = run(capsys, "--url", url, "--scenario", "random", "--duration", "1", "--out", tmp_path, *FAST)
    assert rc == 1 and f"cannot reach {url}" in err and "summary.json" in err
    summary = load_summary(tmp_path / "summary.json")
    assert summary.aborted.startswith(f"cannot reach {url}") and summary.levels == []
    assert "Run stopped early" in (tmp_path / "report.md").read_text()


@pytest.mark.process
def test_server_dies_mid_run_keeps_partial_results(tmp_path, capsys):
    own = start_stub()
    try:
        own.configure(ttft_s=0.01, itl_s=0.005, exit_after=2)  # the process dies after its second reply
        rc, out, err = run(capsys, "--url", own.url, "--scenario", "random", "--output-len", "4", "--concurrency",
                           "1,2", "--duration", "0.8", "--out", tmp_path, *FAST)
    finally:
        own.stop()
    assert rc == 0, err
    levels = load_summary(tmp_path / "summary.json").levels
    assert len(levels) == 2 and sum(lv.num_ok for lv in levels) == 2
    for lv in levels:
        assert set(lv.errors_by_kind) <= {"connect", "disconnect"} and lv.num_errors == lv.num_requests - lv.num_ok
        # a dead endpoint does not make the slots spin: each waits CONNECT_BACKOFF_S before its next attempt
        assert lv.num_requests - lv.num_ok <= lv.concurrency * (0.8 / 0.2 + 2)
    assert levels[1].num_ok == 0 and levels[1].errors_by_kind.get("connect", 0) >= 1  # gone by level 2
    assert "c=2 errors:" in out and (tmp_path / "report.md").exists()
    assert any("cannot connect to" in r.error for r in levels[1].records)


@pytest.mark.process
def test_interrupt_keeps_partial_level(stub, tmp_path):
    stub.configure(ttft_s=0.01, itl_s=0.05)
    cmd = [sys.executable, "-m", "pdcluster.cli", "loadgen", "--url", stub.url, "--scenario", "random",
           "--output-len", "4", "--input-len", "5", "--concurrency", "2,4", "--duration", "60", "--no-plots",
           "--progress", "off", "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(stub.log()) < 6 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 130 and "interrupted; partial results in" in err
    summary = load_summary(tmp_path / "summary.json")
    assert summary.aborted == "interrupted during concurrency 2; that level is partial"
    (level,) = summary.levels
    assert level.num_ok >= 4 and level.num_requests >= level.num_ok
    assert set(level.errors_by_kind) <= {"cancelled"}  # streams cut by the interrupt are kept as cancelled
    assert "Run stopped early" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("argv, fragment", [
    (["--url", "http://127.0.0.1:9", "--slo", "ttft=fast"], "--slo: invalid SLO 'ttft=fast'"),
    (["--url", "http://127.0.0.1:9", "--slo", "speed=3"], "unknown metric 'speed'"),
    (["--scenario", "random"], "--url is required"),
    (["--url", "127.0.0.1:9"], "must start with http://"),
    (["--url", "http://127.0.0.1:9", "--scenario", "trace"], "needs --trace FILE"),
    (["--url", "http://127.0.0.1:9", "--scenario", "trace", "--trace", "/nonexistent/t.jsonl"], "cannot read trace"),
    (["--url", "http://127.0.0.1:9", "--output-len", "uniform:9,1"], "--output-len: uniform needs LO <= HI"),
])
def test_bad_flags(capsys, argv, fragment):
    rc, _, err = run(capsys, *argv, "--no-plots")
    assert rc == 2 and fragment in err


def test_trace_with_only_bad_lines(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("nope\n{}\n")
    rc, _, err = run(capsys, "--url", "http://127.0.0.1:9", "--scenario", "trace", "--trace", trace)
    assert rc == 2 and "has no valid line (2 bad)" in err and "line 1: not JSON" in err


@pytest.mark.parametrize("value", ["0", "2+x", "1+2+3", "-1"])
def test_bad_gpus_flag(capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://x", f"--gpus={value}"])
    assert exc.value.code == 2 and "--gpus wants G or P+D" in capsys.readouterr().err


def test_bad_concurrency_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://x", "--concurrency", "1,a"])
    assert exc.value.code == 2 and "--concurrency wants integers" in capsys.readouterr().err
