"""Sharded checkpoints in one process (storage/sharded.py): two members' parts written by two
threads, the manifest only once both are there, the load reassembling whole tensors; a
damaged or missing part is refused, a member that never writes fails member 0's save."""

from __future__ import annotations

import threading

import pytest
import torch

from shoal.storage.checkpoint import load_checkpoint, load_latest, save_sharded_checkpoint
from shoal.storage.errors import CheckpointCorrupt, UnsafeCheckpoint
from shoal.storage.latest_object import read_latest_step
from shoal.storage.layout import file_key
from shoal.storage.local import LocalStore
from shoal.storage.manifest import Manifest
from shoal.storage.sharded import Chunk, ShardedTrainState, WholeTensorReader, load_into
from shoal.storage.verify import read_manifest

W = torch.arange(30, dtype=torch.float64).reshape(6, 5)
B = torch.arange(3, dtype=torch.bfloat16)
STEP = torch.tensor(7.0)


def _part(shard: int, step: int = 4) -> ShardedTrainState:
    """Member ``shard`` of 2: rows 0-2 / 3-5 of W, B's first 2 / last 1; member 0 also STEP."""
    rows = slice(0, 3) if shard == 0 else slice(3, 6)
    cols = slice(0, 2) if shard == 0 else slice(2, 3)
    chunks = [Chunk("model/w", W[rows], (rows.start, 0), (6, 5)), Chunk("model/b", B[cols], (cols.start,), (3,))]
    if shard == 0:
        chunks.append(Chunk("optim/state.w.step", STEP, (), ()))
    return ShardedTrainState(step=step, shard=shard, shard_size=2, chunks=chunks,
                             optimizer_groups={"optim/param_groups.w.lr": 0.1, "optim/param_groups.w.betas": (0.9, 0.99)}
                             if shard == 0 else None, data_cursor=96, world_size=4)


def _save_both(store, step: int = 4, key=None) -> Manifest:
    other = threading.Thread(target=save_sharded_checkpoint, args=(store, _part(1, step).snapshot()),
                             kwargs={"hmac_key": key})
    other.start()
    manifest = save_sharded_checkpoint(store, _part(0, step).snapshot(), hmac_key=key, parts_timeout_s=30)
    other.join()
    return manifest


def _targets() -> dict[str, torch.Tensor]:
    return {"model/w": torch.zeros(6, 5, dtype=torch.float64), "model/b": torch.zeros(3, dtype=torch.bfloat16),
            "optim/state.w.step": torch.tensor(0.0)}


def test_two_members_parts_make_one_checkpoint_that_loads_whole(tmp_path) -> None:
    store = LocalStore(tmp_path)
    manifest = _save_both(store)
    assert manifest.shards == 2 and read_latest_step(store) == 4
    assert sorted(manifest.files) == ["optimizer-groups.pt", "shard-0-of-2.bin", "shard-0-of-2.json",
                                      "shard-1-of-2.bin", "shard-1-of-2.json"]
    ckpt, again = load_latest(store, hmac_key=None)
    assert again == manifest and ckpt.data_cursor == 96 and ckpt.world_size == 4
    assert ckpt.optimizer_groups == {"optim/param_groups.w.lr": 0.1, "optim/param_groups.w.betas": (0.9, 0.99)}
    targets = _targets()
    load_into(targets, ckpt.reader)
    assert torch.equal(targets["model/w"], W) and torch.equal(targets["model/b"], B)
    assert targets["optim/state.w.step"].item() == 7.0


def test_a_model_with_another_tensor_is_refused_by_name(tmp_path) -> None:
    store = LocalStore(tmp_path)
    _save_both(store)
    ckpt, _ = load_latest(store, hmac_key=None)
    with pytest.raises(CheckpointCorrupt, match="has no model/extra"):
        load_into({**_targets(), "model/extra": torch.zeros(2)}, ckpt.reader)
    with pytest.raises(CheckpointCorrupt, match=r"model/w: the checkpoint holds \(6, 5\), the model \(5, 6\)"):
        load_into({**_targets(), "model/w": torch.zeros(5, 6, dtype=torch.float64)}, ckpt.reader)


def test_a_damaged_shard_is_refused_when_read_and_a_damaged_index_when_opened(tmp_path) -> None:
    store = LocalStore(tmp_path)
    _save_both(store)
    key = file_key(4, "shard-1-of-2.bin")
    data = bytearray(store.get_bytes(key))
    data[3] ^= 0xFF
    store.put_bytes(key, bytes(data))
    ckpt, _ = load_latest(store, hmac_key=None)
    with pytest.raises(CheckpointCorrupt, match="shard-1-of-2.bin: sha256"):
        load_into(_targets(), ckpt.reader)
    store.put_bytes(file_key(4, "shard-0-of-2.json"), b'{"format": 1}')
    with pytest.raises(CheckpointCorrupt, match="shard-0-of-2.json: size 13 bytes"):
        load_checkpoint(store, 4, hmac_key=None)


def test_a_member_that_never_writes_its_part_fails_the_save_and_latest_stays(tmp_path) -> None:
    store = LocalStore(tmp_path)
    _save_both(store, step=2)
    with pytest.raises(CheckpointCorrupt, match="shard-1-of-2.json not written within"):
        save_sharded_checkpoint(store, _part(0, 4).snapshot(), parts_timeout_s=0.3)
    assert read_latest_step(store) == 2
    with pytest.raises(CheckpointCorrupt, match="missing"):
        read_manifest(store, 4)


def test_a_signed_sharded_manifest_pins_every_part_and_a_full_manifests_bytes_are_unchanged(tmp_path) -> None:
    store = LocalStore(tmp_path)
    manifest = _save_both(store, key=b"k" * 16)
    assert manifest.hmac is not None
    with pytest.raises(UnsafeCheckpoint):
        read_manifest(store, 4, hmac_key=b"x" * 16)
    full = Manifest.create(step=1, epoch=0, data_cursor=0, generation=1, world_size=1,
                           files={"model.pt": {"size": 1, "sha256": "0" * 64}})
    assert b"shards" not in full.canonical_bytes() and b"shards" not in full.to_json()


def test_whole_tensors_load_through_the_same_reader(tmp_path) -> None:
    targets = _targets()
    load_into(targets, WholeTensorReader({"model/w": W, "model/b": B, "optim/state.w.step": STEP}))
    assert torch.equal(targets["model/w"], W) and torch.equal(targets["model/b"], B)
