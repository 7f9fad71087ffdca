"""Checkpoint save/load: content, manifest, write order, LATEST, corruption fallback."""

from __future__ import annotations

import hashlib
import json
import random
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.storage.support import HookedStore, Warnings, tiny_state

from shoal.storage.backend import ObjectStore
from shoal.storage.checkpoint import load_checkpoint, load_latest, save_checkpoint
from shoal.storage.errors import CheckpointCorrupt, LatestRegression, NoCheckpoint
from shoal.storage.latest_object import read_latest_step
from shoal.storage.layout import LATEST, file_key, manifest_key
from shoal.storage.memory import MemoryStore
from shoal.storage.train_state import TrainState
from shoal.storage.verify import list_checkpoint_steps


def _train(model, opt, sched, steps: int) -> list[float]:
    """A few real optimizer steps that also consume every RNG we restore."""
    out = []
    for _ in range(steps):
        x = torch.randn(8, 4) + float(np.random.rand()) + random.random()
        loss = (model(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        out.append(loss.item())
    return out


def _setup(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def test_resumed_training_is_bit_identical_to_uninterrupted(object_store: ObjectStore) -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model, opt, sched = _setup(0)
    _train(model, opt, sched, 3)
    state = TrainState.capture(model, opt, sched, step=3, epoch=1, data_cursor={"shard": 2, "offset": 96},
                               generation=4, world_size=3)
    save_checkpoint(object_store, state)
    expected = _train(model, opt, sched, 4)
    expected_lr = sched.get_last_lr()

    # A different process state: other seeds, fresh objects.
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    model2, opt2, sched2 = _setup(99)
    loaded, manifest = load_latest(object_store)
    loaded.restore(model2, opt2, sched2)
    assert (loaded.step, loaded.epoch, loaded.data_cursor, loaded.generation, loaded.world_size) == (
        3, 1, {"shard": 2, "offset": 96}, 4, 3)
    assert _train(model2, opt2, sched2, 4) == expected
    assert sched2.get_last_lr() == expected_lr
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_manifest_records_fields_and_file_digests(object_store: ObjectStore) -> None:
    manifest = save_checkpoint(object_store, tiny_state(7, cursor=[1, "two", {"three": 3.5}]))
    on_disk = json.loads(object_store.get_bytes(manifest_key(7)))
    assert on_disk["step"] == 7 and on_disk["epoch"] == 0 and on_disk["generation"] == 1
    assert on_disk["world_size"] == 2 and on_disk["data_cursor"] == [1, "two", {"three": 3.5}]
    assert on_disk["torch_version"] == torch.__version__
    assert datetime.fromisoformat(on_disk["created_at"]).tzinfo is not None
    assert set(on_disk["files"]) == {"model.pt", "optimizer.pt"}
    for name, entry in on_disk["files"].items():
        data = object_store.get_bytes(file_key(7, name))
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert manifest.files["model.pt"].sha256 == on_disk["files"]["model.pt"]["sha256"]
    assert json.loads(object_store.get_bytes(LATEST))["step"] == 7


def test_write_order_files_then_manifest_then_latest() -> None:
    hooked = HookedStore(MemoryStore())
    save_checkpoint(hooked, tiny_state(5))
    puts = [k for op, k in hooked.ops if op == "put"]
    assert puts[-2:] == [manifest_key(5), LATEST]
    assert set(puts[:-2]) == {file_key(5, "model.pt"), file_key(5, "optimizer.pt")}
    # re-saving a step LATEST does not name first makes the old checkpoint invisible
    hooked.inner.delete(LATEST)
    hooked.ops.clear()
    save_checkpoint(hooked, tiny_state(5))
    writes = [(op, k) for op, k in hooked.ops if op != "get"]
    assert writes[0] == ("delete", manifest_key(5))


def test_resaving_the_published_step_never_unpublishes_it() -> None:
    """A job's final save can land on the step its periodic save just published: LATEST
    must name a complete checkpoint throughout (no delete, no rewrite)."""
    hooked = HookedStore(MemoryStore())
    first = save_checkpoint(hooked, tiny_state(5))
    hooked.ops.clear()
    again = save_checkpoint(hooked, tiny_state(5))
    assert [(op, k) for op, k in hooked.ops if op != "get"] == []
    assert again == first
    assert load_latest(hooked)[0].step == 5


def test_resaving_a_damaged_published_step_repairs_it() -> None:
    hooked = HookedStore(MemoryStore())
    save_checkpoint(hooked, tiny_state(5))
    key = file_key(5, "model.pt")
    hooked.inner.put_bytes(key, hooked.inner.get_bytes(key)[:-1])
    save_checkpoint(hooked, tiny_state(5))
    assert load_latest(hooked)[0].step == 5


def test_flipped_byte_falls_back_to_previous_and_says_why(object_store: ObjectStore) -> None:
    for step in (1, 2, 3):
        save_checkpoint(object_store, tiny_state(step))
    key = file_key(3, "model.pt")
    data = bytearray(object_store.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    object_store.put_bytes(key, bytes(data))

    warnings = Warnings()
    state, manifest = load_latest(object_store, on_warning=warnings)
    assert state.step == 2 and manifest.step == 2
    assert torch.equal(state.model["w"], torch.full((64,), 2.0))
    assert len(warnings) == 1
    assert "step 3" in warnings[0] and "sha256" in warnings[0] and "model.pt" in warnings[0]
    with pytest.raises(CheckpointCorrupt, match="sha256"):
        load_checkpoint(object_store, 3)


def test_truncated_file_falls_back_and_says_why(object_store: ObjectStore) -> None:
    for step in (1, 2):
        save_checkpoint(object_store, tiny_state(step))
    key = file_key(2, "optimizer.pt")
    object_store.put_bytes(key, object_store.get_bytes(key)[:-10])
    warnings = Warnings()
    state, _ = load_latest(object_store, on_warning=warnings)
    assert state.step == 1
    assert "truncated" in warnings.text() and "optimizer.pt" in warnings.text()


def test_missing_state_file_and_garbage_manifest_fall_back() -> None:
    s = MemoryStore()
    for step in (1, 2, 3):
        save_checkpoint(s, tiny_state(step), keep_last=None)
    s.delete(file_key(3, "model.pt"))
    s.put_bytes(manifest_key(2), b'{"step": 2, "unexpected": true}')
    warnings = Warnings()
    state, _ = load_latest(s, on_warning=warnings)
    assert state.step == 1
    assert "missing" in warnings[0] and "invalid manifest" in warnings[1]


def test_partial_newer_checkpoint_is_never_loaded() -> None:
    s = MemoryStore()
    save_checkpoint(s, tiny_state(1))
    # a save of step 2 died before its manifest: files only
    s.put_bytes(file_key(2, "model.pt"), s.get_bytes(file_key(1, "model.pt")))
    state, _ = load_latest(s)
    assert state.step == 1
    # even when LATEST is gone and the directory is scanned
    s.delete(LATEST)
    warnings = Warnings()
    state, _ = load_latest(s, on_warning=warnings)
    assert state.step == 1
    assert "no usable LATEST" in warnings[0] and "step 2" in warnings[1]


def test_corrupt_latest_object_triggers_scan_for_newest_valid() -> None:
    s = MemoryStore()
    for step in (4, 9):
        save_checkpoint(s, tiny_state(step))
    s.put_bytes(LATEST, b"\x00garbage")
    warnings = Warnings()
    state, _ = load_latest(s, on_warning=warnings)
    assert state.step == 9
    assert "LATEST is corrupt" in warnings[0]


def test_unpublished_newer_checkpoint_is_ignored_while_latest_is_valid() -> None:
    s = MemoryStore()
    save_checkpoint(s, tiny_state(1))
    save_checkpoint(s, tiny_state(2))
    s.put_bytes(LATEST, json.dumps({"step": 1, "checkpoint": "step-000000001"}).encode())
    assert load_latest(s)[0].step == 1


def test_no_checkpoint_raises_with_reasons() -> None:
    s = MemoryStore()
    with pytest.raises(NoCheckpoint, match="no checkpoints"):
        load_latest(s)
    save_checkpoint(s, tiny_state(1))
    s.put_bytes(file_key(1, "model.pt"), b"x")
    with pytest.raises(NoCheckpoint, match="size 1 bytes"):
        load_latest(s)


def test_latest_never_moves_backwards() -> None:
    s = MemoryStore()
    save_checkpoint(s, tiny_state(5))
    with pytest.raises(LatestRegression, match="step 5"):
        save_checkpoint(s, tiny_state(3))
    assert read_latest_step(s) == 5
    assert list_checkpoint_steps(s) == [5]  # refused before writing anything
    assert load_latest(s)[0].step == 5
    save_checkpoint(s, tiny_state(5))  # same step: allowed (idempotent re-save)
    assert read_latest_step(s) == 5


def test_unloadable_state_is_refused_before_writing() -> None:
    s = MemoryStore()

    class Custom:
        pass

    bad = tiny_state(1)
    bad.optimizer = {"state": {"x": Custom()}}
    with pytest.raises(ValueError, match="weights_only"):
        save_checkpoint(s, bad)
    for cursor in ({"when": datetime.now()}, float("nan")):
        with pytest.raises(ValueError, match="JSON"):
            save_checkpoint(s, tiny_state(1, cursor=cursor))
    negative = tiny_state(1)
    negative.epoch = -1
    with pytest.raises(ValueError, match="epoch"):
        save_checkpoint(s, negative)
    assert s.list() == []


def test_cursor_is_stored_as_json() -> None:
    s = MemoryStore()
    save_checkpoint(s, tiny_state(1, cursor={"ranges": (1, 2), 3: "x"}))
    assert load_latest(s)[0].data_cursor == {"ranges": [1, 2], "3": "x"}


def test_manifest_for_another_step_is_rejected(tmp_path: Path) -> None:
    s = MemoryStore()
    save_checkpoint(s, tiny_state(1))
    save_checkpoint(s, tiny_state(2))
    s.put_bytes(manifest_key(2), s.get_bytes(manifest_key(1)))
    with pytest.raises(CheckpointCorrupt, match="manifest says step 1"):
        load_checkpoint(s, 2)


def test_list_checkpoint_steps_includes_partials() -> None:
    s = MemoryStore()
    save_checkpoint(s, tiny_state(3))
    s.put_bytes(file_key(10, "model.pt"), b"partial")
    s.put_bytes("unrelated/file", b"x")
    assert list_checkpoint_steps(s) == [3, 10]


def test_failed_state_file_write_publishes_nothing() -> None:
    from shoal.storage.errors import StorageError

    inner = MemoryStore()
    save_checkpoint(inner, tiny_state(1))

    def fail_optimizer(key: str) -> None:
        if key.endswith("optimizer.pt"):
            raise StorageError(f"injected failure writing {key}")

    with pytest.raises(StorageError, match="injected"):
        save_checkpoint(HookedStore(inner, before_write=fail_optimizer), tiny_state(2))
    assert not inner.exists(manifest_key(2))
    assert read_latest_step(inner) == 1
    assert load_latest(inner)[0].step == 1
