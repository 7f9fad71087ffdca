"""The heartbeat's membership answer (what the commit fence asks before a step is applied).
fakeredis; heartbeats are aged by moving the last confirmation back, not by sleeping."""

from __future__ import annotations

import threading
import time

import fakeredis
import pytest
import redis

from shoal.events.keys import job_keys
from shoal.worker.heartbeat import CutOff, Heartbeater


def _watched(client: redis.Redis, keys, wid: str) -> Heartbeater:
    client.zadd(keys.last_seen, {wid: 0})
    return Heartbeater(client, keys, wid, interval=0.2, ttl=1.5)


def test_recent_beats_answer_without_redis_and_old_ones_ask_it() -> None:
    client, keys = fakeredis.FakeRedis(), job_keys("hb")
    hb = _watched(client, keys, "w0")
    assert hb.beat()
    client.zadd(keys.last_seen, {"w0": 1})  # marks what a beat would overwrite
    assert hb.still_member()  # confirmed a moment ago: no beat sent
    assert client.zscore(keys.last_seen, "w0") == 1

    hb.confirmed_at = time.monotonic() - 1.0  # more than half the TTL ago: ask Redis
    asked_at = time.monotonic()
    assert hb.still_member()
    assert client.zscore(keys.last_seen, "w0") > 1
    # the confirmation is the beat just sent (an order of clock readings, not a duration)
    assert hb.confirmed_at >= asked_at

    client.zrem(keys.last_seen, "w0")  # the coordinator declared it failed
    assert hb.still_member()  # still within half the TTL of the last confirmation
    hb.confirmed_at = time.monotonic() - 1.0
    assert not hb.still_member() and hb.evicted
    client.zadd(keys.last_seen, {"w0": 0})
    assert not hb.still_member()  # eviction is final for this incarnation


def test_an_unreachable_redis_within_the_ttl_does_not_stop_training() -> None:
    keys = job_keys("hb")
    dead = redis.Redis(port=1, socket_connect_timeout=0.2)  # nothing listens on port 1
    hb = Heartbeater(dead, keys, "w0", interval=0.2, ttl=1.5, fence_wait=0.5)
    hb.confirmed_at = time.monotonic() - 1.0  # past half the TTL: it asks, fails, and trusts the TTL
    assert hb.still_member() and not hb.evicted


def test_past_the_ttl_without_a_confirmed_beat_nothing_is_committed() -> None:
    """The coordinator may have declared a worker failed once its TTL passed without a beat:
    the fence retries for ``fence_wait``, then gives the step up (CutOff), not evicted."""
    keys = job_keys("hb")
    dead = redis.Redis(port=1, socket_connect_timeout=0.2)
    hb = Heartbeater(dead, keys, "w0", interval=0.1, ttl=1.5, fence_wait=0.5)
    hb.confirmed_at = time.monotonic() - 5.0
    started = time.monotonic()
    with pytest.raises(CutOff, match="cut off from Redis: no heartbeat confirmed for 5"):
        hb.still_member()
    assert 0.5 <= time.monotonic() - started < 3.0
    assert not hb.evicted  # it keeps its state and tries again once Redis is back


def test_the_fence_waits_for_redis_to_come_back_past_the_ttl() -> None:
    """Redis answers again while the fence waits: the step commits (the coordinator counts
    heartbeats from its own return, so the worker is still a member)."""
    client, keys = fakeredis.FakeRedis(), job_keys("hb")
    client.zadd(keys.last_seen, {"w0": 0})
    hb = Heartbeater(client, keys, "w0", interval=0.05, ttl=1.5, fence_wait=5.0)
    hb.confirmed_at = time.monotonic() - 5.0
    calls = []
    real = hb.beat

    def flaky(*, client=None):  # the first two beats find Redis down
        calls.append(1)
        if len(calls) <= 2:
            raise redis.ConnectionError("down")
        return real(client=client)

    hb.beat = flaky
    assert hb.still_member() and len(calls) == 3


