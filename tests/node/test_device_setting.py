"""The `device` setting without a GPU: what a rank computes on, the CLI and settings that carry it, and
`pdcluster generate --device` refusing what it cannot run (the CUDA runs themselves are tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from engine.cli import main as generate_main
from engine.parallel.groups import ParallelContext
from engine.rank_engine import rank_device
from node.runtime import worker_config
from prefill_node.settings import Settings as PrefillSettings


def test_rank_device_follows_the_setting_and_the_context() -> None:
    ctx = ParallelContext.single("cpu")
    assert rank_device("cpu", ctx) == torch.device("cpu")
    with pytest.raises(ValueError, match="bound to a GPU"):
        rank_device("cuda", ctx)
    with pytest.raises(ValueError, match="cpu or cuda"):
        rank_device("tpu", ctx)


def test_settings_carry_the_device_to_the_ranks(monkeypatch) -> None:
    assert worker_config(PrefillSettings(), "prefill").engine.device == "cpu"
    monkeypatch.setenv("PREFILL_DEVICE", "cuda")
    assert worker_config(PrefillSettings(), "prefill").engine.device == "cuda"
    with pytest.raises(ValueError):
        PrefillSettings(device="tpu")


def test_generate_refuses_a_bad_device(capsys) -> None:
    assert generate_main(["--prompt", "hi", "--max-tokens", "1", "--device", "tpu"]) == 2
    assert "--device must be cpu or cuda" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert generate_main(["--prompt", "hi", "--max-tokens", "1", "--device", "cuda"]) == 2
        assert "no CUDA device is visible" in capsys.readouterr().err
