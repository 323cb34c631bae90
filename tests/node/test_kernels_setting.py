"""The node setting `kernels` (auto | reference | fast): how a node resolves it through the kernel registry
(engine/kernels.py, whose every cell tests/engine/test_kernel_registry.py checks: auto is fast only on a CUDA rank
of a single-rank node, explicit fast also runs TP and DCP nodes), the flag and environment that carry it to the
ranks, and the refusal, at start and naming the reason, of an explicit `fast` where the node cannot run it (CPU
without the interpreter).
A node serving with `fast` end to end (CPU, Triton interpreter) is tests/node/test_fast_node.py; the TP fast
decode on 2 ranks is tests/engine/fast/test_tp_decode.py, the DCP one tests/engine/fast/test_dcp_decode.py."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
from pydantic import ValidationError

from decode_node.cli import main as decode_main
from engine.api import EngineConfig
from engine.parallel.groups import ParallelContext
from engine.parallel.spmd import TimedModel
from engine.rank_engine import build_rank_engine
from node.cli import add_common_flags, settings_fields
from node.runtime import worker_config
from prefill_node.cli import main as prefill_main
from prefill_node.settings import Settings as PrefillSettings
from decode_node.settings import Settings as DecodeSettings


@pytest.fixture
def no_interpreter(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _kernels(kernels: str, device: str, tp: int = 1, dcp: int = 1) -> str:
    return PrefillSettings(kernels=kernels, device=device).resolved_kernels(tp, dcp).kernels


def test_auto_is_fast_only_on_a_single_cuda_rank(no_interpreter) -> None:
    assert _kernels("auto", "cpu") == "reference"
    assert _kernels("auto", "cpu", 2) == "reference"
    assert _kernels("auto", "cuda") == "fast"
    assert _kernels("auto", "cuda", 2) == "reference"  # TP: the fast TP kernels only when asked for
    assert _kernels("auto", "cuda", 2, 2) == "reference"  # DCP: likewise
    if importlib.util.find_spec("triton") is not None:  # fast also needs the triton package
        assert _kernels("fast", "cuda", 2) == "fast"
        choice = PrefillSettings(kernels="fast", device="cuda").resolved_kernels(2, 2)
        assert (choice.parallelism, choice.prefill.runs_set, choice.decode.runs_set) == ("dcp", "reference", "fast")
    assert _kernels("reference", "cuda") == "reference"
    assert _kernels("reference", "cpu", 4) == "reference"


def test_explicit_fast_where_unsupported_is_refused_with_the_reason(no_interpreter) -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        _kernels("fast", "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        _kernels("fast", "cpu", 2, 2)


def test_flag_and_environment_carry_kernels_to_the_ranks(monkeypatch) -> None:
    assert PrefillSettings().engine.kernels == "auto"
    assert worker_config(PrefillSettings(), "prefill").engine.kernels == "auto"
    monkeypatch.setenv("DECODE_KERNELS", "reference")
    assert worker_config(DecodeSettings(), "decode").engine.kernels == "reference"
    with pytest.raises(ValidationError):
        PrefillSettings(kernels="triton")
    parser = argparse.ArgumentParser()
    add_common_flags(parser)
    fields = settings_fields(vars(parser.parse_args(["--kernels", "fast"])))
    assert fields["kernels"] == "fast"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kernels", "triton"])


def test_nodes_refuse_to_start_with_fast_where_unsupported(no_interpreter, capsys) -> None:
    """Exit 2 before any rank starts, the message naming why (no silent fallback to the reference set)."""
    with pytest.raises(SystemExit) as exited:
        prefill_main(["--kernels", "fast", "--insecure-handoffs"])  # device cpu, no interpreter
    assert exited.value.code == 2
    assert "kernels='fast' needs a CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        decode_main(["--kernels", "fast", "--dcp", "2", "--insecure-handoffs"])  # DCP runs fast, but on CUDA
    assert exited.value.code == 2
    assert "kernels='fast' needs a CUDA device" in capsys.readouterr().err


def _config(**kw) -> EngineConfig:  # type: ignore[no-untyped-def]
    return EngineConfig(num_rows=8, max_batch=2, **kw)


def test_a_cpu_rank_engine_keeps_the_reference_set(no_interpreter) -> None:
    from engine.model.model import KimiModel

    engine = build_rank_engine(_config(), ParallelContext.single())
    assert engine.kernels == "reference"
    assert isinstance(engine.model, TimedModel) and isinstance(engine.model.model, KimiModel)
    with pytest.raises(ValueError, match="kernels='fast' needs a CUDA device"):
        build_rank_engine(_config(kernels="fast"), ParallelContext.single())
