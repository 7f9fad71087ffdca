"""Whole shards of a streaming dataset made local and verified, and the retry policy.

:func:`fetch_to_cache` gives a verified copy of a remote shard in the shard cache: one
download per shard at a time (the cache's per-shard lock), streamed into a reservation made
under the cache limit, hashed as it comes and never written past the index's size, renamed
into place only when size and sha256 match the index (:func:`check`). :func:`verify_in_place`
hashes a shard of a local dataset once per cache directory. :func:`retry` runs a store call
again on transient errors (endpoint unreachable, 5xx, a body cut mid-way) with exponential
backoff; a missing, refused or corrupt shard is never retried. Every message names the shard.
:class:`ShardFetcher` is one process's use of them for one dataset: its store connection and
whole verified shard files.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TypeVar

from shoal.storage.backend import ObjectStore
from shoal.storage.datasets import ShardEntry, file_digest
from shoal.storage.errors import (
    ObjectNotFound,
    ShardCorrupt,
    StorageAccessDenied,
    StorageConfigError,
    StorageError,
    translated,
)
from shoal.storage.streaming_cache import Counters, ShardCache, file_lock
from shoal.storage.streaming_index import ShardIndex

T = TypeVar("T")
_CHUNK = 8 * 1024 * 1024
_NOT_TRANSIENT = (ObjectNotFound, StorageAccessDenied, StorageConfigError, ShardCorrupt)
FIRST_DELAY_S = 0.1
MAX_DELAY_S = 5.0


def retry(what: str, fn: Callable[[], T], timeout_s: float, counters: Counters) -> T:
    """``fn()``, called again after transient StorageErrors (0.1 s doubling, at most 5 s
    apart) until ``timeout_s`` would pass; then StorageError ``<what>: gave up after ...``."""
    delay, deadline = FIRST_DELAY_S, time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except _NOT_TRANSIENT:
            raise
        except StorageError as exc:
            if time.monotonic() + delay > deadline:
                raise StorageError(f"{what}: gave up after {timeout_s:g} s of retries: {exc}") from exc
            counters.add("retries")
            time.sleep(delay)
            delay = min(delay * 2, MAX_DELAY_S)


def check(entry: ShardEntry, size: int, digest: str, label: str) -> None:
    """ShardCorrupt naming ``label`` unless ``size`` and ``digest`` are the index's."""
    if size != entry.size:
        raise ShardCorrupt(f"dataset shard {label}: size {size} bytes, index says {entry.size}")
    if digest != entry.sha256:
        raise ShardCorrupt(
            f"dataset shard {label}: sha256 {digest[:12]}... does not match the index ({entry.sha256[:12]}...)"
        )


def suffix(entry: ShardEntry) -> str:
    """The cache file suffix of a shard (its name's)."""
    return PurePosixPath(entry.name).suffix


def fetch_to_cache(cache: ShardCache, store: Callable[[], ObjectStore], key: str, entry: ShardEntry, label: str, *,
                   demand: bool, counters: Counters, retry_timeout_s: float) -> tuple[Path, bool] | None:
    """(the cached copy, whether it was cached already). None only for a prefetch
    (``demand`` false) that would have to evict a shard needed sooner. ``store()`` gives
    this process's store connection."""
    sfx = suffix(entry)
    found = cache.lookup(entry.sha256, sfx, entry.size)
    if found is not None:
        return found, True
    with cache.downloading(entry.sha256):
        found = cache.lookup(entry.sha256, sfx, entry.size)
        if found is not None:
            return found, not demand  # a sibling downloaded it while we waited: a miss for a read
        part = cache.reserve(entry.sha256, entry.size, demand=demand, counters=counters, label=label)
        if part is None:
            return None
        try:
            size = retry(f"download {label}", lambda: _download(store(), key, entry, label, part), retry_timeout_s,
                         counters)
            final = cache.commit(part, entry.sha256, sfx)
        except BaseException:
            cache.abort(part)
            raise
    counters.add("bytes_downloaded", size)
    counters.add("downloads")
    if not demand:
        counters.add("prefetched")
    return final, False


