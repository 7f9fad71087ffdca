"""The coordinator loop against a real Redis, driven step by step with run_once()."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis

from shoal.coordinator.errors import StaleEpoch
from shoal.coordinator.fenced import FencedBatch
from shoal.coordinator.loop import Coordinator, return_grace_ms, server_ms
from shoal.events import bus
from shoal.events.keys import COORDINATOR_GROUP, job_keys
from shoal.events.states import LIVE
from shoal.events.models import JoinRequest, Ready
from shoal.ops.embedded import server_binary
from shoal.core.registry import create_job
from shoal.worker.heartbeat import Heartbeater
from shoal.worker.membership import Membership
from tests.helpers import job_spec, wait_until


#: the simulated job of these tests (job_spec: over the tests' common defaults)
SIMULATED_JOB = dict(entrypoint="simulate", min_workers=1, global_batch_size=12)


def _join_all(client_url: str, job_id: str, n: int, coord: Coordinator) -> list:
    """Join n workers concurrently while driving the coordinator; returns ids or errors."""
    results: list = [None] * n

    def go(i: int) -> None:
        try:
            results[i] = Membership(redis.Redis.from_url(client_url), job_id).join(10)
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            results[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        coord.run_once(block_ms=20)
    return results


def test_takeover_fences_the_old_leader_and_reclaims_its_pending_events(r, redis_url, job_id) -> None:
    keys = job_keys(job_id)
    create_job(r, job_spec(job_id, SIMULATED_JOB))
    a = Coordinator(redis.Redis.from_url(redis_url), instance_id="a", lease_ttl=5)
    a.run_once(block_ms=1)
    assert a.leads[job_id].epoch == 1
    # two joins arrive; A reads them (they are now pending on A) and then "hangs"
    joins = [JoinRequest(job_id=job_id, host="h", pid=i) for i in range(2)]
    for ev in joins:
        bus.publish(r, keys.events, ev)
    delivered = bus.read_new(r, [keys.events], "a", count=10, block_ms=None)
    assert len(delivered[keys.events]) == 2
    # A's lease lapses; B takes over with a larger epoch
    r.delete(keys.lease)
    b = Coordinator(redis.Redis.from_url(redis_url), instance_id="b", lease_ttl=5)
    b.run_once(block_ms=1)
    assert b.leads[job_id].epoch == 2
    # nothing lost: B reclaimed A's pending entries and answered both joins
    for ev in joins:
        assert r.lpop(keys.join_reply(ev.event_id)) is not None
    assert bus.group_info(r, keys.events).pending == 0
    # the old leader wakes up: its writes are refused and change nothing
    before = r.hgetall(keys.state)
    with pytest.raises(StaleEpoch):
        a.leads[job_id].writer.commit(FencedBatch(keys).hset(keys.state, {"state": "failed"}))
    assert r.hgetall(keys.state) == before
    # and its loop drops the job instead of acting on it
    late = JoinRequest(job_id=job_id, host="h", pid=9)
    bus.publish(r, keys.events, late)
    a._last_lease_ms = 10**15  # skip A's lease refresh: it still believes it leads
    a.run_once(block_ms=1)
    assert job_id not in a.leads
    # the entry A read before being fenced is reclaimed by the leader, not lost
    assert r.llen(keys.join_reply(late.event_id)) == 0
    b.reclaim(b.leads[job_id], min_idle_ms=0, now=0)
    assert r.lpop(keys.join_reply(late.event_id)) is not None


def test_a_join_a_fenced_out_replica_read_late_is_applied_after_a_newer_one(r, redis_url, job_id) -> None:
    """B leads; A, fenced out but not yet aware of it, reads join E1 into its pending list;
    B applies the newer join E2 first, then reclaims E1: E1 must be applied (answered, a
    member), not acknowledged as "older than applied" (seen: a worker waited 30 s for its
    reply and exited; 20 jobs on a slow machine, tests/processes/test_load_many_jobs.py)."""
    keys = job_keys(job_id)
    create_job(r, job_spec(job_id, SIMULATED_JOB))
    b = Coordinator(redis.Redis.from_url(redis_url), instance_id="b", lease_ttl=5)
    b.run_once(block_ms=1)
    assert job_id in b.leads
    e1, e2 = (JoinRequest(job_id=job_id, host="h", pid=i) for i in (1, 2))
    bus.publish(r, keys.events, e1)
    assert len(bus.read_new(r, [keys.events], "a", count=10, block_ms=None)[keys.events]) == 1  # A's late read
    bus.publish(r, keys.events, e2)
    b.run_once(block_ms=50)
    assert r.lpop(keys.join_reply(e2.event_id)) is not None
    assert r.llen(keys.join_reply(e1.event_id)) == 0  # still pending on A
    applied = r.hget(keys.state, "applied")
    b.reclaim(b.leads[job_id], min_idle_ms=0, now=0)
    assert r.lpop(keys.join_reply(e1.event_id)) is not None
    assert sorted(rec["pid"] for rec in _records(r, keys)) == [1, 2]
    assert bus.group_info(r, keys.events).pending == 0
    assert r.hget(keys.state, "applied") == applied  # the newest applied id does not move back


def test_an_event_whose_handler_failed_once_is_applied_on_its_retry_after_newer_ones(r, redis_url, job_id, monkeypatch) -> None:
    """A handler that fails once on E1 leaves E1 pending for a retry while the batch goes on
    to E2; the retry applies E1 (before: acknowledged unapplied, as older than E2)."""
    import shoal.coordinator.loop as loop

    keys = job_keys(job_id)
    create_job(r, job_spec(job_id, SIMULATED_JOB))
    c = Coordinator(redis.Redis.from_url(redis_url), instance_id="c", lease_ttl=5)
    c.run_once(block_ms=1)
    e1, e2 = (JoinRequest(job_id=job_id, host="h", pid=i) for i in (1, 2))
    real, failed = loop.decide, []

    def flaky(state, inp, *args, **kwargs):
        if getattr(inp, "event", None) is not None and inp.event.event_id == e1.event_id and not failed:
            failed.append(inp.stream_id)
            raise RuntimeError("transient")
        return real(state, inp, *args, **kwargs)

    monkeypatch.setattr(loop, "decide", flaky)
    for ev in (e1, e2):
        bus.publish(r, keys.events, ev)
    c.run_once(block_ms=50)
    assert failed and r.lpop(keys.join_reply(e2.event_id)) is not None
    c.run_once(block_ms=1)  # the retry of our own pending entry
    assert r.lpop(keys.join_reply(e1.event_id)) is not None
    assert sorted(rec["pid"] for rec in _records(r, keys)) == [1, 2]
    assert bus.group_info(r, keys.events).pending == 0


def _records(r, keys) -> list[dict]:
    return [json.loads(v) for v in r.hvals(keys.workers)]


def test_redelivered_event_changes_nothing(r, redis_url, job_id) -> None:
    keys = job_keys(job_id)
    create_job(r, job_spec(job_id, SIMULATED_JOB))
    c = Coordinator(redis.Redis.from_url(redis_url), instance_id="c")
    c.run_once(block_ms=1)
    (wid,) = _join_all(redis_url, job_id, 1, c)
    c.tick(10**15)  # settle the join -> generation 1
    sid = bus.publish(r, keys.events, Ready(job_id=job_id, worker_id=wid, generation=1))
    c.run_once(block_ms=50)
    snapshot = (r.hgetall(keys.state), r.hgetall(keys.workers), r.xlen(keys.control))
    # a first delivery at or below applied (as from a consumer group created anew over the stream)
    fields = r.xrange(keys.events, sid, sid)[0][1]
    c._apply_entry(c.leads[job_id], sid, fields, now=0)
    assert (r.hgetall(keys.state), r.hgetall(keys.workers), r.xlen(keys.control)) == snapshot


def test_garbage_from_redis_cli_is_dead_lettered_and_service_continues(r, redis_url, redis_server, job_id) -> None:
    keys = job_keys(job_id)
    create_job(r, job_spec(job_id, SIMULATED_JOB))
    c = Coordinator(redis.Redis.from_url(redis_url), instance_id="c")
    c.run_once(block_ms=1)
    cli = str(Path(server_binary()).with_name("valkey-cli"))
    port = str(redis_server.port)
    junk = [
        ["hello", "world"],
        ["data", "{not json"],
        ["data", '{"kind": "ready", "job_id": "' + job_id + '", "gener'],
        ["data", '{"kind": "ready", "job_id": "' + job_id + '", "generation": "soon"}'],
        ["data", "x" * 70000],
    ]
    for fields in junk:
        subprocess.run([cli, "-p", port, "XADD", keys.events, "*", *fields], check=True, capture_output=True, timeout=10)
    ids = _join_all(redis_url, job_id, 1, c)
    assert ids == ["w0"]  # the coordinator kept serving
    dead = r.xrange(keys.dead)
    reasons = [d[b"reason"].decode() for _, d in dead]
    assert len(dead) == len(junk)
    assert any("no 'data' field" in x for x in reasons)
    assert any("oversized" in x for x in reasons)
    assert sum("not JSON" in x for x in reasons) == 2
    assert any("schema" in x for x in reasons)
    assert bus.group_info(r, keys.events).pending == 0


def test_trim_never_drops_unacknowledged_entries(r, redis_url, job_id) -> None:
    keys = job_keys(job_id)
    create_job(r, job_spec(job_id, SIMULATED_JOB))
    c = Coordinator(redis.Redis.from_url(redis_url), instance_id="c", trim_interval=0)
    c.run_once(block_ms=1)
    _join_all(redis_url, job_id, 2, c)
    # an entry delivered to a crashed consumer stays pending; one more is not yet delivered
    bus.publish(r, keys.events, Ready(job_id=job_id, worker_id="w0", generation=7))
    bus.read_new(r, [keys.events], "crashed", count=1, block_ms=None)
    later = bus.publish(r, keys.events, Ready(job_id=job_id, worker_id="w1", generation=8))
    c.trim(c.leads[job_id])
    remaining = [sid.decode() for sid, _ in r.xrange(keys.events)]
    assert later in remaining and len(remaining) == 2  # handled joins trimmed, the rest kept
    assert r.xpending(keys.events, COORDINATOR_GROUP)["pending"] == 1


def test_keys_deleted_under_a_running_coordinator_do_not_kill_it(r, redis_url, job_id) -> None:
    keys = job_keys(job_id)
    create_job(r, job_spec(job_id, SIMULATED_JOB))
    c = Coordinator(redis.Redis.from_url(redis_url), instance_id="c", lease_ttl=5, block_ms=10)
    c.run_once(block_ms=1)
    assert job_id in c.leads
    r.delete(keys.events)  # its stream and consumer group vanish (a purge racing the leader)
    r.srem("shoal:jobs", job_id)
    stop = threading.Event()
    t = threading.Thread(target=c.run, args=(stop,), daemon=True)
    t.start()
    other = job_id + "-b"
    create_job(r, job_spec(other, SIMULATED_JOB))
    ev = JoinRequest(job_id=other, host="h", pid=1)
    bus.publish(r, job_keys(other).events, ev)
    got = r.blpop([job_keys(other).join_reply(ev.event_id)], timeout=15)
    stop.set()
    t.join(10)
    assert got is not None  # still serving other jobs
    assert job_id not in c.leads


def test_after_an_outage_a_silent_worker_is_failed_after_the_grace_not_a_full_ttl(r, redis_url, job_id) -> None:
    """A coordinator back from a Redis outage (or a takeover) reloads its leads. A worker whose
    last beat is long gone (it died before the outage) is failed once the return grace passed
    (two beat intervals and a second, 2 s here), not a full TTL (4 s) after the return; a worker
    that beats on is kept."""
    keys = job_keys(job_id)
    spec = job_spec(job_id, SIMULATED_JOB, min_workers=1, heartbeat_ttl=4.0, heartbeat_interval=0.5)
    create_job(r, spec)
    c = Coordinator(redis.Redis.from_url(redis_url), instance_id="c", tick_interval=0.05)
    c.run_once(block_ms=1)
    quiet, beating = _join_all(redis_url, job_id, 2, c)
    beats = {w: Heartbeater(redis.Redis.from_url(redis_url), keys, w, interval=0.5, ttl=4.0) for w in (quiet, beating)}
    for hb in beats.values():
        hb.start()
    try:
        deadline = time.monotonic() + 30
        while not all(c.leads[job_id].state.workers[w].state in LIVE for w in (quiet, beating)):
            assert time.monotonic() < deadline, c.leads[job_id].state.workers
            c.run_once(block_ms=20)
        beats[quiet].stop()
        now = server_ms(r)
        r.zadd(keys.last_seen, {quiet: now - 60_000}, xx=True)  # it died a minute ago, before the outage
        c.leads.clear()  # what run() does on a ConnectionError; the next iteration takes the job again
        c._last_lease_ms = 0
        c.run_once(block_ms=1)
        taken = c.leads[job_id].taken_ms
        while c.leads[job_id].state.workers[quiet].state in LIVE:
            assert time.monotonic() < deadline, "the silent worker was never failed"
            c.run_once(block_ms=20)
        failed_at = server_ms(r)
        assert c.leads[job_id].state.workers[beating].state in LIVE
    finally:
        for hb in beats.values():
            hb.stop()
    grace = return_grace_ms(spec)
    assert grace == 2000
    assert grace <= failed_at - taken < grace + 700 < 4000, (failed_at - taken, grace)


def test_a_long_batch_of_entries_still_ticks_and_renews_the_lease(r, redis_url, job_id, monkeypatch) -> None:
    """Applying a batch can take seconds (a large switch's Readys, each a fenced write and
    under Sentinel a WAIT): ticks (failure detection) and lease renewals go on between its
    entries, not only between batches."""
    keys = job_keys(job_id)
    create_job(r, job_spec(job_id, SIMULATED_JOB))
    c = Coordinator(redis.Redis.from_url(redis_url), instance_id="c", lease_ttl=1.5, tick_interval=0.05, batch=100)
    c.run_once(block_ms=1)
    assert job_id in c.leads
    for i in range(100):
        r.xadd(keys.events, {"filler": str(i)})
    seen: list[tuple[int, int]] = []

    def slow(lead, sid, fields, now, **_) -> None:  # 20 ms an entry: the batch takes 2 s, longer than the lease
        time.sleep(0.02)
        seen.append((c.stats.ticks, r.pttl(keys.lease)))

    monkeypatch.setattr(c, "_apply_entry", slow)
    c.run_once(block_ms=50)
    assert len(seen) == 100
    assert seen[-1][0] - seen[0][0] >= 10, seen  # ~40 tick intervals passed inside the batch
    assert min(ttl for _t, ttl in seen) > 0, seen  # the lease never lapsed
    assert job_id in c.leads


def test_a_join_nobody_answers_ends_at_its_own_timeout(r, redis_url, job_id) -> None:
    """No coordinator: the join ends with JoinTimeout at its timeout, not at the client's socket
    timeout and ride-out retries (the reply is awaited in blocks well inside the socket timeout)."""
    from shoal.core.connection import connect
    from shoal.worker.membership import JoinTimeout

    create_job(r, job_spec(job_id, SIMULATED_JOB))
    client = connect(redis_url, timeout=1.0, ride_out=60)  # a socket timeout shorter than the join's
    started = time.monotonic()
    with pytest.raises(JoinTimeout):
        Membership(client, job_id).join(3)
    assert 3 <= time.monotonic() - started < 5


def test_an_idle_coordinator_wakes_once_a_tick(r, redis_url, job_id) -> None:
    """With nothing to read, each iteration blocks until the next tick is due, then ticks: one
    wake-up (two TIMEs, one read) a tick. A fixed 50 ms block woke it four times per 200 ms
    tick here, three of them for nothing."""
    create_job(r, job_spec(job_id, SIMULATED_JOB))
    c = Coordinator(redis.Redis.from_url(redis_url), instance_id="idle", tick_interval=0.2)
    wait_until(lambda: (c.run_once(), job_id in c.leads)[1], 10, "the lead")
    while c.run_once():  # what the job's stream holds already
        pass
    before = c.stats.ticks
    for _ in range(6):
        assert c.run_once() == 0
    assert c.stats.ticks - before >= 5, c.stats.ticks - before