def test_during_an_outage_the_fence_trusts_the_thread_unless_the_thread_was_frozen_too() -> None:
    client, keys = fakeredis.FakeRedis(), job_keys("hb")
    hb = Heartbeater(client, keys, "w0", interval=0.2, ttl=1.5)  # not watched: a beat would say evicted
    hb.confirmed_at = time.monotonic() - 1.0  # past half the TTL, within the TTL
    hb._failing_since = hb._tried_at = time.monotonic()  # the thread's beats are failing right now
    assert hb.still_member() and not hb.evicted  # no beat sent: the server is down
    hb.confirmed_at = time.monotonic() - 5.0  # past the TTL: nothing unconfirmed is committed - ask
    assert not hb.still_member() and hb.evicted
    hb.evicted, hb.confirmed_at = False, time.monotonic() - 1.0
    hb._tried_at = time.monotonic() - 5.0  # ... or the whole process was frozen: ask
    assert not hb.still_member() and hb.evicted


def test_a_blackholed_redis_holds_the_fence_for_its_own_short_timeout_not_the_socket_timeout() -> None:
    """A server that accepts connections and never answers (packets dropped past the
    handshake) must not hold a step for the client's 10 s socket timeout: the fence's own beat
    gives up after ``fence_timeout`` (within the TTL of the last confirmed beat, the step
    commits)."""
    import socket

    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)  # the kernel completes handshakes; nobody ever reads
        client = redis.Redis(port=hole.getsockname()[1], socket_timeout=10, socket_connect_timeout=10)
        hb = Heartbeater(client, job_keys("hb"), "w0", interval=0.2, ttl=2.0, fence_wait=1.0)
        assert hb.fence_timeout == 0.5
        hb.confirmed_at = time.monotonic() - 1.1  # past half the TTL: the fence asks Redis
        started = time.monotonic()
        assert hb.still_member() and not hb.evicted
        took = time.monotonic() - started
        hb.stop()
    assert took < 3.0, f"the fence held the step {took:.1f} s"


def test_a_beat_for_an_id_now_recorded_as_another_process_finds_it_evicted() -> None:
    """Worker ids restart after Redis lost its data: a process whose record was lost can find
    its old id watched again as another process's (which learnt of the loss first and joined
    anew). Its beat must find it evicted - so it rejoins - not keep that membership alive.
    The fresh-clone suite caught it once: the job then waited for a worker that never came."""
    from shoal.events.records import WorkerRecord
    from shoal.events.states import WorkerState

    client, keys = fakeredis.FakeRedis(), job_keys("hb")
    client.zadd(keys.last_seen, {"w0": 0})
    client.hset(keys.workers, "w0", WorkerRecord("w0", WorkerState.ACTIVE, pid=4242).to_json())
    mine = Heartbeater(client, keys, "w0", interval=0.2, ttl=1.5, pid=4242)
    assert mine.beat() and not mine.evicted
    before = client.zscore(keys.last_seen, "w0")
    lost = Heartbeater(client, keys, "w0", interval=0.2, ttl=1.5, pid=5151)  # the id's old process
    assert not lost.beat() and lost.evicted
    assert client.zscore(keys.last_seen, "w0") == before  # nothing written for the other process
    unchecked = Heartbeater(client, keys, "w0", interval=0.2, ttl=1.5)  # pid 0: any process
    assert unchecked.beat()
    client.hset(keys.workers, "w0", WorkerRecord("w0", WorkerState.ACTIVE).to_json())  # no pid recorded
    assert Heartbeater(client, keys, "w0", interval=0.2, ttl=1.5, pid=5151).beat()


def test_no_step_commits_once_the_process_decided_to_end(monkeypatch) -> None:
    """The fence (the last check before a step is applied) refuses every step from the moment a
    thread decided to end the process for a restart (its replica group went whole): the log
    flush before the exit takes milliseconds, in which the training thread committed a step its
    evicted peers never did (issue 34)."""
    from types import SimpleNamespace

    from shoal.worker import restart
    from shoal.worker.errors import StepAborted
    from shoal.worker.training import TrainingWorker

    worker = SimpleNamespace(hb=None)
    TrainingWorker._fence(worker)  # nothing decided: the step goes on
    monkeypatch.setattr(restart, "_ending", threading.Event())
    restart._ending.set()
    with pytest.raises(StepAborted, match="ending for its node agent"):
        TrainingWorker._fence(worker)
