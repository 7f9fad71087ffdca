"""The local shard cache of a streaming dataset: bounded, shared by the processes of a worker.

One directory holds verified shard copies named ``<sha256><suffix>`` (content-addressed, so
a file that exists is a verified copy of exactly that shard) and a few bookkeeping files:

``.lock``          fcntl lock taken for every change of what the directory holds
``.dl-<sha256>``   per-shard lock: one process downloads a shard, the others wait for it
``.part-<sha256>-<pid>-<n>``  a download in progress; created at the shard's full size
                   *before* any byte is fetched (the reservation), renamed into place once
                   the sha256 verified, removed on any failure (and by the next reservation
                   when its process died)
``.needs``         JSON ``{sha256: [first need, last need]}`` written by ``plan`` (positions in
                   the worker's planned reads): eviction order
``.stats-<pid>``   this process's counters (int64 slots, see :data:`COUNTERS`), single
                   writer; :meth:`ShardCache.stats` sums every process's file

The limit: the sum of the sizes of the cached shards and the reservations never exceeds
``limit`` bytes, because space is reserved under ``.lock`` after evicting, a download only
writes into its reservation, and it is renamed into place under ``.lock`` too (so the
listing a reservation counts never misses a shard whose ``.part`` was renamed between its
listing and its stat). Eviction takes first the shards nobody needs (oldest use first),
then the ones needed last. A prefetch reservation never evicts a shard needed before its
own, and is refused for a shard the last plan no longer needs (a prefetch thread working
from an older plan); a demand reservation (a read that needs the shard now) may evict
anything cached; when reservations in flight fill the cache, it waits (up to ``wait_s``).

The plan is renewed from the worker's committed cursor, while its loaders read a few steps
ahead of it, so a plan ranks as "needed soon" shards a loader has already finished. Reads
follow the plan's order, so a demand for a shard first needed at position ``p`` means the
reader is at ``p`` or later: a shard whose last need is before ``p`` is finished and goes
with the unneeded ones (without that, a loader crossing a shuffle window's edge with the old
window's shards cached evicts the new window's shards it has just downloaded, one another in
turn, instead of the old ones: measured, 1.7x the downloads with a 50 MiB cache).

All processes of one worker (the training process and its forked loaders) may share one
directory; a directory must not be shared by different workers (their counters would mix).
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shoal.storage.errors import StorageConfigError, StorageError, translated
from shoal.core.procs import pid_runs

COUNTERS = (
    "bytes_downloaded",  # whole-shard downloads (verified)
    "downloads",  # shards downloaded
    "prefetched",  # ... of them by the background prefetch
    "remote_bytes",  # ranged reads (samples of shards not cached here)
    "remote_reads",  # samples read by ranged reads
    "cache_hits",  # samples read from a shard that was already cached / local
    "cache_misses",  # samples whose shard had to be downloaded first
    "evictions",  # shards evicted
    "retries",  # transient store errors retried
)
_SLOT = struct.Struct("<q")
#: the rank of a shard no plan needs
_NEVER = 2**63
_LOCK_POLL_S = 0.005


@contextmanager
def file_lock(path: Path, timeout_s: float, what: str) -> Iterator[None]:
    """An exclusive fcntl lock on ``path`` (created), held for the block. StorageError when it
    is not obtained within ``timeout_s``."""
    with translated(f"lock {path}"):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StorageError(f"timed out after {timeout_s:g} s waiting for {what}") from None
                time.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


class Counters:
    """This process's counters in ``.stats-<pid>`` (memory-mapped; one writer)."""

    def __init__(self, root: Path) -> None:
        self._lock = threading.Lock()  # the prefetch thread and the reading thread both count
        self.path = root / f".stats-{os.getpid()}"
        size = _SLOT.size * len(COUNTERS)
        with translated(f"create {self.path}"):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)

    def add(self, name: str, n: int = 1) -> None:
        off = COUNTERS.index(name) * _SLOT.size
        with self._lock:
            _SLOT.pack_into(self._map, off, _SLOT.unpack_from(self._map, off)[0] + n)


