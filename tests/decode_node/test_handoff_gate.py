"""The decode node's hand-off gate (decode_node/handoff.py): check and mark are one step, so a hand-off presented
twice on one node, however concurrently, is admitted once; one issued for another decode instance is refused."""

from __future__ import annotations

import asyncio

import pytest

from decode_node.handoff import HandoffGate
from kv_transfer.params import KVTransferParams
from kv_transfer.signing import ClusterSecret, prompt_digest, sign
from serving.errors import APIError

SECRET = ClusterSecret(b"g" * 32)
PROMPT = [256, 1, 2, 3]


def _params(**extra) -> KVTransferParams:
    return sign(KVTransferParams(do_remote_prefill=True, remote_engine_id="prefill-0", remote_request_id="r",
                                 remote_block_ids=[[0]], remote_num_tokens=len(PROMPT), block_size=1024,
                                 lease_id="a" * 32, lease_expiry=4e9, prompt_digest=prompt_digest(PROMPT), **extra),
                SECRET)


def test_a_presented_handoff_is_refused_the_second_time():
    gate = HandoffGate(SECRET, "decode-a")
    params = _params()
    gate.admit(params, PROMPT)
    with pytest.raises(APIError, match="already used") as refused:
        gate.admit(params, PROMPT)
    assert refused.value.status == 403


def test_concurrent_presentations_admit_one():
    """Presentations racing on one event loop (as a node's requests do): exactly one passes."""
    gate = HandoffGate(SECRET, "decode-a")
    params = _params()

    async def present() -> bool:
        await asyncio.sleep(0)
        try:
            gate.admit(params, PROMPT)
        except APIError:
            return False
        return True

    async def race() -> list[bool]:
        return await asyncio.gather(*(present() for _ in range(16)))

    assert sum(asyncio.run(race())) == 1


def test_a_handoff_issued_for_another_decode_instance_is_refused():
    params = _params(decode_engine_id="decode-b")
    with pytest.raises(APIError, match="another decode instance") as refused:
        HandoffGate(SECRET, "decode-a").admit(params, PROMPT)
    assert refused.value.status == 403
    HandoffGate(SECRET, "decode-b").admit(params, PROMPT)


def test_the_reader_is_signed():
    """Rewriting decode_engine_id to the presenting node's id breaks the signature."""
    params = _params(decode_engine_id="decode-b").model_copy(update={"decode_engine_id": "decode-a"})
    with pytest.raises(APIError, match="signature does not match"):
        HandoffGate(SECRET, "decode-a").admit(params, PROMPT)
