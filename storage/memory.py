"""In-memory fake of :class:`~storage.backend.ObjectStore` for unit tests.

Honours the same contract as the real backends (atomic replace on successful block exit,
ObjectNotFound for missing keys, sorted listings); thread-safe. Contents live as long as the
instance.
"""

from __future__ import annotations

import io
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

from shoal.storage.backend import ObjectStore, check_key, check_prefix
from shoal.storage.errors import ObjectNotFound

_ids = itertools.count(1)


class _WriteOnly(io.RawIOBase):
    """Collects writes; refuses reads and seeks like the other backends' writers would."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        data = bytes(b)
        self.chunks.append(data)
        return len(data)


class MemoryStore(ObjectStore):
    """A dict of key -> bytes guarded by a lock."""

    def __init__(self, name: str | None = None) -> None:
        self.uri = f"memory://{name or next(_ids)}"
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @contextmanager
    def open_write(self, key: str) -> Iterator[BinaryIO]:
        check_key(key)
        buf = _WriteOnly()
        yield buf  # type: ignore[misc]
        data = b"".join(buf.chunks)
        with self._lock:
            self._objects[key] = data

    def get_bytes(self, key: str) -> bytes:
        check_key(key)
        with self._lock:
            try:
                return self._objects[key]
            except KeyError:
                raise ObjectNotFound(f"get {self.uri}/{key}: no such object") from None

    def exists(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return key in self._objects

    def size(self, key: str) -> int:
        return len(self.get_bytes(key))

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        with self._lock:
            return sorted(k for k in self._objects if k.startswith(prefix))

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._objects.pop(key, None)
