"""Error translation (one place, ``raise ... from``) and URI parsing."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import redis
import urllib3
from minio.error import S3Error

from shoal.core.errors import ConfigError, ConnectionFailed, ShoalError
from shoal.storage.errors import (
    CheckpointCorrupt,
    ObjectNotFound,
    StorageAccessDenied,
    StorageConfigError,
    StorageError,
    StorageUnavailable,
    UnsafeCheckpoint,
    translated,
)
from shoal.storage.local import LocalStore
from shoal.storage.memory import MemoryStore
from shoal.storage.uri import open_store


def _s3_error(code: str) -> S3Error:
    return S3Error(None, code, "msg", "/b/k", "req", "host", bucket_name="b", object_name="k")


@pytest.mark.parametrize(
    "raised, expected",
    [
        (FileNotFoundError(errno.ENOENT, "nope"), ObjectNotFound),
        (PermissionError(errno.EACCES, "denied"), StorageAccessDenied),
        (OSError(errno.ENOSPC, "No space left on device"), StorageError),
        (_s3_error("NoSuchKey"), ObjectNotFound),
        (_s3_error("AccessDenied"), StorageAccessDenied),
        (_s3_error("SignatureDoesNotMatch"), StorageAccessDenied),
        (_s3_error("NoSuchBucket"), StorageConfigError),
        (_s3_error("InternalError"), StorageError),
        (urllib3.exceptions.MaxRetryError(None, "http://h/", "refused"), StorageUnavailable),
        (urllib3.exceptions.ProtocolError("connection broken"), StorageUnavailable),
        (redis.ConnectionError("down"), StorageUnavailable),
    ],
)
def test_outside_errors_translated_with_cause(raised: BaseException, expected: type) -> None:
    with pytest.raises(expected) as info, translated("op obj"):
        raise raised
    assert type(info.value) is expected
    assert info.value.__cause__ is raised
    assert str(info.value).startswith("op obj:")


def test_bugs_and_storage_errors_pass_through() -> None:
    with pytest.raises(KeyError), translated("op"):
        {}["missing"]  # noqa: B018  (a bug, not an outside error: must pass through)
    original = CheckpointCorrupt("x")
    with pytest.raises(CheckpointCorrupt) as info, translated("op"):
        raise original
    assert info.value is original


def test_hierarchy_and_exit_codes() -> None:
    for cls in (StorageError, ObjectNotFound, CheckpointCorrupt, UnsafeCheckpoint):
        assert issubclass(cls, ShoalError)
    assert issubclass(StorageUnavailable, ConnectionFailed) and StorageUnavailable.exit_code == 3
    assert issubclass(StorageConfigError, ConfigError) and StorageConfigError.exit_code == 2


def test_open_store_schemes(tmp_path: Path) -> None:
    local = open_store(f"file://{tmp_path}/a%20b")
    assert isinstance(local, LocalStore) and local.root == tmp_path / "a b"
    assert isinstance(open_store(str(tmp_path / "plain")), LocalStore)
    assert isinstance(open_store("memory://"), MemoryStore)
    for bad in ("ftp://x/y", "file://host/path", "file:relative", "s3://user:pw@bucket/x", "s3:///no-bucket",
                "file:///x?q=1", "gs://b/p"):
        with pytest.raises(StorageConfigError) as info:
            open_store(bad)
        assert "pw" not in str(info.value)
