"""Leases: expiry, notification and abort each end a lease exactly once, naming its export (request id and
generation), never rows; only a notified end says the reads are done."""

from __future__ import annotations

import pytest

from kv_transfer.lease import ClaimRefused, ExportKey, LeaseManager, done_message
from kv_transfer.signing import ClusterSecret, lease_key


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
    assert leases.abort(lease.lease_id, by_reader=True)
    assert ended == [(ExportKey("c", 3), "aborted")] and leases.outcomes["aborted"] == 1
    assert not leases.abort(lease.lease_id)


def test_an_unclaimed_lease_frees_its_rows_at_once():
    """Whatever ends a lease nobody claimed (the client left, it expired), no READ can target its rows: a decode
    node reads only after its claim won, and a claim after the end is refused. So the rows are freed at once;
    a claimed lease ended by the node (not by its reader) keeps them in quarantine."""
    clock, done = Clock(), {}
    leases = LeaseManager(lambda lease, outcome: done.__setitem__(lease.export.request_id, lease.reads_done),
                          ttl_s=10.0, clock=clock)
    unclaimed, expiring, claimed = (leases.create(ExportKey(rid, 1)) for rid in ("u", "e", "c"))
    leases.claim(claimed.lease_id, "decode-a")
    assert leases.abort(unclaimed.lease_id) and leases.abort(claimed.lease_id)
    clock.now += 11
    assert leases.expire() == [expiring.lease_id]
    assert done == {"u": True, "c": False, "e": True}


SECRET = ClusterSecret(b"s" * 32)


@pytest.mark.parametrize("key", [b"", b"attacker-key-0123456789abcdef", lease_key(ClusterSecret(b"o" * 32), "x")],
                         ids=["unsigned", "own-key", "other-cluster"])
def test_forged_done_ends_nothing(key):
    """With a secret, a DONE whose MAC is not under the lease's key is refused, and the lease lives on."""
    ended = []
    leases = LeaseManager(lambda lease, outcome: ended.append(outcome), ttl_s=10.0, secret=SECRET)
    lease = leases.create(ExportKey("victim", 1))
    with pytest.raises(ValueError, match="does not verify"):
        leases.apply_message(done_message(lease.lease_id, "0.0", 1, key))
    assert ended == [] and leases.outstanding == 1 and leases.rejected_notifications == 1
    leases.apply_message(done_message(lease.lease_id, "0.0", 1, lease_key(SECRET, lease.lease_id)))
    assert ended == ["notified"] and leases.outstanding == 0


def test_a_key_opens_only_its_own_lease():
    leases = LeaseManager(lambda lease, outcome: None, ttl_s=10.0, secret=SECRET)
    mine, other = leases.create(ExportKey("a", 1)), leases.create(ExportKey("b", 1))
    with pytest.raises(ValueError, match="does not verify"):  # my key, another lease's id
        leases.apply_message(done_message(other.lease_id, "0.0", 1, lease_key(SECRET, mine.lease_id)))
    assert leases.outstanding == 2


@pytest.mark.parametrize("msg", [b"DONE:x:1", b"DONE:x:a:b", b"WHAT:x", b"HB:x", b"ABORT:x", b"DONE:x:0.0:1"])
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


def test_first_claim_wins_and_binds_the_reader(env):
    leases, _, _ = env
    lease = leases.create(ExportKey("f", 1))
    assert leases.claim(lease.lease_id, "decode-a").claimed_by == "decode-a"
    for reader in ("decode-a", "decode-b"):  # a replay, by the same node (restarted) or another one
        with pytest.raises(ClaimRefused, match="already redeemed") as refused:
            leases.claim(lease.lease_id, reader)
        assert refused.value.status == 409
    bound = leases.create(ExportKey("g", 1), reader="decode-a")
    with pytest.raises(ClaimRefused, match="another decode instance") as refused:
        leases.claim(bound.lease_id, "decode-b")
    assert refused.value.status == 403
    leases.claim(bound.lease_id, "decode-a")
    assert leases.abort(lease.lease_id)
    with pytest.raises(ClaimRefused, match="has ended") as refused:
        leases.claim(lease.lease_id, "decode-a")
    assert refused.value.status == 404


def test_a_lease_that_awaits_its_reader_is_claimed_only_by_the_one_bound_to_it(env):
    """A moved stream's lease (its reader unknown when it was made) refuses every claim until the router binds it;
    then only that reader; the first bind wins and a claimed lease takes no other."""
    leases, _, _ = env
    lease = leases.create(ExportKey("m", 1), awaits_reader=True)
    with pytest.raises(ClaimRefused, match="not bound to a reader yet") as refused:
        leases.claim(lease.lease_id, "decode-a")
    assert refused.value.status == 403 and lease.claimed_by is None
    leases.bind(lease.lease_id, "decode-b")
    leases.bind(lease.lease_id, "decode-b")  # the same reader again (a retried call) changes nothing
    with pytest.raises(ClaimRefused, match="bound to another reader") as refused:
        leases.bind(lease.lease_id, "decode-a")
    assert refused.value.status == 409
    with pytest.raises(ClaimRefused, match="another decode instance") as refused:
        leases.claim(lease.lease_id, "decode-a")
    assert refused.value.status == 403
    assert leases.claim(lease.lease_id, "decode-b").claimed_by == "decode-b"
    pulled = leases.create(ExportKey("n", 1), reader="decode-a")
    with pytest.raises(ClaimRefused, match="issued for its reader already"):
        leases.bind(pulled.lease_id, "decode-b")
    assert leases.abort(lease.lease_id)
    with pytest.raises(ClaimRefused, match="has ended") as refused:
        leases.bind(lease.lease_id, "decode-b")
    assert refused.value.status == 404


def test_concurrent_claims_one_winner():
    import threading

    leases = LeaseManager(lambda lease, outcome: None, ttl_s=10.0)
    lease = leases.create(ExportKey("h", 1))
    wins, barrier = [], threading.Barrier(8)

    def claim(i: int) -> None:
        barrier.wait()
        try:
            leases.claim(lease.lease_id, f"decode-{i}")
            wins.append(i)
        except ClaimRefused:
            pass

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
