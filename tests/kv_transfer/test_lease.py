"""Leases: expiry frees, heartbeat keeps, notification frees, abort frees; each lease ends exactly once."""

from __future__ import annotations

import pytest

from kv_transfer.lease import (
    LeaseManager,
    abort_message,
    done_message,
    heartbeat_message,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def env():
    freed: list[tuple[int, ...]] = []
    clock = Clock()
    return LeaseManager(freed.append, ttl_s=10.0, clock=clock), freed, clock


def test_expiry_frees_once(env):
    leases, freed, clock = env
    lease = leases.create([3, 4, 5])
    clock.now += 9.9
    assert leases.expire() == [] and freed == []
    clock.now += 0.2
    assert leases.expire() == [lease.lease_id] and freed == [(3, 4, 5)]
    assert leases.expire() == [] and leases.outcomes["expired"] == 1 and leases.outstanding == 0
    leases.apply_message(done_message(lease.lease_id, "0.0", 1))  # late: counted, ignored
    assert leases.late_notifications == 1 and freed == [(3, 4, 5)]


def test_heartbeat_keeps_rows(env):
    leases, freed, clock = env
    lease = leases.create([1])
    for _ in range(5):
        clock.now += 6
        leases.apply_message(heartbeat_message(lease.lease_id))
        assert leases.expire() == []
    assert freed == [] and leases.heartbeats == 5
    clock.now += 10.1
    assert leases.expire() == [lease.lease_id]
    assert leases.heartbeat(lease.lease_id) is None


def test_notification_frees_after_all_consumers(env):
    leases, freed, _ = env
    lease = leases.create([7, 8])
    leases.apply_message(done_message(lease.lease_id, "0.0", 2))
    leases.apply_message(done_message(lease.lease_id, "0.0", 2))  # a duplicate does not count twice
    assert freed == [] and leases.outstanding == 1
    leases.apply_message(done_message(lease.lease_id, "1.0", 2))
    assert freed == [(7, 8)] and leases.outcomes["notified"] == 1 and leases.outstanding == 0


def test_abort_frees(env):
    leases, freed, _ = env
    lease = leases.create([2])
    leases.apply_message(abort_message(lease.lease_id))
    assert freed == [(2,)] and leases.outcomes["aborted"] == 1
    assert not leases.abort(lease.lease_id)


@pytest.mark.parametrize("msg", [b"DONE:x:1", b"DONE:x:a:b", b"WHAT:x", b"HB:"])
def test_malformed_notifications(env, msg):
    leases, _, _ = env
    with pytest.raises(ValueError):
        leases.apply_message(msg)


def test_duplicate_lease_id_and_bad_ttl(env):
    leases, _, _ = env
    leases.create([1], lease_id="a")
    with pytest.raises(ValueError, match="already exists"):
        leases.create([2], lease_id="a")
    with pytest.raises(ValueError, match="positive"):
        LeaseManager(lambda rows: None, ttl_s=0)
