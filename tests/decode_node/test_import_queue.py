"""An import short of rows waits in decode_node/admission.py's queue for at most `import_queue_wait_s` and never past
its lease's expiry (less LEASE_MARGIN_S): the rows at the prefill node would be gone when it READs. The defaults
agree: a decode node's wait ends before a prefill node's lease (or a draining decode node's move lease) does."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from decode_node.admission import LEASE_MARGIN_S, ImportQueue
from decode_node.settings import Settings as DecodeSettings
from engine.api import ImportOutcome
from node.app import NodeBusy
from prefill_node.settings import Settings as PrefillSettings


class _Gauge:
    def set(self, value: float) -> None:
        self.value = value


def _runtime() -> SimpleNamespace:
    """What ImportQueue reads of a NodeRuntime: requests finished so far and the queue-depth gauge."""
    return SimpleNamespace(num_finished=0, metrics=SimpleNamespace(import_queue_depth=_Gauge()))


async def _short_of_rows():
    async def events():
        yield None

    return ImportOutcome(request_id="r", short_of_rows=True), events()


def test_a_queued_import_gives_up_before_its_lease_expires() -> None:
    queue = ImportQueue(depth=4, wait_s=3600.0, poll_s=0.05)
    expiry = time.time() + LEASE_MARGIN_S + 0.5  # the lease ends long before the queue's own wait would

    async def admit() -> None:  # NodeBusy from the lease's bound; a TimeoutError here would mean wait_s ruled
        await asyncio.wait_for(queue.admit(_runtime(), _short_of_rows, expiry), timeout=120)

    with pytest.raises(NodeBusy, match="within its wait"):
        asyncio.run(admit())
    assert queue.num_waiting == 0


def test_the_default_wait_ends_before_the_default_leases() -> None:
    wait = DecodeSettings().import_queue_wait_s
    assert wait + LEASE_MARGIN_S <= PrefillSettings().lease_seconds
    assert wait + LEASE_MARGIN_S <= DecodeSettings().move_lease_s
