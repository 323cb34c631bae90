"""Node settings: one prefix per node kind, the `kv` transfer section settable by CLI flag, env and keyword,
carried to the ranks in the (picklable) WorkerConfig."""

from __future__ import annotations

import argparse
import pickle

import pytest
from pydantic import ValidationError

from decode_node.settings import Settings as DecodeSettings
from kv_transfer.ucx_env import KVTransferSettings, nixl_api
from node.cli import add_common_flags, settings_fields
from node.runtime import worker_config
from prefill_node.settings import Settings as PrefillSettings


def _parse(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_common_flags(parser)
    args = vars(parser.parse_args(argv))
    args.pop("log_level")
    return settings_fields(args)


def test_kv_flags_nest_under_kv():
    fields = _parse(["--num-rows", "64", "--kv-ucx-tls", "tcp", "--kv-timeout-s", "5", "--no-kv-capture-telemetry"])
    assert fields == {"num_rows": 64, "kv": {"ucx_tls": "tcp", "timeout_s": "5", "capture_telemetry": False}}
    kv = DecodeSettings(**fields).kv
    assert (kv.ucx_tls, kv.timeout_s, kv.capture_telemetry, kv.error_handling) == ("tcp", 5.0, False, "auto")


def test_every_kv_field_has_a_flag():
    parser = argparse.ArgumentParser()
    add_common_flags(parser)
    dests = {action.dest for action in parser._actions}
    assert {f"kv.{name}" for name in KVTransferSettings.model_fields} <= dests


@pytest.mark.parametrize("cls,prefix", [(PrefillSettings, "PREFILL_"), (DecodeSettings, "DECODE_")],
                         ids=["prefill", "decode"])
def test_kv_env_uses_the_node_prefix(monkeypatch, cls, prefix):
    monkeypatch.setenv(f"{prefix}KV__UCX_TLS", "sm,self")
    monkeypatch.setenv(f"{prefix}KV__NIXL_MODULE", "nixl_cu13")
    monkeypatch.setenv(f"{prefix}NUM_ROWS", "32")
    settings = cls()
    assert (settings.kv.ucx_tls, settings.kv.nixl_module, settings.engine.num_rows) == ("sm,self", "nixl_cu13", 32)


def test_flags_override_env_field_by_field(monkeypatch):
    monkeypatch.setenv("DECODE_KV__UCX_TLS", "tcp")
    monkeypatch.setenv("DECODE_KV__TIMEOUT_S", "7")
    settings = DecodeSettings(kv={"timeout_s": 3})
    assert (settings.kv.ucx_tls, settings.kv.timeout_s) == ("tcp", 3.0)


def test_other_prefixes_are_ignored(monkeypatch):
    monkeypatch.setenv("PREFILL_KV__UCX_TLS", "tcp")
    monkeypatch.setenv("PDC_KV_UCX_TLS", "tcp")
    assert DecodeSettings().kv.ucx_tls == "auto"


@pytest.mark.parametrize("kv,needle", [({"error_handling": "sometimes"}, "error_handling"),
                                       ({"timeout_s": 0}, "timeout_s"), ({"ucx_tlss": "tcp"}, "ucx_tlss")],
                         ids=["bad-mode", "zero-timeout", "unknown-field"])
def test_bad_kv_values_name_the_field(kv, needle):
    with pytest.raises(ValidationError, match=needle):
        PrefillSettings(kv=kv)


def test_worker_config_carries_kv_to_the_ranks():
    settings = DecodeSettings(kv={"ucx_tls": "tcp", "timeout_s": 4, "repost_after_s": 2})
    config = pickle.loads(pickle.dumps(worker_config(settings, "decode")))
    assert config.kv == settings.kv
    assert config.kv.timeout_s == 4.0


def test_nixl_api_imports_the_configured_wheel_only():
    with pytest.raises(ImportError, match="no_such_nixl_wheel"):
        nixl_api("no_such_nixl_wheel")
