"""The object-store interface every backend implements (local files, S3, in-memory fake).

Keys are relative, ``/``-separated names (``run1/step-000000007/model.pt``). A key is
valid when it is non-empty, has no empty, ``.`` or ``..`` component, no leading ``/`` and
no backslash or NUL; anything else raises ``ValueError`` before the backend is touched.

Contract shared by all backends (``tests/test_storage_contract.py`` checks it):

* Writes are atomic per object: a reader sees the old content or the new, never a part. An
  object written through :meth:`ObjectStore.open_write` appears only when the block exits
  without an exception; on an exception nothing appears and an older object is untouched.
* A completed write is durable when the call returns (local: file and directory fsync'd;
  S3: the PUT was acknowledged).
* Missing objects raise :class:`~storage.errors.ObjectNotFound` from ``get_bytes``/``size``;
  ``delete`` of a missing object is a no-op; ``exists`` never raises for a missing object.
* Every other failure raises a :class:`~storage.errors.StorageError` subclass.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from pathlib import Path
from typing import BinaryIO

_COPY_CHUNK = 4 * 1024 * 1024


def check_key(key: str) -> str:
    """Return ``key`` unchanged if it is a valid object key, else raise ``ValueError``."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty string, got {key!r}")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"invalid object key {key!r}: no leading '/', backslash or NUL")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"invalid object key {key!r}: empty, '.' or '..' component")
    return key


def check_prefix(prefix: str) -> str:
    """Validate a listing prefix: ``""`` or a key prefix (may end in ``/``)."""
    if prefix:
        check_key(prefix.rstrip("/") or "x")
    return prefix


class ObjectStore(ABC):
    """A flat namespace of byte objects. Subclasses implement the six abstract methods."""

    #: Human-readable location without credentials (``file:///x``, ``s3://bucket/prefix``).
    uri: str = ""

    @abstractmethod
    def open_write(self, key: str) -> AbstractContextManager[BinaryIO]:
        """A context manager yielding a writable binary file; the object ``key`` is replaced
        atomically by what was written when the block exits normally, and not at all when it
        raises. The yielded file supports ``write`` and ``flush`` only (no seek/read)."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """The whole content of ``key``. Raises ObjectNotFound if it does not exist."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """True if ``key`` exists. Raises StorageError only when the backend fails."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """All keys starting with ``prefix`` (at any depth), sorted. In-flight temporaries of
        unfinished writes are never listed."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes of ``key``. Raises ObjectNotFound if it does not exist."""

    # --- conveniences built on the primitives (backends may override for speed) -----------
    def put_bytes(self, key: str, data: bytes) -> None:
        """Atomically replace ``key`` with ``data`` (see :meth:`open_write`)."""
        with self.open_write(key) as f:
            f.write(data)

    def put_file(self, key: str, path: str | Path) -> None:
        """Atomically replace ``key`` with the content of the local file ``path``.
        An unreadable ``path`` raises StorageError and leaves ``key`` untouched."""
        from shoal.storage.errors import translated

        with translated(f"read {path}"), open(path, "rb") as src, self.open_write(key) as dst:
            shutil.copyfileobj(src, dst, _COPY_CHUNK)

    def open_read(self, key: str) -> AbstractContextManager[BinaryIO]:
        """A context manager yielding the content of ``key`` as a file open for ``read(n)``
        (not seekable), for copying large objects without holding them in memory. Raises
        ObjectNotFound for a missing key when entered; errors while reading may be outside
        errors (an HTTP connection dropped mid-body): read inside ``errors.translated``."""
        import io
        from contextlib import nullcontext

        return nullcontext(io.BytesIO(self.get_bytes(key)))  # type: ignore[return-value]

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from byte ``start`` (fewer only at the object's end).
        Raises ObjectNotFound for a missing key, ``ValueError`` for a negative start or
        length. Backends override this with a real ranged read (S3: one ranged GET)."""
        if start < 0 or length < 0:
            raise ValueError(f"invalid byte range start={start} length={length}")
        return self.get_bytes(key)[start : start + length]

    def local_path(self, key: str) -> Path | None:
        """A local filesystem path holding ``key`` if the backend has one (local store), so
        callers can skip a copy; None for remote backends."""
        return None

    def sweep_temporaries(self, older_than_s: float) -> int:
        """Remove leftovers of writes interrupted by a crash, older than ``older_than_s``
        seconds. Returns how many were removed; backends without leftovers return 0."""
        return 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
