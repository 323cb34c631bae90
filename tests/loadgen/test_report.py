"""Reports without a server: compare table and CLI, progress bar on/off, summary loading errors."""

from __future__ import annotations

import io

from loadgen.cli import main
from loadgen.compare import compare_table, ratio
from loadgen.metrics import summarize_level
from loadgen.progress import Progress
from loadgen.report import render_report
from loadgen.slo import SLO
from loadgen.summary import RunInfo, Summary, write_summary
from tests.loadgen.helpers import record


def _summary(step: float, schedule: str = "abc123", levels=(1, 4)) -> Summary:
    run = RunInfo(url="http://x", endpoint="chat", model="m", scenario="random", seed=0,
                  concurrency_levels=list(levels), duration_s=1.0, schedule_hash=schedule, schedule_units=4,
                  started_at="2026-01-01T00:00:00+00:00")
    summary = Summary(run=run)
    for conc in levels:
        recs = [record(f"r{conc}.{i}", [0.1 + step * k for k in range(5)], n=5) for i in range(conc)]
        summary.levels.append(summarize_level(conc, recs, 1.0, SLO(ttft_ms=150), gpus=1))
    summary.refresh()
    return summary


def test_compare_table_ratios():
    a, b = _summary(0.02), _summary(0.01)
    table = compare_table(a, b)
    lines = {line.split("  ")[0].strip(): line for line in table.splitlines()}
    assert "concurrency 1" in table and "concurrency 4" in table
    tpot = [line for line in table.splitlines() if line.startswith("TPOT p50 ms")]
    assert len(tpot) == 2 and all(line.split()[-1] == "0.50x" for line in tpot)
    user = [line for line in table.splitlines() if line.startswith("per-user tok/s p50")]
    assert all(line.split()[-1] == "2.00x" for line in user)
    assert "schedule hashes differ" not in table and lines
    errors = [line for line in table.splitlines() if line.startswith("errors")]
    assert errors and all(line.split()[1:] == ["0", "0", "="] for line in errors)


def test_compare_notes_different_streams_and_unmatched_levels():
    table = compare_table(_summary(0.02, "aaa", (1, 4)), _summary(0.02, "bbb", (4, 16)))
    assert "schedule hashes differ" in table
    assert "concurrency 4" in table and "concurrency 1\n" not in table
    assert "only in A [1], only in B [16]" in table
    assert ratio(0.0, 0.0) == "=" and ratio(0.0, 1.0) == "inf" and ratio(None, 1.0) == "-"


def test_compare_cli(tmp_path, capsys):
    write_summary(_summary(0.02), tmp_path / "a")
    write_summary(_summary(0.01), tmp_path / "b")
    assert main(["compare", str(tmp_path / "a" / "summary.json"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "B/A" in out and "2.00x" in out
    (tmp_path / "junk.json").write_text('{"not": "a summary"}')
    assert main(["compare", str(tmp_path / "junk.json"), str(tmp_path / "b")]) == 2
    assert "is not a loadgen summary.json" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "missing.json"), str(tmp_path / "b")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_report_mentions_abort_and_bad_lines():
    summary = _summary(0.02)
    summary.aborted = "interrupted during concurrency 4; that level is partial"
    summary.input_errors = ["t.jsonl: line 3: not JSON"]
    text = render_report(summary)
    assert "Run stopped early" in text and "line 3: not JSON" in text and "## Concurrency 4" in text


def test_progress_only_on_tty_unless_forced():
    recs = [record("a", [0.1, 0.2], n=2)]
    quiet = io.StringIO()
    Progress(stream=quiet).update(4, 1.0, 10.0, recs, 2, force=True)
    assert quiet.getvalue() == ""  # StringIO is not a terminal

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    bar = Progress(stream=tty)
    bar.update(4, 5.0, 10.0, recs, 2, force=True)
    bar.update(4, 5.1, 10.0, recs, 2)  # within the redraw interval: skipped
    bar.finish()
    text = tty.getvalue()
    assert text.count("\r") == 1 and "c=4" in text and "ok 1" in text and "in-flight 2" in text
    assert "#" * 12 + "." * 12 in text and text.endswith("\n")


def test_compare_counts_logprob_mismatches():
    """Two runs of the same schedule with recorded log-probs: token and log-prob mismatches are counted exactly."""
    from loadgen.compare import logprob_mismatches

    a, b = _summary(0.02), _summary(0.02)
    assert "not recorded" in compare_table(a, b)
    for summary in (a, b):
        for lv in summary.levels:
            for rec in lv.records:
                rec.tokens, rec.logprobs = ["x", "y", "z"], [-1.5, -0.25, -3.0]
    assert logprob_mismatches(a, b).num_logprob_mismatches == 0
    assert "0 token mismatches, 0 log-prob mismatches" in compare_table(a, b)
    first = b.levels[0].records[0]
    first.logprobs = [-1.5, -0.25000000000000006, -3.0]  # one ulp apart: a mismatch
    b.levels[-1].records[-1].tokens = ["x", "q", "z"]
    m = logprob_mismatches(a, b)
    assert (m.num_requests, m.num_tokens, m.num_logprob_mismatches, m.num_token_mismatches) == (5, 15, 1, 1)
