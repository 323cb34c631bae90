"""Decode node over in-process HTTP (real rank process, node test backend): request checks that need no
prefill node, and the `recompute` KV-load failure policy (an unreachable prefill node -> local prefill)."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from decode_node.app import create_app
from decode_node.settings import Settings
from tests.conftest import free_port
from kv_transfer.signing import prompt_digest
from tests.node.nodes import TEST_CLUSTER_SECRET, TOY, signed

pytestmark = [pytest.mark.process, pytest.mark.timeout(900)]
PROMPT = "recompute me"


@pytest.fixture(scope="module")
def client():
    settings = Settings(backend=TOY, num_rows=16, max_context=4096, kv_load_failure_policy="recompute",
                        kv={"timeout_s": 5}, cluster_secret=TEST_CLUSTER_SECRET)
    with TestClient(create_app(settings)) as c:
        yield c


def _digest() -> str:
    return prompt_digest(list(PROMPT.encode()))  # the toy backend's tokenizer: one token per byte


def _params(**extra) -> dict:
    """Params a prefill node of the cluster could have signed (checks past the signature are under test)."""
    base = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-gone",
            "remote_request_id": "r", "remote_block_ids": [[0]], "remote_host": "127.0.0.1",
            "remote_port": free_port(), "tp_size": 1, "remote_num_tokens": len(PROMPT), "block_size": 1024,
            "layout_fingerprint": "dac97fc18e73148c", "remote_kda_block_ids": [1, 2], "first_token_id": 7,
            "lease_id": uuid.uuid4().hex, "lease_expiry": 4e9, "prompt_digest": _digest()}
    return signed({**base, **extra})


@pytest.mark.parametrize("params,needle", [
    (_params(remote_num_tokens=3), "remote_num_tokens"),
    (_params(first_token_id=None), "first_token_id"),
    (_params(remote_host=None), "remote_host"),
    ({"do_remote_prefill": True, "remote_block_ids": {"a": 1}}, "malformed"),
], ids=["token-count", "no-first-token", "no-host", "malformed"])
def test_bad_params_400(client, params, needle):
    resp = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert needle in error["message"] and error["param"] == "kv_transfer_params"


def test_recompute_policy_prefills_locally(client):
    oracle = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6}).json()
    resp = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "kv_transfer_params": _params()})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == oracle["choices"][0]["token_ids"]
    assert "vllm:nixl_num_failed_transfers_total 1.0" in client.get("/metrics").text


def test_an_export_request_leases_the_prompts_rows_for_a_move(client):
    """A TP decode node serves `do_remote_decode` (a session outgrowing its pool, node/export.py): it prefills the
    prompt and answers signed params naming itself, `transfer_mode="move"`; an export request's own checks apply."""
    bad = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4,
                                                "kv_transfer_params": {"do_remote_decode": True}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens", bad.text
    resp = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1,
                                                 "kv_transfer_params": {"do_remote_decode": True}})
    assert resp.status_code == 200, resp.text
    params = resp.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["transfer_mode"] == "move"
    assert params["remote_num_tokens"] == len(PROMPT) and params["lease_id"]
    oracle = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()
    assert params["first_token_id"] == oracle["choices"][0]["token_ids"][0]


def test_tp_and_dcp_together_is_refused():
    with pytest.raises(ValueError, match="not both"):
        create_app(Settings(tp=2, dcp=2))
