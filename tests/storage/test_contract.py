"""The ObjectStore contract, run identically on every backend.

``memory`` is the in-process fake, ``local`` real files in a temp dir, ``s3`` a real
S3-compatible HTTP server (moto) on loopback reached through the real minio client.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shoal.storage.backend import ObjectStore
from shoal.storage.errors import ObjectNotFound, StorageError


def test_put_get_roundtrip_binary_and_empty(object_store: ObjectStore) -> None:
    payload = bytes(range(256)) * 3
    object_store.put_bytes("a/b/c.bin", payload)
    object_store.put_bytes("empty", b"")
    assert object_store.get_bytes("a/b/c.bin") == payload
    assert object_store.get_bytes("empty") == b""
    assert object_store.size("a/b/c.bin") == len(payload)
    assert object_store.size("empty") == 0
    assert object_store.exists("a/b/c.bin") and object_store.exists("empty")


def test_put_replaces_existing_object(object_store: ObjectStore) -> None:
    object_store.put_bytes("k", b"old content that is longer")
    object_store.put_bytes("k", b"new")
    assert object_store.get_bytes("k") == b"new"
    assert object_store.size("k") == 3


def test_open_write_publishes_only_on_clean_exit(object_store: ObjectStore) -> None:
    object_store.put_bytes("obj", b"v1")
    with object_store.open_write("obj") as f:
        f.write(b"v2-")
        f.write(b"part2")
        # not visible while the block runs
        assert object_store.get_bytes("obj") == b"v1"
        assert not object_store.exists("fresh")
    assert object_store.get_bytes("obj") == b"v2-part2"

    with pytest.raises(RuntimeError, match="boom"), object_store.open_write("obj") as f:
        f.write(b"half written")
        raise RuntimeError("boom")
    assert object_store.get_bytes("obj") == b"v2-part2"

    with pytest.raises(RuntimeError), object_store.open_write("fresh") as f:
        f.write(b"x")
        raise RuntimeError("boom")
    assert not object_store.exists("fresh")
    assert object_store.list() == ["obj"]


def test_missing_objects(object_store: ObjectStore) -> None:
    assert object_store.exists("nope") is False
    with pytest.raises(ObjectNotFound):
        object_store.get_bytes("nope")
    with pytest.raises(ObjectNotFound):
        object_store.size("dir/nope")
    object_store.delete("nope")  # no-op, no error
    assert issubclass(ObjectNotFound, StorageError)


def test_list_is_recursive_sorted_and_prefix_filtered(object_store: ObjectStore) -> None:
    for key in ["b/2", "a/1", "a/sub/3", "ab", "a/0"]:
        object_store.put_bytes(key, key.encode())
    assert object_store.list() == ["a/0", "a/1", "a/sub/3", "ab", "b/2"]
    assert object_store.list("a/") == ["a/0", "a/1", "a/sub/3"]
    assert object_store.list("a") == ["a/0", "a/1", "a/sub/3", "ab"]
    assert object_store.list("a/s") == ["a/sub/3"]
    assert object_store.list("zzz/") == []


def test_delete_removes_only_that_key(object_store: ObjectStore) -> None:
    object_store.put_bytes("d/x", b"1")
    object_store.put_bytes("d/y", b"2")
    object_store.delete("d/x")
    assert not object_store.exists("d/x")
    assert object_store.list("d/") == ["d/y"]
    assert object_store.get_bytes("d/y") == b"2"


def test_put_file_large_object(object_store: ObjectStore, tmp_path: Path) -> None:
    # 6 MiB crosses the S3 multipart threshold (5 MiB), so the multipart path is exercised.
    src = tmp_path / "src.bin"
    data = os.urandom(6 * 1024 * 1024 + 17)
    src.write_bytes(data)
    object_store.put_file("big/blob", src)
    assert object_store.size("big/blob") == len(data)
    assert object_store.get_bytes("big/blob") == data


def test_put_file_missing_source_leaves_key_untouched(object_store: ObjectStore, tmp_path: Path) -> None:
    object_store.put_bytes("k", b"keep")
    with pytest.raises(StorageError):
        object_store.put_file("k", tmp_path / "does-not-exist")
    assert object_store.get_bytes("k") == b"keep"


@pytest.mark.parametrize("bad", ["", "/abs", "a/../b", "a//b", "./a", "a/", "a\\b", "a\x00b"])
def test_invalid_keys_rejected_before_io(object_store: ObjectStore, bad: str) -> None:
    with pytest.raises(ValueError):
        object_store.put_bytes(bad, b"x")
    with pytest.raises(ValueError):
        object_store.get_bytes(bad)
    assert object_store.list() == []


def test_uri_and_repr_name_the_location(object_store: ObjectStore) -> None:
    assert object_store.uri.split("://")[0] in ("memory", "file", "s3")
    assert object_store.uri in repr(object_store)
