"""Resume: Redis pointer first, the store's LATEST when Redis lost it, a scan as last resort."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch
from tests.storage.support import Warnings, dead_redis, make_s3_store, tiny_state

from shoal.events.keys import job_keys
from shoal.storage.backend import ObjectStore
from shoal.storage.checkpoint import save_checkpoint
from shoal.storage.errors import NoCheckpoint
from shoal.storage.latest import LatestPointer, publish_latest, read_pointer
from shoal.storage.layout import LATEST
from shoal.storage.local import LocalStore
from shoal.storage.memory import MemoryStore
from shoal.storage.resume import resume


def _save_and_publish(store: ObjectStore, r: redis.Redis, job_id: str, step: int) -> None:
    manifest = save_checkpoint(store, tiny_state(step, cursor={"sample": step * 32, "epoch_seed": 5}))
    publish_latest(r, job_id, LatestPointer(step=manifest.step, store=store.uri, generation=manifest.generation))


def _wipe_job_keys(r: redis.Redis, job_id: str) -> int:
    n = 0
    for pattern in job_keys(job_id).all_patterns():
        for key in r.scan_iter(match=pattern):
            n += r.delete(key)
    return n


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_resume_after_redis_wipe_uses_store_latest(r: redis.Redis, job_id: str, tmp_path: Path, kind: str) -> None:
    store = LocalStore(tmp_path / "ck") if kind == "local" else make_s3_store()
    for step in (10, 20, 30):
        _save_and_publish(store, r, job_id, step)
    before, _ = resume(store, r, job_id)
    assert before.step == 30

    assert _wipe_job_keys(r, job_id) >= 1
    assert r.get(job_keys(job_id).latest) is None

    warnings = Warnings()
    after, manifest = resume(store, r, job_id, on_warning=warnings)
    assert (after.step, after.data_cursor, after.epoch, after.generation) == (
        before.step, before.data_cursor, before.epoch, before.generation)
    assert after.data_cursor == {"sample": 960, "epoch_seed": 5}
    assert torch.equal(after.model["w"], before.model["w"])
    assert "no Redis LATEST pointer" in warnings.text()


def test_resume_on_a_fresh_redis_database(redis_url: str, job_id: str, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "ck")
    old = redis.Redis.from_url(redis_url, db=0)
    for step in (1, 2):
        _save_and_publish(store, old, job_id, step)
    fresh = redis.Redis.from_url(redis_url, db=7)  # an empty server as far as we can tell
    fresh.flushdb()
    state, _ = resume(store, fresh, job_id)
    assert state.step == 2 and state.data_cursor["sample"] == 64


def test_redis_pointer_is_authoritative_when_present(r: redis.Redis, job_id: str) -> None:
    store = MemoryStore()
    _save_and_publish(store, r, job_id, 1)
    save_checkpoint(store, tiny_state(2))  # saved but never published in Redis
    assert resume(store, r, job_id)[0].step == 1
    assert resume(store)[0].step == 2  # no Redis: the store's LATEST


def test_pointer_to_a_removed_checkpoint_falls_back_to_store_latest(r: redis.Redis, job_id: str) -> None:
    store = MemoryStore()
    _save_and_publish(store, r, job_id, 1)
    for step in range(2, 6):
        save_checkpoint(store, tiny_state(step))  # retention removes step 1
    warnings = Warnings()
    assert resume(store, r, job_id, on_warning=warnings)[0].step == 5
    assert "Redis pointer's step 1" in warnings.text()


def test_pointer_for_another_store_is_ignored(r: redis.Redis, job_id: str) -> None:
    store = MemoryStore()
    save_checkpoint(store, tiny_state(3))
    publish_latest(r, job_id, LatestPointer(step=99, store="s3://elsewhere/x"))
    warnings = Warnings()
    assert resume(store, r, job_id, on_warning=warnings)[0].step == 3
    assert "s3://elsewhere/x" in warnings.text()


def test_corrupt_pointer_and_unreachable_redis_fall_back(r: redis.Redis, job_id: str) -> None:
    store = MemoryStore()
    save_checkpoint(store, tiny_state(4))
    r.set(job_keys(job_id).latest, b"garbage")
    warnings = Warnings()
    assert resume(store, r, job_id, on_warning=warnings)[0].step == 4
    assert "unusable" in warnings[0]
    dead = dead_redis()
    assert resume(store, dead, job_id)[0].step == 4


def test_wiped_redis_and_lost_latest_object_scan_manifests(r: redis.Redis, job_id: str) -> None:
    store = MemoryStore()
    for step in (5, 6):
        _save_and_publish(store, r, job_id, step)
    _wipe_job_keys(r, job_id)
    store.delete(LATEST)
    assert resume(store, r, job_id)[0].step == 6
    assert read_pointer(r, job_id) is None  # resume only reads Redis


def test_fresh_job_has_nothing_to_resume(r: redis.Redis, job_id: str) -> None:
    with pytest.raises(NoCheckpoint):
        resume(MemoryStore(), r, job_id)
