"""Errors of the storage package, and the one place outside errors are translated.

Every error this package raises on purpose derives from :class:`StorageError` (itself a
:class:`~shoal.core.errors.ShoalError`). Errors from the filesystem (``OSError``), from the S3
client (``minio`` ``S3Error``/``ServerError``/``InvalidResponseError``), from its HTTP layer
(``urllib3`` errors) and from Redis are turned into these classes by :func:`translated`,
always with ``raise ... from`` so the original cause stays in the traceback.

No message built here contains a credential: S3 errors only carry the error code, bucket
and object name; URLs are the endpoint without user info.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from shoal.core.errors import ConfigError, ConnectionFailed, ShoalError


class StorageError(ShoalError):
    """Base class: a storage operation failed. The message names the operation and object."""


class ObjectNotFound(StorageError):
    """The object (file, S3 key) does not exist. Nothing was changed."""


class StorageUnavailable(StorageError, ConnectionFailed):
    """The backend could not be reached (S3 endpoint down, timeouts, Redis gone)."""

    exit_code = ConnectionFailed.exit_code


class StorageAccessDenied(StorageError):
    """The backend refused the credentials or the permission for this object."""


class StorageConfigError(StorageError, ConfigError):
    """Bad storage URI, missing credentials or a missing bucket. Nothing was changed."""

    exit_code = ConfigError.exit_code


class ForeignCheckpoint(StorageConfigError):
    """The checkpoint store a job would resume from holds another job's checkpoints
    (:mod:`shoal.storage.ownership`). Nothing was loaded."""


class CheckpointError(StorageError):
    """Base class of checkpoint-level failures."""


class NoCheckpoint(CheckpointError):
    """No complete, verifying checkpoint exists in the store. The message lists what was
    rejected and why."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint is incomplete or damaged: missing/unparsable manifest, a file missing,
    truncated, or with a sha256 different from the manifest's. Loaders skip it."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint failed a security check: a state file needs unpickling of something other
    than tensors and plain containers, or the manifest HMAC is missing or wrong while a key is
    configured. Loaders stop on it instead of falling back: the store itself is suspect."""


class LatestRegression(StorageError):
    """Refused to move a LATEST pointer to a lower step than the one it names now."""


class PointerCorrupt(StorageError):
    """A LATEST pointer (Redis) holds something that is not valid pointer JSON."""


class ShardCorrupt(StorageError):
    """A dataset shard's size or sha256 differs from the dataset index; it was not cached."""


_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchObject", "NotFound", "NoSuchVersion"})
_DENIED_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
)
_CONFIG_CODES = frozenset({"NoSuchBucket", "InvalidBucketName", "AuthorizationHeaderMalformed"})


@contextmanager
def translated(what: str) -> Iterator[None]:
    """Run a block; re-raise outside errors as the matching :class:`StorageError`.

    ``what`` names the operation and object (e.g. ``"get s3://b/k"``) and prefixes the message.
    StorageErrors pass through untouched; anything not listed in :func:`_storage_error_for`
    (a bug) is not caught.
    """
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        mapped = _storage_error_for(what, exc)
        if mapped is None:
            raise
        raise mapped from exc


def _storage_error_for(what: str, exc: Exception) -> StorageError | None:
    """The StorageError for an outside error, None if it is not one we translate. Client
    libraries are imported only when one of their errors is seen, so that processes using
    only the local backend never load the S3 client."""
    module = type(exc).__module__ or ""
    if module.startswith("minio"):
        return _s3_error_for(what, exc)
    if module.startswith("urllib3"):
        import urllib3.exceptions

        if isinstance(exc, urllib3.exceptions.HTTPError):
            return StorageUnavailable(f"{what}: S3 endpoint unreachable: {type(exc).__name__}")
    redis = sys.modules.get("redis")  # loaded by whoever raised one (shoal's NotReplicated is one too)
    if redis is not None and isinstance(exc, redis.RedisError):
        return StorageUnavailable(f"{what}: Redis error: {exc}")
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFound(f"{what}: no such file")
    if isinstance(exc, PermissionError):
        return StorageAccessDenied(f"{what}: permission denied")
    if isinstance(exc, OSError):
        name = errno.errorcode.get(exc.errno or 0, "OSError")
        return StorageError(f"{what}: {name}: {exc.strerror or exc}")
    return None


def _s3_error_for(what: str, exc: Exception) -> StorageError | None:
    from minio.error import InvalidResponseError, S3Error, ServerError

    if isinstance(exc, S3Error):
        detail = f"{what}: S3 error {exc.code}"
        if exc.code in _NOT_FOUND_CODES:
            return ObjectNotFound(f"{what}: no such object")
        if exc.code in _DENIED_CODES:
            return StorageAccessDenied(f"{detail} (check S3_ACCESS_KEY/S3_SECRET_KEY)")
        if exc.code in _CONFIG_CODES:
            return StorageConfigError(f"{detail} (bucket {exc.bucket_name!r})")
        return StorageError(f"{detail}: {exc.message}")
    if isinstance(exc, ServerError):
        return StorageUnavailable(f"{what}: S3 server error (HTTP {exc.status_code})")
    if isinstance(exc, InvalidResponseError):
        return StorageUnavailable(f"{what}: invalid response from the S3 endpoint")
    return None
