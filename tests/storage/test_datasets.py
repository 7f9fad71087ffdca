"""Dataset shards: fetched on demand, sha256-verified against the index, cached locally."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tests.storage.support import HookedStore

from shoal.storage.backend import ObjectStore
from shoal.storage.datasets import ShardReader, build_index
from shoal.storage.errors import ObjectNotFound, ShardCorrupt


SHARDS = {f"train-{i:05d}.bin": os.urandom(1000 + i) for i in range(3)}


def _publish(s: ObjectStore, prefix: str = "data/") -> None:
    for name, data in SHARDS.items():
        s.put_bytes(prefix + name, data)
    build_index(s, list(SHARDS), index_key=prefix + "index.json")


def test_reads_verified_shards(object_store: ObjectStore, tmp_path: Path) -> None:
    _publish(object_store)
    reader = ShardReader(object_store, tmp_path / "cache", index_key="data/index.json")
    assert reader.names == list(SHARDS)
    for name, data in SHARDS.items():
        assert reader.read(name) == data
        assert reader.path(name).read_bytes() == data


def test_remote_shards_download_once_then_hit_cache(tmp_path: Path) -> None:
    from tests.storage.support import make_s3_store

    hooked = HookedStore(make_s3_store("datasets/x"))
    _publish(hooked)
    hooked.ops.clear()
    reader = ShardReader(hooked, tmp_path / "cache", index_key="data/index.json")
    name = "train-00001.bin"
    first = reader.path(name)
    assert first.parent == tmp_path / "cache" and first.read_bytes() == SHARDS[name]
    # A second reader (e.g. after a restart) finds it in the cache without fetching.
    again = ShardReader(hooked, tmp_path / "cache", index_key="data/index.json")
    assert again.path(name) == first
    fetched = [k for op, k in hooked.ops if op == "get" and k.endswith(".bin")]
    assert fetched == ["data/train-00001.bin"]


def test_local_store_is_read_in_place(tmp_path: Path) -> None:
    from shoal.storage.local import LocalStore

    s = LocalStore(tmp_path / "ds")
    _publish(s)
    reader = ShardReader(s, tmp_path / "cache", index_key="data/index.json")
    assert reader.path("train-00000.bin") == tmp_path / "ds" / "data" / "train-00000.bin"
    assert not any((tmp_path / "cache").iterdir())


def test_corrupt_shard_is_refused_and_not_cached(object_store: ObjectStore, tmp_path: Path) -> None:
    _publish(object_store)
    name = "train-00002.bin"
    bad = bytearray(SHARDS[name])
    bad[10] ^= 0xFF
    object_store.put_bytes(f"data/{name}", bytes(bad))
    reader = ShardReader(object_store, tmp_path / "cache", index_key="data/index.json")
    with pytest.raises(ShardCorrupt, match="sha256"):
        reader.path(name)
    object_store.put_bytes(f"data/{name}", SHARDS[name][:-1])
    with pytest.raises(ShardCorrupt, match="size"):
        ShardReader(object_store, tmp_path / "cache", index_key="data/index.json").path(name)
    cached = list((tmp_path / "cache").iterdir()) if (tmp_path / "cache").exists() else []
    assert cached == []
    assert reader.read("train-00000.bin") == SHARDS["train-00000.bin"]


def test_bad_index_and_unknown_shards(tmp_path: Path) -> None:
    from shoal.storage.memory import MemoryStore

    s = MemoryStore()
    with pytest.raises(ObjectNotFound):
        ShardReader(s, tmp_path / "c")
    escaping = {"format": 1, "shards": [{"name": "../x", "size": 1, "sha256": "0" * 64}]}
    s.put_bytes("index.json", json.dumps(escaping).encode())
    with pytest.raises(ShardCorrupt, match="invalid dataset index"):
        ShardReader(s, tmp_path / "c")
    s.put_bytes("a.bin", b"abc")
    build_index(s, ["a.bin"])
    reader = ShardReader(s, tmp_path / "c")
    with pytest.raises(KeyError):
        reader.path("b.bin")
    with pytest.raises(ObjectNotFound):
        build_index(s, ["missing.bin"])
