"""Hand-off signatures (kv_transfer/signing.py): every signed field is covered, only the cluster's key verifies,
the router's JSON round trip keeps a signature valid, ids that could reach a URL path are refused."""

from __future__ import annotations

import json
import math

import pytest

from kv_transfer.params import KVTransferParams
from kv_transfer.signing import (
    SIGNED_FIELDS,
    ClusterSecret,
    HandoffRefused,
    canonical_bytes,
    prompt_digest,
    sign,
    verify,
)

SECRET = ClusterSecret(b"k" * 32)
LEASE = "0123456789abcdef0123456789abcdef"


def _params(**extra) -> KVTransferParams:
    fields = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-0",
        "remote_request_id": "req-1", "remote_block_ids": [[3, 4]], "remote_host": "10.0.0.7", "remote_port": 8100,
        "tp_size": 2, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 1500, "remote_blocks_expiry_time": 1.7e9,
        "transfer_mode": "pull", "remote_prefill_cached_tokens": 0, "block_size": 1024, "subblock_tokens": 64,
        "layout_fingerprint": "dac97fc18e73148c", "remote_kda_block_ids": [5, 6], "first_token_id": 42,
        "first_token_logprob": -0.125, "first_token_top_logprobs": [[42, -0.125], [7, -2.5]], "lease_id": LEASE,
        "lease_expiry": 1.7e9 + 0.3, "prompt_digest": prompt_digest([1, 2, 3]),
    }
    return KVTransferParams.model_validate({**fields, **extra})


ALTERED = {
    "do_remote_prefill": False, "do_remote_decode": True, "remote_engine_id": "prefill-1",
    "remote_request_id": "req-2", "remote_host": "127.0.0.1", "remote_port": 9999,
    "remote_block_ids": [[3, 5]], "remote_kda_block_ids": [6, 5], "tp_size": 4, "dcp_size": 2, "pp_size": 2,
    "remote_num_tokens": 1501, "remote_prefill_cached_tokens": 1024, "block_size": 512, "subblock_tokens": 32,
    "layout_fingerprint": "0000000000000000", "transfer_mode": "push", "first_token_id": 43,
    "first_token_logprob": -0.25, "first_token_top_logprobs": [[42, -0.125]], "lease_id": "f" * 32,
    "lease_expiry": 4e9, "remote_blocks_expiry_time": 4e9, "prompt_digest": prompt_digest([1, 2, 4]),
    "decode_engine_id": "decode-9",
}


def test_every_signed_field_has_an_alteration_case():
    assert set(ALTERED) == set(SIGNED_FIELDS)


def test_signed_params_verify_after_a_json_round_trip():
    signed = sign(_params(), SECRET)
    wire = json.loads(json.dumps({"kv_transfer_params": signed.to_wire()}))["kv_transfer_params"]
    verify(KVTransferParams.from_wire(wire), SECRET)


@pytest.mark.parametrize("name", sorted(ALTERED))
def test_altering_any_signed_field_is_refused(name):
    wire = sign(_params(), SECRET).to_wire()
    wire[name] = ALTERED[name]
    with pytest.raises(HandoffRefused, match="does not match"):
        verify(KVTransferParams.from_wire(wire), SECRET)


def test_dropping_a_signed_field_is_refused():
    wire = sign(_params(), SECRET).to_wire()
    del wire["first_token_logprob"]
    with pytest.raises(HandoffRefused, match="does not match"):
        verify(KVTransferParams.from_wire(wire), SECRET)


def test_unsigned_and_foreign_key_are_refused():
    with pytest.raises(HandoffRefused, match="not signed"):
        verify(_params(), SECRET)
    with pytest.raises(HandoffRefused, match="does not match"):
        verify(sign(_params(), ClusterSecret(b"x" * 32)), SECRET)
    forged = _params(signature="v1:" + "0" * 64)
    with pytest.raises(HandoffRefused, match="does not match"):
        verify(forged, SECRET)


@pytest.mark.parametrize("lease_id", ["../../admin", "a/b", LEASE + "0", LEASE.upper(), "", "l1"])
def test_lease_ids_that_are_not_lease_ids_are_refused_even_when_signed(lease_id):
    with pytest.raises(HandoffRefused, match="lease_id"):
        verify(sign(_params(lease_id=lease_id), SECRET), SECRET)


def test_engine_id_shape_is_checked():
    with pytest.raises(HandoffRefused, match="remote_engine_id"):
        verify(sign(_params(remote_engine_id="a/../b"), SECRET), SECRET)


def test_a_value_without_a_json_form_cannot_be_signed_or_verified():
    with pytest.raises(HandoffRefused, match="cannot be signed"):
        canonical_bytes(_params(first_token_logprob=math.nan))


def test_secret_sources(tmp_path):
    path = tmp_path / "secret"
    path.write_text("s" * 40 + "\n")
    assert ClusterSecret.load(None, path) == ClusterSecret(b"s" * 40)
    assert ClusterSecret.load("t" * 16, None) == ClusterSecret(b"t" * 16)
    assert ClusterSecret.load(None, None) is None
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ClusterSecret.load("short", None)
    with pytest.raises(ValueError, match="not both"):
        ClusterSecret.load("t" * 16, path)
    assert "s" * 40 not in repr(ClusterSecret.load(None, path))
