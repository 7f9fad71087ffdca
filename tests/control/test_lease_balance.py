"""Coordinator replicas spread job leases between them.

The plan is a pure function (tested on its own); the loop is then driven step by step with
``run_once`` against a real Redis server of its own (the shared one holds other tests' jobs).
"""

from __future__ import annotations

import pytest
import redis

from shoal.coordinator.balance import Replica, parse_registry, plan_handoffs
from shoal.coordinator.loop import Coordinator
from shoal.events import bus
from shoal.events.keys import COORDINATORS, job_keys
from shoal.events.models import JoinRequest
from shoal.ops.embedded import start_server
from shoal.core.registry import create_job
from shoal.core.jobspec import JobSpec
from tests.helpers import wait_until

#: Short, so that a dead replica's leases lapse quickly; several times the time one
#: ``run_once`` of every replica takes, so that the live ones keep theirs while the test
#: drives them in turn from one thread.
LEASE_TTL = 0.6


def test_plan_moves_only_the_excess_to_the_least_loaded() -> None:
    live = [Replica("a", 0, 6), Replica("b", 0, 0), Replica("c", 0, 0)]
    plan = plan_handoffs("a", [f"j{i}" for i in range(6)], live)
    assert plan.moves == (("j0", "b"), ("j1", "c"), ("j2", "b"), ("j3", "c"))
    assert "over the fair share of 2 across 3 replicas" in plan.reason


@pytest.mark.parametrize("loads, me, why", [
    ({"a": 2, "b": 1}, "a", "fair share 2"),                 # within ceil(3/2)
    ({"a": 1, "b": 3}, "a", "fair share 2"),                 # under-loaded replicas never move jobs
    ({"a": 5}, "a", "no other live replica"),
    ({"a": 3, "b": 2, "c": 2}, "a", "fair share 3"),
])
def test_plan_keeps_jobs_where_balance_would_not_improve(loads, me, why) -> None:
    plan = plan_handoffs(me, [f"j{i}" for i in range(loads[me])], [Replica(t, 0, n) for t, n in loads.items()])
    assert plan.moves == () and why in plan.reason


def test_registry_drops_stale_and_unreadable_entries() -> None:
    raw = {b"a:1": b"10000:3", b"b:1": b"8400:1", b"c:1": b"garbage", b"d:1": b"9999:-1"}
    live, stale = parse_registry(raw, now_ms=10_000, lease_ms=500)
    assert live == [Replica("a:1", 10_000, 3)]
    assert sorted(stale) == ["b:1", "c:1", "d:1"]


@pytest.fixture
def own_redis_server(tmp_path):
    """A Redis server of this test's own (the session's holds other tests' jobs and leases)."""
    srv = start_server(tmp_path / "redis", appendonly=False)
    yield srv
    srv.stop()


def _replica(url: str, name: str) -> Coordinator:
    return Coordinator(redis.Redis.from_url(url), instance_id=name, lease_ttl=LEASE_TTL)


def _drive(replicas: list[Coordinator], until, timeout: float = 20.0) -> None:
    """Run every replica's ``run_once`` in turn until ``until()`` holds."""

    def done() -> bool:
        if until():
            return True
        for c in replicas:
            # no blocking read: Redis times blocked reads out at its ~100 ms clock, which
            # would leave each replica's turn too far apart to keep its leases
            c.run_once(block_ms=0)
        return False

    leads = lambda: {c.instance_id: sorted(c.leads) for c in replicas}  # noqa: E731
    wait_until(done, timeout, lambda: f"the replicas to settle; they lead {leads()}", interval=0)


def _holders(r: redis.Redis, jobs: list[str]) -> dict[str, str | None]:
    out = {}
    for j in jobs:
        raw = r.get(job_keys(j).lease)
        out[j] = raw.decode().split(":")[0] if raw else None
    return out


def test_replicas_share_jobs_and_take_over_a_dead_ones(own_redis_server) -> None:
    r = redis.Redis.from_url(own_redis_server.url)
    jobs = [f"bal{i}" for i in range(6)]
    for j in jobs:
        create_job(r, JobSpec(name=j, entrypoint="simulate", min_workers=1, max_workers=2, global_batch_size=4))
    a = _replica(own_redis_server.url, "a")
    a.run_once(block_ms=1)
    assert sorted(a.leads) == jobs  # first come, first served
    b, c = _replica(own_redis_server.url, "b"), _replica(own_redis_server.url, "c")
    every = [a, b, c]
    _drive(every, lambda: sorted(len(x.leads) for x in every) == [2, 2, 2])
    # each job has exactly one leader, and the lease in Redis agrees with who serves it
    holders = _holders(r, jobs)
    assert all(holders[j] == x.instance_id for x in every for j in x.leads), (str(holders), {x.instance_id: sorted(x.leads) for x in every})
    assert a.stats.handoffs == 4 and b.stats.handoffs == c.stats.handoffs == 0
    # every handed-over job got a larger fencing epoch
    assert all(int(r.get(job_keys(j).epoch)) == 2 for j in list(b.leads) + list(c.leads))

    # a job handed over keeps serving: events sent to it are answered by its new leader
    moved = next(iter(b.leads))
    join = JoinRequest(job_id=moved, host="h", pid=1)
    bus.publish(r, job_keys(moved).events, join)
    _drive(every, lambda: r.llen(job_keys(moved).join_reply(join.event_id)) == 1)

    # c dies without a word (no release): its jobs are taken once its leases lapse, and its
    # registry entry ages out, after which a and b share all six
    del every[2]
    _drive(every, lambda: sorted(len(x.leads) for x in every) == [3, 3] and None not in _holders(r, jobs).values()
           and c.token.encode() not in r.hkeys(COORDINATORS))
    assert set(_holders(r, jobs).values()) == {"a", "b"}

    # a graceful stop leaves the registry and hands every job over at once
    b.release_all()
    _drive([a], lambda: len(a.leads) == 6)
    assert r.hkeys(COORDINATORS) == [a.token.encode()]


def test_a_handoff_to_a_dead_replica_expires(own_redis_server) -> None:
    """The heir named in a handoff died before taking the job: after the hint expires, any
    replica takes the job."""
    r = redis.Redis.from_url(own_redis_server.url)
    create_job(r, JobSpec(name="orphan", entrypoint="simulate", min_workers=1, max_workers=2, global_batch_size=4))
    a = _replica(own_redis_server.url, "a")
    a.run_once(block_ms=1)
    keys = job_keys("orphan")
    assert a.leases.hand_off(keys, a.token, "ghost:0", hint_ms=int(LEASE_TTL * 2000))
    a.leads.clear()
    assert a.leases.hold(keys, a.token, int(LEASE_TTL * 1000)) == 0  # reserved for the heir
    _drive([a], lambda: "orphan" in a.leads)
    assert r.get(keys.handoff) is None and int(r.get(keys.epoch)) == 2
