"""Retention: keep-last-K, LATEST protection, garbage collection of partial checkpoints."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tests.storage.support import HookedStore, tiny_state

from shoal.storage.backend import ObjectStore
from shoal.storage.checkpoint import load_latest, save_checkpoint
from shoal.storage.layout import LATEST, file_key, manifest_key
from shoal.storage.local import LocalStore
from shoal.storage.memory import MemoryStore
from shoal.storage.retention import apply_retention
from shoal.storage.verify import list_checkpoint_steps


def _point_latest(s: ObjectStore, step: int) -> None:
    s.put_bytes(LATEST, json.dumps({"step": step, "checkpoint": f"step-{step:09d}"}).encode())


def test_keeps_last_three_by_default(object_store: ObjectStore) -> None:
    for step in range(1, 7):
        save_checkpoint(object_store, tiny_state(step))
    assert list_checkpoint_steps(object_store) == [4, 5, 6]
    assert object_store.list("step-000000003") == []
    assert load_latest(object_store)[0].step == 6


def test_keep_last_is_configurable() -> None:
    s = MemoryStore()
    for step in range(1, 6):
        save_checkpoint(s, tiny_state(step), keep_last=1)
    assert list_checkpoint_steps(s) == [5]
    for step in range(6, 9):
        save_checkpoint(s, tiny_state(step), keep_last=None)
    assert list_checkpoint_steps(s) == [5, 6, 7, 8]


def test_never_deletes_what_latest_names() -> None:
    s = MemoryStore()
    for step in range(1, 7):
        save_checkpoint(s, tiny_state(step), keep_last=None)
    _point_latest(s, 2)
    deleted = apply_retention(s, keep_last=2)
    assert deleted == [1, 3, 4]
    assert list_checkpoint_steps(s) == [2, 5, 6]
    assert load_latest(s)[0].step == 2


def test_protect_keeps_extra_steps() -> None:
    s = MemoryStore()
    for step in range(1, 6):
        save_checkpoint(s, tiny_state(step), keep_last=None)
    apply_retention(s, keep_last=1, protect=[2])
    assert list_checkpoint_steps(s) == [2, 5]


def test_save_keeps_what_the_redis_pointer_names_and_skips_retention_when_it_cannot_tell() -> None:
    """The soak found it: while the coordinator was away the Redis LATEST pointer stayed at a
    step that retention, counting only the store's newest, then deleted."""
    s = MemoryStore()
    for step in range(1, 6):  # the pointer stays at step 2 while the store's LATEST moves on
        save_checkpoint(s, tiny_state(step), keep_last=2, protect=lambda: [2])
    assert list_checkpoint_steps(s) == [2, 4, 5]
    warnings: list[str] = []

    def unreachable():
        raise ConnectionError("Redis is down")

    save_checkpoint(s, tiny_state(6), keep_last=1, protect=unreachable, on_warning=warnings.append)
    assert list_checkpoint_steps(s) == [2, 4, 5, 6]  # nothing deleted without knowing the pin
    assert "retention after step 6 skipped" in warnings[0] and "Redis is down" in warnings[0]


def test_partial_checkpoints_older_than_newest_complete_are_collected() -> None:
    s = MemoryStore()
    save_checkpoint(s, tiny_state(1), keep_last=None)
    s.put_bytes(file_key(2, "model.pt"), b"orphan")  # died before its manifest
    save_checkpoint(s, tiny_state(3), keep_last=None)
    s.put_bytes(file_key(4, "model.pt"), b"in flight?")  # newer than newest complete: kept
    s.put_bytes(manifest_key(5), b"not json")  # manifest present but invalid, newer: kept
    deleted = apply_retention(s, keep_last=3)
    assert deleted == [2]
    assert list_checkpoint_steps(s) == [1, 3, 4, 5]
    save_checkpoint(s, tiny_state(6), keep_last=3)
    assert list_checkpoint_steps(s) == [1, 3, 6]


def test_deletion_removes_manifest_first() -> None:
    hooked = HookedStore(MemoryStore())
    for step in (1, 2):
        save_checkpoint(hooked, tiny_state(step), keep_last=None)
    hooked.ops.clear()
    apply_retention(hooked, keep_last=1)
    deletes = [k for op, k in hooked.ops if op == "delete"]
    assert deletes[0] == manifest_key(1)
    assert set(deletes[1:]) == {file_key(1, "model.pt"), file_key(1, "optimizer.pt")}


def test_local_deletion_leaves_no_empty_directories_and_sweeps_old_temporaries(tmp_path: Path) -> None:
    s = LocalStore(tmp_path / "ck")
    for step in (1, 2):
        save_checkpoint(s, tiny_state(step), keep_last=None)
    stale = tmp_path / "ck" / "step-000000002" / ".tmp-model.pt.abc"
    fresh = tmp_path / "ck" / "step-000000002" / ".tmp-model.pt.def"
    stale.write_bytes(b"leftover of a crash")
    fresh.write_bytes(b"a write in progress")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    apply_retention(s, keep_last=1)
    assert not (tmp_path / "ck" / "step-000000001").exists()
    assert not stale.exists() and fresh.exists()


def test_the_best_checkpoint_by_an_evaluation_metric_is_kept_besides_the_newest() -> None:
    """``checkpoint_keep_best: {metric: val_loss, mode: min}``: the worker's retention pins the
    step whose recorded evaluation is best (``storage/evals.py``, plain JSON records)."""
    from shoal.storage.evals import best_step, record_eval

    s = MemoryStore()
    losses = {1: 0.9, 2: 0.4, 3: 0.7, 4: 0.8, 5: 0.6}

    def pinned() -> list[int]:
        best = best_step(s, "val_loss", "min", set(list_checkpoint_steps(s)))
        return [best] if best is not None else []

    for step, loss in losses.items():
        save_checkpoint(s, tiny_state(step), keep_last=2, protect=pinned)
        record_eval(s, step, {"val_loss": loss, "val_accuracy": 1 - loss})
    assert list_checkpoint_steps(s) == [2, 4, 5]  # the newest two, and step 2 (val_loss 0.4)
    assert best_step(s, "val_accuracy", "max", {4, 5}) == 5
    assert best_step(s, "no_such_metric", "min", {2, 4, 5}) is None
    s.put_bytes("evals/step-000000009.json", b"not json")  # an unreadable record is skipped
    assert best_step(s, "val_loss", "min", set(list_checkpoint_steps(s))) == 2
