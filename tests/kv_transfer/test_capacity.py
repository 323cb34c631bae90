"""Capacity planner and `pdcluster plan`: SPEC.md per-token bytes exactly, seed capacity ratios within 1%."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.model.config import get_preset
from kv_transfer.capacity import parse_parallel, plan_capacity
from kv_transfer.cli import main
from kv_transfer.ucx_env import (
    detect_tcp_fallback,
    resolve_error_handling,
    resolve_ucx_tls,
)

PRO = get_preset("kimi-k3.1-pro")


def _plan(parallel, latent="fp8", key="fp8"):
    return plan_capacity(PRO, "gb300", 8, parallel, latent, key)


def test_per_token_bytes_exact():
    assert _plan("tp8").bytes_per_token_per_gpu == 16_992
    assert _plan("tp8", "nvfp4").bytes_per_token_per_gpu == 11_616
    assert _plan("tp8", "nvfp4", "mxfp4").bytes_per_token_per_gpu == 10_080
    assert _plan("dcp8").bytes_per_token_per_gpu == 16_992 / 8


def test_seed_capacities_and_ratios():
    tp, dcp = _plan("tp8"), _plan("dcp8")
    assert abs(tp.tokens_per_instance - 3.04e6) / 3.04e6 < 0.005
    assert abs(dcp.tokens_per_instance - 21.8e6) / 21.8e6 < 0.005
    assert abs(dcp.tokens_per_instance / tp.tokens_per_instance - 21.8 / 3.04) < 0.05  # 7.2x
    nv_tp, nv_dcp = _plan("tp8", "nvfp4"), _plan("dcp8", "nvfp4")
    assert abs(nv_tp.tokens_per_instance / tp.tokens_per_instance - 4.49 / 3.04) / (4.49 / 3.04) < 0.015
    assert abs(nv_dcp.tokens_per_instance / dcp.tokens_per_instance - 32.1 / 21.8) / (32.1 / 21.8) < 0.015
    assert round(tp.full_contexts, 1) == 2.9
    both = _plan("dcp8", "nvfp4", "mxfp4")
    assert both.tokens_per_instance / _plan("tp8", "fp8").tokens_per_instance > 7 * 1.6
    assert 33 < both.full_contexts < 37


def test_parse_parallel():
    assert parse_parallel("tp8") == (8, 1) and parse_parallel("DCP4") == (4, 4)
    for bad in ("pp8", "tp", "dcp0"):
        with pytest.raises(ValueError):
            parse_parallel(bad)


def test_cli_json_and_errors(capsys):
    assert main(["--model", "kimi-k3.1-pro", "--gpu", "gb300", "--gpus", "8", "--parallel", "dcp8",
                 "--latent", "nvfp4", "--index-key", "mxfp4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token_per_gpu"] == 1260 and out["block_size"] == 16_384
    assert {"tokens_per_instance", "full_contexts"} <= set(out)
    assert main(["--gpus", "4", "--parallel", "tp8"]) == 2
    assert "does not match" in capsys.readouterr().err
    assert main(["--model", "nope"]) == 2


@pytest.mark.process
def test_cli_through_pdcluster_entrypoint():
    out = subprocess.run([sys.executable, "-m", "pdcluster.cli", "plan", "--model", "kimi-k3.1-pro", "--gpu", "gb300",
                          "--gpus", "8", "--parallel", "tp8", "--latent", "fp8", "--index-key", "fp8", "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert json.loads(out)["bytes_per_token_per_gpu"] == 16_992


def test_ucx_tls_is_explicit_and_tcp_fallback_detected(tmp_path):
    no_ib = str(tmp_path / "none")
    assert resolve_ucx_tls("auto", "DRAM", no_ib, gpu_present=False) == "sm,cma,self,tcp"
    assert resolve_ucx_tls("auto", "DRAM", no_ib, gpu_present=True) == "cuda_ipc,cuda_copy,sm,cma,self,tcp"
    ib = tmp_path / "ib"
    (ib / "mlx5_0").mkdir(parents=True)
    assert resolve_ucx_tls("auto", "VRAM", str(ib)).startswith("rc_x,rc,ud_x,dc_x,cuda_ipc,cuda_copy")
    assert resolve_ucx_tls("tcp", "DRAM") == "tcp"
    # Peer-failure handling: off on a host without RDMA (shared-memory wire-up), NIXL's `peer` with it.
    assert resolve_error_handling("auto", no_ib) == "none"
    assert resolve_error_handling("auto", str(ib)) == "peer"
    assert resolve_error_handling("peer", no_ib) == "peer"
    with pytest.raises(ValueError, match="error_handling"):
        resolve_error_handling("sometimes", no_ib)
    scope = tmp_path / "ptrace"
    scope.write_text("0\n")
    assert detect_tcp_fallback("sm,cma,self,tcp", True, no_ib, str(scope)) is None
    assert "no shared-memory" in detect_tcp_fallback("tcp", True, no_ib, str(scope))
    scope.write_text("3\n")  # CMA forbidden: cma alone leaves only TCP
    assert detect_tcp_fallback("cma,tcp", True, no_ib, str(scope)) is not None
    assert "no RDMA" in detect_tcp_fallback("sm,cma,self,tcp", False, no_ib, str(scope))
    assert detect_tcp_fallback("rc_x,tcp", False, str(ib), str(scope)) is None
    assert detect_tcp_fallback("^tcp", True, no_ib, str(scope)) is None
