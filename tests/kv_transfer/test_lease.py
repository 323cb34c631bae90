"""Leases: expiry, notification and abort each end a lease exactly once, naming its export (request id and
generation), never rows; only a notified end says the reads are done."""

from __future__ import annotations

import pytest

from kv_transfer.lease import ExportKey, LeaseManager, abort_message, done_message


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def env():
    ended: list[tuple[ExportKey, str]] = []
    clock = Clock()
    return LeaseManager(lambda lease, outcome: ended.append((lease.export, outcome)), ttl_s=10.0, clock=clock), \
        ended, clock


def test_expiry_ends_once(env):
    leases, ended, clock = env
    lease = leases.create(ExportKey("a", 1))
    clock.now += 9.9
    assert leases.expire() == [] and ended == []
    clock.now += 0.2
    assert leases.expire() == [lease.lease_id] and ended == [(ExportKey("a", 1), "expired")]
    assert leases.expire() == [] and leases.outcomes["expired"] == 1 and leases.outstanding == 0
    leases.apply_message(done_message(lease.lease_id, "0.0", 1))  # late: counted, ignored
    assert leases.late_notifications == 1 and len(ended) == 1


def test_notification_ends_after_all_consumers(env):
    leases, ended, _ = env
    lease = leases.create(ExportKey("b", 2))
    leases.apply_message(done_message(lease.lease_id, "0.0", 2))
    leases.apply_message(done_message(lease.lease_id, "0.0", 2))  # a duplicate does not count twice
    assert ended == [] and leases.outstanding == 1
    leases.apply_message(done_message(lease.lease_id, "1.0", 2))
    assert ended == [(ExportKey("b", 2), "notified")] and leases.outcomes["notified"] == 1
    assert leases.outstanding == 0


def test_abort_ends(env):
    leases, ended, _ = env
    lease = leases.create(ExportKey("c", 3))
    leases.apply_message(abort_message(lease.lease_id))
    assert ended == [(ExportKey("c", 3), "aborted")] and leases.outcomes["aborted"] == 1
    assert not leases.abort(lease.lease_id)


@pytest.mark.parametrize("msg", [b"DONE:x:1", b"DONE:x:a:b", b"WHAT:x", b"HB:x", b"ABORT:"])
def test_malformed_notifications(env, msg):
    leases, _, _ = env
    with pytest.raises(ValueError):
        leases.apply_message(msg)


def test_duplicate_lease_id_and_bad_ttl(env):
    leases, _, _ = env
    leases.create(ExportKey("d", 1), lease_id="a")
    with pytest.raises(ValueError, match="already exists"):
        leases.create(ExportKey("e", 1), lease_id="a")
    with pytest.raises(ValueError, match="positive"):
        LeaseManager(lambda lease, outcome: None, ttl_s=0)
