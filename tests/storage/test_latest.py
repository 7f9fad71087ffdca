"""The Redis LATEST pointer: JSON at job_keys(job).latest, compare-and-set forwards only."""

from __future__ import annotations

import json

import pytest
import redis
from tests.storage.support import dead_redis

from shoal.events.keys import job_keys
from shoal.storage.errors import LatestRegression, PointerCorrupt, StorageUnavailable
from shoal.storage.latest import CAS_LUA, LatestPointer, cas_args, publish_latest, read_pointer


def test_publish_and_read_roundtrip(r: redis.Redis, job_id: str) -> None:
    assert read_pointer(r, job_id) is None
    ptr = LatestPointer(step=12, store="s3://b/jobs/x", generation=3)
    publish_latest(r, job_id, ptr)
    assert read_pointer(r, job_id) == ptr
    raw = json.loads(r.get(job_keys(job_id).latest))
    assert raw == {"step": 12, "store": "s3://b/jobs/x", "generation": 3, "checkpoint": "step-000000012"}


def test_never_moves_backwards(r: redis.Redis, job_id: str) -> None:
    publish_latest(r, job_id, LatestPointer(step=10, store="file:///a"))
    with pytest.raises(LatestRegression, match="step 10"):
        publish_latest(r, job_id, LatestPointer(step=9, store="file:///a"))
    assert read_pointer(r, job_id).step == 10
    publish_latest(r, job_id, LatestPointer(step=10, store="file:///a", generation=2))  # same step ok
    publish_latest(r, job_id, LatestPointer(step=11, store="file:///a"))
    assert read_pointer(r, job_id).step == 11


def test_cas_script_is_atomic_under_concurrent_publishers(r: redis.Redis, job_id: str) -> None:
    # Interleave publishers that go up and down; the final value is the max ever offered.
    import random
    import threading

    steps = list(range(200))
    random.Random(7).shuffle(steps)
    errors: list[int] = []

    def worker(chunk: list[int]) -> None:
        client = redis.Redis(connection_pool=r.connection_pool)
        for s in chunk:
            try:
                publish_latest(client, job_id, LatestPointer(step=s, store="memory://x"))
            except LatestRegression:
                errors.append(s)

    threads = [threading.Thread(target=worker, args=(steps[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert read_pointer(r, job_id).step == 199
    assert errors and 199 not in errors


def test_corrupt_value_is_reported_on_read_and_replaced_on_publish(r: redis.Redis, job_id: str) -> None:
    key = job_keys(job_id).latest
    r.set(key, b"{not json")
    with pytest.raises(PointerCorrupt):
        read_pointer(r, job_id)
    r.set(key, json.dumps({"step": 3, "store": "x", "checkpoint": "step-000000004"}))
    with pytest.raises(PointerCorrupt, match="inconsistent"):
        read_pointer(r, job_id)
    r.set(key, b"{not json")
    publish_latest(r, job_id, LatestPointer(step=1, store="x"))
    assert read_pointer(r, job_id).step == 1


def test_script_and_args_are_reusable_by_a_wrapper(r: redis.Redis, job_id: str) -> None:
    key = job_keys(job_id).latest
    assert r.eval(CAS_LUA, 1, key, *cas_args(LatestPointer(step=5, store="x"))) == -1
    assert r.eval(CAS_LUA, 1, key, *cas_args(LatestPointer(step=4, store="x"))) == 5


def test_unreachable_redis_is_storage_unavailable(job_id: str) -> None:
    dead = dead_redis()
    with pytest.raises(StorageUnavailable):
        read_pointer(dead, job_id)
    with pytest.raises(StorageUnavailable):
        publish_latest(dead, job_id, LatestPointer(step=1, store="x"))


def test_invalid_job_id_rejected(r: redis.Redis) -> None:
    with pytest.raises(ValueError):
        publish_latest(r, "bad{id}", LatestPointer(step=1, store="x"))


def test_no_replica_confirming_is_storage_unavailable(r: redis.Redis, job_id: str, monkeypatch) -> None:
    """Under Sentinel (here: one replica asked of a server that has none) a move or a read no
    replica confirmed is StorageUnavailable, as an unreachable Redis is, and nothing after it
    counts on it; the move itself may stay on the server (WAIT is no transaction), so a retry
    is a compare-and-set that changes nothing."""
    monkeypatch.setenv("SHOAL_REDIS_WAIT_REPLICAS", "1")
    ptr = LatestPointer(step=7, store="x")
    with pytest.raises(StorageUnavailable, match="0 of 1 replica"):
        publish_latest(r, job_id, ptr)
    with pytest.raises(StorageUnavailable, match="0 of 1 replica"):
        read_pointer(r, job_id)
    monkeypatch.setenv("SHOAL_REDIS_WAIT_REPLICAS", "0")
    assert read_pointer(r, job_id) == ptr
    publish_latest(r, job_id, ptr)  # the retry: the same pointer again is no regression
