"""The lease table (ssd/transport/leases.py) on a fake clock: expiry, renewal, release, re-lease,
restarted and failed workers, and never two lessees at once."""

from __future__ import annotations

import pytest

from ssd.transport.leases import UNMET_FRESH_S, LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def table():
    clock = Clock()
    t = LeaseTable(clock)
    for i in range(3):
        t.register(f"w{i}", f"torch://10.0.0.{i}:1234")
    return t, clock


def test_leases_are_exclusive_and_limited_to_free_workers(table):
    t, _ = table
    a = t.lease("target-a", 2, 30)
    b = t.lease("target-b", 2, 30)
    assert [x.worker_id for x in a] == ["w0", "w1"] and [x.worker_id for x in b] == ["w2"]
    assert t.lease("target-c", 1, 30) == []
    assert {x.worker_id for x in a}.isdisjoint({x.worker_id for x in b})


def test_a_lease_not_renewed_expires_and_the_worker_goes_to_another_lessee(table):
    t, clock = table
    t.lease("dead-target", 3, 10)
    clock.now += 9
    assert t.renew("dead-target", ["w0"], 10) == ["w0"]  # renewed in time: held until 119
    clock.now += 2  # 111: w1 and w2 expired, w0 still held
    got = t.lease("target-b", 3, 10)
    assert sorted(x.worker_id for x in got) == ["w1", "w2"] and t.expired == 2
    assert t.renew("dead-target", ["w0", "w1", "w2"], 10) == ["w0"]  # an expired lease is lost for good


def test_release_and_report_failed(table):
    t, _ = table
    t.lease("a", 2, 30)
    t.release("a", ["w0"])
    t.release("b", ["w1"])  # not b's: no effect
    assert [x.worker_id for x in t.lease("b", 3, 30)] == ["w0", "w2"]
    t.report_failed("a", "w1")
    assert "w1" not in {w["worker_id"] for w in t.snapshot()}
    t.register("w1", "torch://10.0.0.9:999")  # the restarted worker rejoins, free
    again = t.lease("c", 1, 30)
    assert [(x.worker_id, x.address) for x in again] == [("w1", "torch://10.0.0.9:999")]


def test_a_restarted_worker_is_free_again(table):
    t, _ = table
    t.lease("a", 1, 30)
    t.register("w0", "torch://10.0.0.0:4321")  # restarted: its old lease is gone
    assert t.renew("a", ["w0"], 30) == []
    assert t.lease("b", 1, 30)[0].worker_id == "w0"


def test_a_failure_reported_after_the_restart_keeps_the_restarted_worker(table):
    """Regression guard: the restarted worker registered (new address) before the lessee
    reported its former self failed; the report must not remove it."""
    t, _ = table
    t.lease("a", 1, 30)
    t.register("w0", "torch://10.0.0.0:5555")
    t.report_failed("a", "w0", "torch://10.0.0.0:1234")
    assert t.lease("b", 1, 30)[0].address == "torch://10.0.0.0:5555"


def test_bad_arguments_name_the_parameter(table):
    t, _ = table
    with pytest.raises(ValueError, match="ttl_s"):
        t.lease("a", 1, 0)
    with pytest.raises(ValueError, match="n must be"):
        t.lease("a", -1, 5)
    with pytest.raises(ValueError, match="ttl_s"):
        t.renew("a", ["w0"], -1)


def test_workers_of_another_configuration_are_never_leased():
    """Two applications share the cluster's pool: each target gets only workers of its own
    fingerprint (an untagged worker serves anybody)."""
    t = LeaseTable(lambda: 0.0)
    t.register("a1", "addr-a1", fingerprint=1)
    t.register("b1", "addr-b1", fingerprint=2)
    t.register("any", "addr-any")
    got = t.lease("target-b", 3, 10.0, fingerprint=2)
    assert [lease.worker_id for lease in got] == ["b1", "any"]
    assert [lease.worker_id for lease in t.lease("target-a", 3, 10.0, fingerprint=1)] == ["a1"]
    assert t.lease("target-c", 1, 10.0, fingerprint=3) == []


def test_demand_counts_the_leased_and_the_still_asking_of_one_application_and_configuration():
    clock = Clock()
    t = LeaseTable(clock)
    t.register("w0", "torch://a:1", fingerprint=7)
    t.register("x0", "torch://b:1", fingerprint=8)
    assert t.demand(7, "app/") == 0
    assert [lease.worker_id for lease in t.lease("app/target-1", 1, 30.0, 7)] == ["w0"]
    assert t.lease("app/target-2", 2, 30.0, 7) == []  # none free: it waits, and keeps asking
    assert t.lease("other/target-3", 1, 30.0, 7) == []
    assert t.demand(7, "app/") == 1 + 2
    assert t.demand(7) == 1 + 2 + 1
    assert t.demand(8, "app/") == 0  # another configuration's workers are not this pool's
    clock.now += UNMET_FRESH_S  # target-2 stopped asking (it gave up, or it was scaled down)
    assert t.demand(7, "app/") == 1
    t.register("w1", "torch://a:2", fingerprint=7)
    assert len(t.lease("app/target-2", 1, 30.0, 7)) == 1
    assert t.demand(7, "app/") == 2
    t.release("app/target-1", ["w0"])  # target-1 scaled down: it closes and releases
    assert t.demand(7, "app/") == 1
    clock.now += 31  # target-2 died: its lease runs out
    assert t.demand(7, "app/") == 0