def sum_counters(root: Path) -> dict[str, int]:
    """Every process's counters in ``root`` summed (files of dead processes count too)."""
    total = dict.fromkeys(COUNTERS, 0)
    for path in root.glob(".stats-*"):
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            continue
        for k, name in enumerate(COUNTERS):
            if len(raw) >= (k + 1) * _SLOT.size:
                total[name] += _SLOT.unpack_from(raw, k * _SLOT.size)[0]
    return total


class ShardCache:
    """The cache directory ``root`` with an optional byte ``limit`` (see the module)."""

    def __init__(self, root: Path, limit: int | None, *, wait_s: float = 600.0) -> None:
        if limit is not None and limit <= 0:
            raise StorageConfigError(f"cache_limit must be a positive number of bytes, got {limit}")
        self.root = root
        self.limit = limit
        self.wait_s = wait_s
        with translated(f"create {root}"):
            root.mkdir(parents=True, exist_ok=True)
        self._seq = 0

    # -- names --------------------------------------------------------------------------
    def path(self, sha256: str, suffix: str) -> Path:
        return self.root / f"{sha256}{suffix}"

    def lookup(self, sha256: str, suffix: str, size: int) -> Path | None:
        """The cached copy if present (and of the right size), touched as used."""
        p = self.path(sha256, suffix)
        try:
            st = p.stat()
        except FileNotFoundError:
            return None
        if st.st_size != size:
            return None
        if time.time() - st.st_mtime > 1.0:
            try:
                os.utime(p)
            except FileNotFoundError:
                return None
        return p

    @contextmanager
    def downloading(self, sha256: str) -> Iterator[None]:
        """Held while this process downloads shard ``sha256`` (others wait)."""
        with file_lock(self.root / f".dl-{sha256}", self.wait_s, f"another process's download of shard {sha256[:12]}"):
            yield

    # -- accounting ---------------------------------------------------------------------
    def _entries(self) -> tuple[list[tuple[Path, int, float]], int]:
        """(cached shards as (path, size, mtime), bytes reserved by downloads in flight)."""
        cached, reserved = [], 0
        for p in self.root.iterdir():
            name = p.name
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if name.startswith(".part-"):
                pid = _part_pid(name)
                if pid is not None and not pid_runs(pid):  # a loader killed mid-download
                    self.abort(p)
                    continue
                reserved += st.st_size
            elif not name.startswith("."):
                cached.append((p, st.st_size, st.st_mtime))
        return cached, reserved

    def usage(self) -> tuple[int, int]:
        """(bytes held by cached shards and reservations, number of cached shards)."""
        cached, reserved = self._entries()
        return sum(s for _, s, _ in cached) + reserved, len(cached)

    def needs(self) -> dict[str, tuple[int, int]]:
        """The last plan's ``{sha256: (first need, last need)}`` (empty when none)."""
        try:
            data = json.loads((self.root / ".needs").read_text())
            if not isinstance(data, dict):
                return {}
            return {str(k): (int(v[0]), int(v[1])) if isinstance(v, list) else (int(v), _NEVER)
                    for k, v in data.items()}
        except (OSError, ValueError, TypeError, IndexError):
            return {}

    def write_needs(self, needs: dict[str, tuple[int, int]]) -> None:
        tmp = self.root / f".needs.tmp-{os.getpid()}"
        with translated(f"write {tmp}"):
            tmp.write_text(json.dumps(needs))
            os.replace(tmp, self.root / ".needs")

    def reserve(self, sha256: str, size: int, *, demand: bool, counters: Counters, label: str) -> Path | None:
        """A ``.part`` file of ``size`` bytes to download shard ``sha256`` into, space made by
        evicting as described in the module. None when ``demand`` is false and the space would
        need evicting a shard needed sooner. StorageConfigError when the shard alone is larger
        than the limit; StorageError when reservations of others keep the cache full for
        ``wait_s``."""
        if self.limit is not None and size > self.limit:
            raise StorageConfigError(f"cache_limit {self.limit} bytes is smaller than dataset shard {label} ({size} bytes)")
        deadline = time.monotonic() + self.wait_s
        while True:
            with file_lock(self.root / ".lock", self.wait_s, "the shard cache lock"):
                part = self._try_reserve(sha256, size, demand, counters)
                if part is not False:
                    return part  # type: ignore[return-value]
            if time.monotonic() > deadline:
                raise StorageError(f"shard cache {self.root} stayed full for {self.wait_s:g} s (cache_limit {self.limit})")
            time.sleep(0.02)

    def _try_reserve(self, sha256: str, size: int, demand: bool, counters: Counters) -> Path | None | bool:
        needs = self.needs() if not demand else None
        if needs and sha256 not in needs:
            return None  # a prefetch from an older plan: the reads it was for are done
        if self.limit is not None:
            cached, reserved = self._entries()
            used = sum(s for _, s, _ in cached) + reserved
            if used + size > self.limit:
                if needs is None:
                    needs = self.needs()
                planned = needs.get(sha256)
                mine = planned[0] if planned is not None else 2**62
                # a demand read of a planned shard is at its first need: what the plan needs
                # only before that is finished (see the module docstring)
                done = mine if demand and planned is not None else -1

                def rank(e: tuple[Path, int, float]) -> int:
                    first, last = needs.get(e[0].name.split(".")[0], (_NEVER, _NEVER))
                    return _NEVER if last < done else first

                def order(e: tuple[Path, int, float]) -> tuple[int, float]:
                    # unneeded first (oldest use first), then the ones needed last
                    r = rank(e)
                    return (0, e[2]) if r == _NEVER else (1, -r)

                for entry in sorted(cached, key=order):
                    path, sz, _ = entry
                    if used + size <= self.limit:
                        break
                    r = rank(entry)
                    if not demand and r != _NEVER and r <= mine:
                        return None  # a prefetch does not push out what is needed sooner
                    with translated(f"evict {path}"):
                        path.unlink(missing_ok=True)
                    counters.add("evictions")
                    used -= sz
                if used + size > self.limit:
                    return None if not demand else False  # reservations in flight: wait
        self._seq += 1
        part = self.root / f".part-{sha256}-{os.getpid()}-{self._seq}"
        with translated(f"create {part}"):
            with open(part, "wb") as f:
                f.truncate(size)
        return part

    def commit(self, part: Path, sha256: str, suffix: str) -> Path:
        """Move a verified download into place (atomic rename), under ``.lock``: a reservation
        lists the directory, then stats each entry, and would count neither the ``.part`` nor
        the shard if the rename fell in between (then reserve past the limit)."""
        final = self.path(sha256, suffix)
        with file_lock(self.root / ".lock", self.wait_s, "the shard cache lock"), translated(f"rename {part}"):
            os.replace(part, final)
        return final

    @staticmethod
    def abort(part: Path) -> None:
        try:
            part.unlink()
        except FileNotFoundError:
            pass

    def sweep(self) -> None:
        """Remove what dead processes left: their ``.part`` files and ``.stats`` files."""
        for p in self.root.glob(".part-*"):
            pid = _part_pid(p.name)
            if pid is not None and not pid_runs(pid):
                self.abort(p)
        for p in self.root.glob(".stats-*"):
            pid = _pid_of(p.name[len(".stats-"):])
            if pid is not None and pid != os.getpid() and not pid_runs(pid):
                p.unlink(missing_ok=True)


def _part_pid(name: str) -> int | None:
    """The downloading process of ``.part-<sha256>-<pid>-<n>``."""
    parts = name.split("-")
    return _pid_of(parts[2]) if len(parts) >= 4 else None


def _pid_of(text: str) -> int | None:
    return int(text) if text.isdigit() else None


