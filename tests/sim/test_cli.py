"""`pdcluster sim`: loadgen's flags and outputs, the same request stream as loadgen, refusals naming the bad input."""

from __future__ import annotations

import json

import pytest

from cluster.config import DEFAULT_CONFIG_PATH, load_config
from loadgen.cli_compare import main_compare
from loadgen.summary import load_summary
from sim.calibrate import main_calibrate, run_points
from sim.cli import main
from tests.sim.helpers import profile

ARGS = ["--scenario", "agentx", "--concurrency", "1,2", "--duration", "20", "--seed", "3", "--no-plots",
        "--turns", "uniform:2,3", "--max-context", "2000"]


def _profile_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(profile(base_s=0.01, token_s=1e-4, seq_s=1e-3, kind="bytes").model_dump_json())
    return path


def test_writes_loadgen_summary_with_loadgens_schedule(tmp_path, capsys) -> None:
    out = tmp_path / "sim"
    assert main([*ARGS, "--profile", str(_profile_file(tmp_path)), "--out", str(out)]) == 0
    summary = load_summary(out / "summary.json")
    assert [lv.concurrency for lv in summary.levels] == [1, 2] and all(lv.num_ok for lv in summary.levels)
    assert summary.run.url.startswith("sim:default.yaml@")
    from loadgen.cli import main as loadgen_main

    capsys.readouterr()
    assert loadgen_main([*ARGS, "--dry-run"]) == 0
    assert summary.run.schedule_hash in capsys.readouterr().out  # the very stream loadgen would send
    assert main_compare([str(out), str(out)]) == 0
    assert (out / "report.md").exists()


def test_refuses_client_flags_and_bad_profiles(tmp_path, capsys) -> None:
    good = str(_profile_file(tmp_path))
    assert main([*ARGS, "--profile", good, "--api-key", "k", "--out", str(tmp_path / "x")]) == 2
    assert "--api-key" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    data = json.loads(open(good).read())
    data["steps"][0]["base_s"] = -1
    bad.write_text(json.dumps(data))
    assert main([*ARGS, "--profile", str(bad), "--out", str(tmp_path / "y")]) == 2
    assert "steps.0.base_s" in capsys.readouterr().err
    missing = tmp_path / "missing.json"
    data["steps"] = [s for s in data["steps"] if (s["tp"], s["dcp"]) != (1, 2)]
    data["steps"][0]["base_s"] = 0.01
    missing.write_text(json.dumps(data))
    assert main([*ARGS, "--profile", str(missing), "--out", str(tmp_path / "z")]) == 2
    assert "no step cost for tp=1 dcp=2" in capsys.readouterr().err


def test_calibrate_refuses_repeat_where_nothing_is_measured(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main_calibrate(["--figures", "gb300", "--repeat", "3", "--out", str(tmp_path / "p.json")])
    assert "--repeat" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--repeat must be at least 1, got 0"):
        run_points(load_config(DEFAULT_CONFIG_PATH), (), tmp_path, repeat=0)
    with pytest.raises(ValueError, match="--rounds must be at least 1, got 0"):
        run_points(load_config(DEFAULT_CONFIG_PATH), (), tmp_path, rounds=0)
    with pytest.raises(SystemExit):
        main_calibrate(["--figures", "gb300", "--rounds", "3", "--out", str(tmp_path / "p.json")])
    assert "--rounds" in capsys.readouterr().err


def test_calibrate_measures_every_point_by_default(monkeypatch, tmp_path) -> None:
    """The full calibration and --quick both measure the DCP gather point (a full run of 2026-12-06 02:55 left it
    out: only QUICK named it)."""
    import sim.calibrate
    from sim.calibrate import DCP_RESUME, POINTS

    asked = []

    def capture(config, names, *args):
        asked.append(names)
        raise RuntimeError("stop here")

    monkeypatch.setattr(sim.calibrate, "run_points", capture)
    for extra in ([], ["--quick"]):
        assert main_calibrate(["--out", str(tmp_path / "p.json"), "--work-dir", str(tmp_path), *extra]) == 2
    full, quick = asked
    assert set(full) == {p.name for p in POINTS} | {DCP_RESUME.name} and DCP_RESUME.name in quick