def _download(store: ObjectStore, key: str, entry: ShardEntry, label: str, part: Path) -> int:
    """Stream the shard into its reservation ``part``, hashing as it comes; never writes
    more than the index's size (the reservation). Returns the bytes written."""
    sha = hashlib.sha256()
    size = 0
    with translated(f"download {label}"), store.open_read(key) as src, open(part, "r+b") as dst:
        while chunk := src.read(_CHUNK):
            size += len(chunk)
            if size > entry.size:
                raise ShardCorrupt(f"dataset shard {label}: larger than the {entry.size} bytes the index says")
            sha.update(chunk)
            dst.write(chunk)
    check(entry, size, sha.hexdigest(), label)
    return size


def verify_in_place(cache: ShardCache, path: Path, entry: ShardEntry, label: str) -> None:
    """Hash a local dataset's shard file unless a marker in the cache directory says this very
    file (inode, size, mtime) was hashed already. ShardCorrupt / ObjectNotFound name it."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ObjectNotFound(f"dataset shard {label}: no such file") from None
    marker = cache.root / f".ok-{entry.sha256}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"
    if marker.exists():
        return
    with file_lock(cache.root / f".dl-{entry.sha256}", cache.wait_s, f"hashing {path}"):
        if marker.exists():
            return
        size, digest = file_digest(path)
        check(entry, size, digest, label)
        marker.touch()




class ShardFetcher:
    """One process's access to the shards of the dataset at ``uri``: its store connection
    (``store``: the one the dataset opened, or one opened on first use), store calls retried
    (:func:`retry`, counted in ``counters``) and whole verified shard files - a local
    dataset's own files (``in_place``: hashed once, :func:`verify_in_place`), else copies in
    ``cache`` (:func:`fetch_to_cache`).

    Made per process by the dataset (a forked or unpickled copy makes its own); the readers and
    the prefetch thread of that process share it, so every method is thread-safe (two threads
    opening the connection at once may open one each: one is kept). Errors are
    the functions': a missing or corrupt shard raises naming it, a store that stays
    unreachable raises after ``retry_timeout_s``. Needs ``index`` loaded before any method but
    :meth:`store` and :meth:`retry`."""

    def __init__(self, uri: str, index: ShardIndex, cache: ShardCache, counters: Counters, retry_timeout_s: float, *,
                 in_place: bool, store: ObjectStore | None = None) -> None:
        self._uri = uri
        self._index = index
        self._cache = cache
        self._counters = counters
        self._retry_timeout_s = retry_timeout_s
        self._in_place = in_place
        self._store = store
        self._lock = threading.Lock()
        self._verified: set[int] = set()  # local shards hashed by this process

    def store(self) -> ObjectStore:
        if self._store is None:
            from shoal.storage.uri import open_store

            self._store = open_store(self._uri)
        return self._store

    def retry(self, what: str, fn: Callable[[], T]) -> T:
        return retry(what, fn, self._retry_timeout_s, self._counters)

    def file(self, shard: int, *, demand: bool) -> tuple[Path, bool]:
        """(local verified file of the shard, whether it was there already)."""
        entry = self._index.shards[shard]
        store = self.store()
        key = self._index.key(shard)
        if self._in_place:
            local = store.local_path(key)
            assert local is not None
            self._verify_in_place(shard, local, entry)
            return local, True
        got = self.ensure_cached(shard, demand=demand)
        assert got is not None
        return got

    def ensure_cached(self, shard: int, *, demand: bool) -> tuple[Path, bool] | None:
        """:func:`fetch_to_cache` of the shard (None: a prefetch that found no room)."""
        return fetch_to_cache(self._cache, self.store, self._index.key(shard), self._index.shards[shard],
                              self._index.label(shard), demand=demand, counters=self._counters,
                              retry_timeout_s=self._retry_timeout_s)

    def cached_path(self, shard: int) -> Path | None:
        """The shard's copy in the cache, if there (marked as used)."""
        entry = self._index.shards[shard]
        return self._cache.lookup(entry.sha256, suffix(entry), entry.size)

    def _verify_in_place(self, shard: int, path: Path, entry: ShardEntry) -> None:
        if shard in self._verified:
            return
        verify_in_place(self._cache, path, entry, self._index.label(shard))
        with self._lock:
            self._verified.add(shard)
