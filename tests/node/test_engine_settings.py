"""A node setting reaches the engine without being copied: the node settings' `engine` section is engine/api.py's
`EngineConfig`, handed to the ranks whole (node/runtime.py `worker_config`) and to the Engine whole
(node/worker.py -> engine/rank_engine.py). So a field added to EngineConfig is a node setting, by flag-less keyword, environment (flat or
nested) and cluster config, with no node/ code naming it; and `max_step_tokens` set through each user-facing
spelling (`--max-step-tokens`, `PREFILL_MAX_STEP_TOKENS`, `PREFILL_ENGINE__MAX_STEP_TOKENS`, a pool's
`settings: {max_step_tokens: ...}`) reaches `Engine.config.max_step_tokens`."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
from pydantic import Field

from cluster.config import parse_config
from cluster.plan import assign_ports, plan_nodes
from decode_node.settings import Settings as DecodeSettings
from engine.api import EngineConfig
from engine.parallel.groups import ParallelContext
from engine.rank_engine import build_rank_engine
from node.cli import add_common_flags, settings_fields
from node.rank import WorkerConfig
from node.runtime import worker_config
from prefill_node.settings import Settings as PrefillSettings

NODE_DIR = Path(__file__).resolve().parents[2] / "node"


@dataclasses.dataclass(frozen=True)
class WiderEngineConfig(EngineConfig):
    """EngineConfig with a field no node/ code has heard of."""

    probe_budget: int = 0


class WiderSettings(PrefillSettings):
    engine: WiderEngineConfig = Field(default_factory=lambda: WiderEngineConfig(max_batch=16))


def _engine(settings) -> EngineConfig:  # type: ignore[no-untyped-def]
    """The config the rank's Engine was built from (reference backend, one CPU rank)."""
    return build_rank_engine(worker_config(settings, "prefill").engine, ParallelContext.single()).config


def test_worker_config_names_no_engine_field():
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert not engine_names & {f.name for f in dataclasses.fields(WorkerConfig)}
    assert not any("EngineConfig(" in path.read_text() for path in NODE_DIR.glob("*.py")
                   if path.name != "settings.py")  # built once, by the settings


def test_a_new_engine_field_reaches_the_engine_unnamed(monkeypatch):
    assert not any("probe_budget" in path.read_text() for path in NODE_DIR.glob("*.py"))
    assert _engine(WiderSettings(probe_budget=3, num_rows=8)).probe_budget == 3
    monkeypatch.setenv("PREFILL_PROBE_BUDGET", "5")
    assert _engine(WiderSettings(num_rows=8)).probe_budget == 5
    monkeypatch.setenv("PREFILL_ENGINE__PROBE_BUDGET", "6")  # nested wins over flat
    assert WiderSettings().engine.probe_budget == 6
    assert WiderSettings.model_validate({"probe_budget": 7}).engine.probe_budget == 7  # a pool's `settings`


def _flag_settings(argv: list[str]) -> PrefillSettings:
    parser = argparse.ArgumentParser()
    add_common_flags(parser)
    args = vars(parser.parse_args(argv))
    args.pop("log_level")
    return PrefillSettings(**settings_fields(args))


def test_max_step_tokens_reaches_the_engine_by_flag_env_and_cluster_config(monkeypatch):
    assert _engine(_flag_settings(["--max-step-tokens", "24", "--num-rows", "8"])).max_step_tokens == 24
    monkeypatch.setenv("PREFILL_NUM_ROWS", "8")
    monkeypatch.setenv("PREFILL_MAX_STEP_TOKENS", "32")
    assert _engine(PrefillSettings()).max_step_tokens == 32
    assert _engine(_flag_settings(["--max-step-tokens", "24"])).max_step_tokens == 24  # a flag beats the env
    monkeypatch.setenv("PREFILL_ENGINE__MAX_STEP_TOKENS", "40")
    assert _engine(PrefillSettings()).max_step_tokens == 40
    monkeypatch.delenv("PREFILL_MAX_STEP_TOKENS")
    monkeypatch.delenv("PREFILL_ENGINE__MAX_STEP_TOKENS")
    config = parse_config({"pools": [{"name": "p", "role": "prefill", "settings": {"max_step_tokens": 48}},
                                     {"name": "d", "role": "decode"}]})
    plan = next(plan for plan in plan_nodes(config, assign_ports(config)) if plan.role == "prefill")
    assert plan.env == {"PREFILL_MAX_STEP_TOKENS": "48"}
    for name, value in plan.env.items():
        monkeypatch.setenv(name, value)
    assert _engine(PrefillSettings()).max_step_tokens == 48


def test_the_node_completes_the_engine_config():
    settings = DecodeSettings(num_rows=8, max_num_seqs=3, tp=2, kv={"timeout_s": 4}, prefix_cache=False)
    engine = worker_config(settings, "decode", dcp_size=2).engine
    assert (engine.num_rows, engine.max_batch, engine.prefix_cache) == (8, 3, False)
    assert (engine.tp_size, engine.dcp_size, engine.quarantine_s) == (2, 2, 4.0)
    assert DecodeSettings().engine.max_batch == 16  # the node's default, not the engine's


@pytest.mark.parametrize("settings,needle", [({"tp_size": 2}, "engine.tp_size"), ({"engine": {"nums_rows": 8}},
                                                                                    "engine.nums_rows"),
                                             ({"device": "cuda:1"}, "device"), ({"kernels": "triton"}, "kernels"),
                                             ({"max_step_tokens": 0}, "max_step_tokens"),
                                             ({"decode_first_tokens": -1}, "decode_first_tokens")],
                         ids=["node-decides", "unknown", "device", "kernels", "max-step-tokens", "decode-first-tokens"])
def test_bad_engine_settings_name_the_field(settings, needle):
    with pytest.raises(ValueError, match=needle):
        PrefillSettings.model_validate(settings)
