"""Filesystem backend: one file per object under a root directory.

Atomic, durable writes: the data goes to a temporary file ``.tmp-<name>.<random>`` in the
destination directory, which is flushed and fsync'd (large files are flushed in the
background while being written, see :mod:`shoal.storage.durable_file`), then ``os.replace``'d
over the final name (atomic on POSIX within one filesystem), then the directory is fsync'd so the rename
itself survives a power loss. Directories created on the way are fsync'd into their
parents too. A crash at any point leaves either the old object or the new one, plus at
worst a temporary that :meth:`LocalStore.sweep_temporaries` removes; temporaries are never
listed.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from shoal.storage.backend import ObjectStore, check_key, check_prefix
from shoal.storage.durable_file import DurableFile
from shoal.storage.errors import ObjectNotFound, StorageConfigError, translated

TEMP_PREFIX = ".tmp-"


def fsync_dir(path: Path) -> None:
    """fsync a directory so that entries created/renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs_durable(path: Path) -> None:
    """``mkdir -p path``, fsync'ing the parent of every directory that had to be created."""
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)  # a concurrent writer may have made it: fsync anyway
        fsync_dir(d.parent)


class LocalStore(ObjectStore):
    """Objects as files under ``root`` (created if missing)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()
        self.uri = self.root.as_uri()
        with translated(f"create {self.root}"):
            if self.root.exists() and not self.root.is_dir():
                raise StorageConfigError(f"{self.root} exists and is not a directory")
            make_dirs_durable(self.root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    @contextmanager
    def open_write(self, key: str) -> Iterator[BinaryIO]:
        dest = self._path(key)
        with translated(f"write {dest}"):
            if dest.name.startswith(TEMP_PREFIX):
                raise ValueError(f"object names may not start with {TEMP_PREFIX!r}: {key!r}")
            make_dirs_durable(dest.parent)
            fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{dest.name}.", dir=dest.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    durable = DurableFile(f)
                    try:
                        yield durable  # type: ignore[misc]
                    except BaseException:
                        durable.abort()
                        raise
                    durable.finish()
                os.replace(tmp, dest)
            except BaseException:
                with translated(f"remove {tmp}"):
                    Path(tmp).unlink(missing_ok=True)
                raise
            fsync_dir(dest.parent)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        with translated(f"read {path}"):
            return path.read_bytes()

    @contextmanager
    def open_read(self, key: str) -> Iterator[BinaryIO]:
        path = self._path(key)
        with translated(f"read {path}"):
            f = open(path, "rb")
        with f:
            yield f

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise ValueError(f"invalid byte range start={start} length={length}")
        path = self._path(key)
        with translated(f"read {path} [{start}:{start + length}]"), open(path, "rb") as f:
            return os.pread(f.fileno(), length, start)

    def exists(self, key: str) -> bool:
        path = self._path(key)
        with translated(f"stat {path}"):
            return path.is_file()

    def size(self, key: str) -> int:
        path = self._path(key)
        with translated(f"stat {path}"):
            if not path.is_file():
                raise ObjectNotFound(f"stat {path}: no such file")
            return path.stat().st_size

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        # Walk only the deepest directory the prefix pins down.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / base if base else self.root
        keys: list[str] = []
        with translated(f"list {start}"):
            if not start.is_dir():
                return []
            for dirpath, _dirs, files in os.walk(start):
                rel = os.path.relpath(dirpath, self.root)
                for name in files:
                    if name.startswith(TEMP_PREFIX):
                        continue
                    key = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
                    if key.startswith(prefix):
                        keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        """Unlink the file, then remove directories left empty up to (excluding) the root."""
        path = self._path(key)
        with translated(f"delete {path}"):
            path.unlink(missing_ok=True)
            parent = path.parent
            while parent != self.root and parent.is_dir():
                try:
                    parent.rmdir()
                except OSError:
                    break  # not empty (or raced with a writer): keep it
                parent = parent.parent

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def sweep_temporaries(self, older_than_s: float) -> int:
        cutoff = time.time() - older_than_s
        removed = 0
        with translated(f"sweep {self.root}"):
            for dirpath, _dirs, files in os.walk(self.root):
                for name in files:
                    if not name.startswith(TEMP_PREFIX):
                        continue
                    p = Path(dirpath) / name
                    try:
                        if p.stat().st_mtime < cutoff:
                            p.unlink()
                            removed += 1
                    except FileNotFoundError:
                        continue
        return removed
