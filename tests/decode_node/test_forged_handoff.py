"""Forged hand-offs sent straight to a decode node's port (real `pdcluster decode` processes under uvicorn) are
refused with 403 OpenAI JSON before any connection: a listener the test opens at the address the params name
sees no connection at all (its backlog is drained and counted at the end).

Two decode nodes: `open` has no configured prefill peers (it would connect to the signed remote_host/port, so
only the signature check stands between a forger and the listener); `peered` reads only from its configured
prefill peers (a correctly signed hand-off naming another engine is refused, and its address never used).
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from decode_node.app import create_app
from decode_node.settings import Settings
from kv_transfer.signing import prompt_digest
from tests.conftest import free_port
from tests.node.nodes import TOY, running_nodes, signed

pytestmark = [pytest.mark.process, pytest.mark.timeout(1200)]
PROMPT = "forged hand-off"


class Listener:
    """A TCP socket at the address forged params name; `connections()` counts every connection that reached it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]

    def connections(self) -> int:
        self.sock.setblocking(False)
        count = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return count
            conn.close()
            count += 1


@pytest.fixture(scope="module")
def listener():
    lst = Listener()
    yield lst
    lst.sock.close()


@pytest.fixture(scope="module")
def nodes(listener):
    common = ["--num-rows", "16", "--max-context", "4096", "--tp", "1"]
    peers = json.dumps([f"127.0.0.1:{free_port()}"])  # a configured prefill peer that is not running
    with running_nodes(("decode", common, {"DECODE_BACKEND": TOY}),
                       ("decode", common, {"DECODE_BACKEND": TOY, "DECODE_PREFILL_PEERS": peers})) as (open_, peered):
        yield open_.url, peered.url


def _params(port: int, **extra) -> dict:
    """What a forger sends: every field a genuine hand-off has, naming the test's listener."""
    fields = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-x",
              "remote_request_id": "victim", "remote_block_ids": [[0]], "remote_host": "127.0.0.1",
              "remote_port": port, "tp_size": 1, "remote_num_tokens": len(PROMPT), "block_size": 1024,
              "layout_fingerprint": "dac97fc18e73148c", "remote_kda_block_ids": [1, 2], "first_token_id": 7,
              "lease_id": "0123456789abcdef0123456789abcdef", "lease_expiry": 4e9,
              "prompt_digest": prompt_digest(list(PROMPT.encode()))}
    return {**fields, **extra}


def _send(url: str, params: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params})


def _forgeries(port: int) -> dict[str, dict]:
    genuine = signed(_params(port=free_port()))
    return {
        "unsigned": _params(port),
        "foreign-key": signed(_params(port), secret="not-the-cluster-secret-0123456789"),
        "garbage-signature": {**_params(port), "signature": "v1:" + "ab" * 32},
        "host-altered-after-signing": {**genuine, "remote_port": port},
        "rows-altered-after-signing": {**signed(_params(port)), "remote_block_ids": [[3]]},
        "lease-path-injection": {**signed(_params(port)), "lease_id": "../../v1/completions"},
    }


@pytest.mark.parametrize("case", ["unsigned", "foreign-key", "garbage-signature", "host-altered-after-signing",
                                  "rows-altered-after-signing", "lease-path-injection"])
def test_forged_handoff_is_refused_before_any_connection(nodes, listener, case):
    open_url, _ = nodes
    resp = _send(open_url, _forgeries(listener.port)[case])
    assert resp.status_code == 403, resp.text
    error = resp.json()["error"]
    assert error["type"] == "permission_error" and error["param"] == "kv_transfer_params"
    assert listener.connections() == 0
    assert httpx.get(f"{open_url}/health", timeout=10).status_code == 200


def test_handoff_for_another_prompt_is_refused(nodes, listener):
    open_url, _ = nodes
    resp = _send(open_url, signed(_params(listener.port, prompt_digest=prompt_digest([1, 2, 3]))))
    assert resp.status_code == 403 and "another prompt" in resp.json()["error"]["message"]
    assert listener.connections() == 0


def test_configured_peers_decide_where_the_node_connects(nodes, listener):
    _, peered_url = nodes
    resp = _send(peered_url, signed(_params(listener.port)))  # validly signed, but prefill-x is no peer of it
    assert resp.status_code == 403 and "not one of this node's peers" in resp.json()["error"]["message"]
    assert listener.connections() == 0


def test_a_decode_node_without_a_secret_refuses_to_start():
    with pytest.raises(ValueError, match="no cluster secret"):
        create_app(Settings(backend=TOY))
    create_app(Settings(backend=TOY, insecure_handoffs=True))  # the explicit opt-out builds (not started here)
