"""Samples of a streaming dataset read from whole local copies of their shards, memory-mapped.

A copy is a local dataset's own shard file or a verified copy in the shard cache
(:mod:`~shoal.storage.streaming_fetch`), mapped read-only, at most :data:`MAPPED_SHARDS` per
process. Its records' offsets (a packed shard's table, a tar's from the index) are checked
once when it is mapped - ascending and inside the copy - so a read slices its records without
checking each, and a copy was verified against the index's sha256 as a whole, so a packed
record's crc32 is not checked again. A copy another process evicted is let go at this
process's first read of it a second or more after its last check (an ``fstat``; a copy still
there is marked as used then, a ``utime``), or at its next new mapping, and fetched again.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shoal.storage import streaming_format as packed
from shoal.storage import streaming_remote as remote
from shoal.storage.datasets import ShardEntry
from shoal.storage.errors import ShardCorrupt
from shoal.storage.streaming_cache import Counters
from shoal.storage.streaming_fetch import ShardFetcher
from shoal.storage.streaming_index import ShardIndex

#: local shard copies a process keeps mapped (least recently mapped dropped first). A rank
#: reads the shards of one shuffle window at a time (16 in the default order, all of them in a
#: one-worker job) and of two across a window's end: fewer maps than that remap a shard on
#: almost every sample (about 5x the per-sample cost, measured). A copy evicted by another
#: process stays on disk until this one reads it again a second or more after it last
#: checked, or maps another shard (then it is unmapped), so the disk space in use can exceed
#: ``cache_limit`` by the evicted shards a process still maps.
MAPPED_SHARDS = 40
#: a packed record's (start, end): two little-endian u64 offsets
_OFFSET_PAIR = struct.Struct("<QQ")

#: a mapped copy: the map, its fd, its path, its records' offsets (None for a packed table over
#: :data:`~shoal.storage.streaming_remote.OFFSETS_TABLE_MAX`: read from the map per record)
Mapped = tuple[mmap.mmap, int, Path, list[int] | None]


class LocalReader:
    """One process's mapped copies of the shards in ``index``, read under one lock.

    Made per process by the dataset; its loading threads may read at once (``maps`` and
    ``touched`` change only under the lock). Copies come from ``fetcher`` (downloaded first
    when not cached: the read waits, and its first sample counts as a cache miss); a copy
    evicted three times between its download and its mapping (a cache too small for the
    worker's readers) is read through ``remote`` instead. Errors name the shard: a copy whose
    header or offsets do not match the index, a record that does not decode - ShardCorrupt;
    the fetcher's errors (a missing or corrupt shard, a store that stays unreachable) as they
    are. ``in_place``: the copies are a local dataset's own files (never marked as used).
    :meth:`close` unmaps every copy; reading maps them again."""

    def __init__(self, index: ShardIndex, fetcher: ShardFetcher, ranged: remote.RemoteReader, counters: Counters, *,
                 in_place: bool) -> None:
        self._index = index
        self._fetcher = fetcher
        self._remote = ranged
        self._counters = counters
        self._in_place = in_place
        self._lock = threading.Lock()
        self.maps: dict[int, Mapped] = {}  # shard -> its mapped copy (least recently mapped first)
        self.touched: dict[int, float] = {}  # shard -> when its copy was last checked (and its mtime set)

    def read_mapped(self, local: dict[int, list[int]], located: list[tuple[int, int]], out: list[Any]) -> list[int]:
        """Fill ``out`` (undecoded samples) for the shards of ``local`` (shard -> slots) whose
        copy this process has mapped and checked for eviction within the last second: their
        records are sliced under one lock (the offsets table was checked when mapped) and
        decoded shard by shard, the hits counted once. Returns the shards left for
        :meth:`read_locals`: not mapped, due for the eviction check, or without a table.
        A step's samples come from a dozen shards or more, two or three of each: a call per
        shard (its lock, clock, counter and checks) cost as much as decoding its records."""
        left: list[int] = []
        got: list[tuple[int, list[int], list[bytes]]] = []
        now = time.monotonic()
        touched = self.touched
        with self._lock:
            maps = self.maps
            for shard, slots in local.items():
                mapped = maps.get(shard)
                if mapped is None or mapped[3] is None or now - touched.get(shard, -10.0) > 1.0:
                    left.append(shard)
                    continue
                mm, table = mapped[0], mapped[3]
                got.append((shard, slots, [mm[table[p] : table[p + 1]] for p in (located[k][1] for k in slots)]))
        if got:
            self._counters.add("cache_hits", sum(len(g[1]) for g in got))
        for shard, slots, records in got:
            for k, sample in zip(slots, self._decode_verified(shard, [located[k][1] for k in slots], records)):
                out[k] = sample
        return left

    def read_locals(self, shard: int, positions: Sequence[int]) -> list[dict[str, Any]]:
        """The samples at ``positions`` of ``shard`` from its local copy (downloaded first
        when not cached; the first of them then counts as a miss)."""
        entry = self._index.shards[shard]
        for _ in range(3):  # evicted by another process between download and open: again
            with self._lock:
                mapped = self.maps.get(shard)
                if mapped is not None and self._evicted(shard, mapped):
                    self._unmap(shard)  # evicted since: do not keep its space alive
                    mapped = None
            hit = True
            if mapped is None:
                path, hit = self._fetcher.file(shard, demand=True)
                try:
                    mapped = self._map(shard, path, entry)
                except FileNotFoundError:
                    continue
            with self._lock:
                mm, table = mapped[0], mapped[3]
                size = len(mm)
                records = []
                for pos in positions:
                    start, end = (table[pos], table[pos + 1]) if table is not None else \
                        _OFFSET_PAIR.unpack_from(mm, packed.offsets_span(pos)[0])
                    if not 0 <= start <= end <= size:
                        raise ShardCorrupt(f"dataset shard {self._index.label(shard)}: sample {pos} lies outside the shard")
                    records.append(mm[start:end])
            if hit:
                self._counters.add("cache_hits", len(positions))
            else:
                self._counters.add("cache_misses")
                if len(positions) > 1:
                    self._counters.add("cache_hits", len(positions) - 1)
            return self._decode_verified(shard, positions, records)
        # the cache is too small for what this worker's processes read at once: read these
        # samples remotely rather than fail (counted in remote_reads)
        return [self._remote.read(shard, pos) for pos in positions]

    def _decode_verified(self, shard: int, positions: Sequence[int], records: list[bytes]) -> list[dict[str, Any]]:
        """The samples in ``records`` (at ``positions`` of ``shard``) from a whole local copy,
        which was verified against the index's sha256 (downloaded, or hashed in place): that
        covers every record, so their crc32s are not checked again. A packed shard's records
        are decoded in one list; an error decodes them again one by one, to name the sample."""
        fmt = self._index.shards[shard].format
        if fmt == "packed":
            try:
                return [packed.decode_record(rec, check_crc=False) for rec in records]
            except packed.FormatError:
                pass
        decode = self._index.decode
        return [decode(shard, pos, rec, fmt, verified=True) for pos, rec in zip(positions, records)]

    def _evicted(self, shard: int, mapped: Mapped) -> bool:
        """(Under the lock.) Whether the mapped copy was evicted since it was mapped (its
        file unlinked); also marks a copy still there as used (its mtime: least-recently-used
        eviction). Both at most once a second per shard and process: a syscall each, on
        every read of a few samples, showed in the loaders' profile."""
        now = time.monotonic()
        if now - self.touched.get(shard, -10.0) <= 1.0:
            return False
        self.touched[shard] = now
        if os.fstat(mapped[1]).st_nlink == 0:
            return True
        if not self._in_place:
            try:
                os.utime(mapped[2])
            except FileNotFoundError:
                return True
        return False

    def _table(self, mm: mmap.mmap, entry: ShardEntry, shard: int) -> list[int] | None:
        """Where each record of a mapped copy starts (and the last ends): a packed shard's
        own table (its header checked against the index; None when the table is larger than
        ``OFFSETS_TABLE_MAX``: a list of ints costs ~36 bytes an entry, in every process
        and for every mapped shard), a tar shard's from the index. A table is checked here,
        once: ascending and inside the copy (so a read slices records without checking each)."""
        if entry.format != "packed":
            table = np.asarray(entry.offsets, dtype=np.int64)
            first = 0
        else:
            n = int(entry.samples or 0)
            first = packed.shard_overhead(n)
            try:
                if len(mm) < first:
                    raise packed.FormatError(f"{len(mm)} bytes cannot hold the offsets of {n} samples")
                if packed.parse_header(mm[: packed.HEADER]) != n:
                    raise packed.FormatError(f"header says {packed.parse_header(mm[: packed.HEADER])} samples, index says {n}")
            except packed.FormatError as exc:
                raise ShardCorrupt(f"dataset shard {self._index.label(shard)}: {exc}") from exc
            if 8 * (n + 1) > remote.OFFSETS_TABLE_MAX:
                return None
            table = packed.offsets_table(mm[packed.HEADER : first], n)
        if len(table) and (table[0] < first or table[-1] > len(mm) or bool((np.diff(table) < 0).any())):
            raise ShardCorrupt(f"dataset shard {self._index.label(shard)}: its records' offsets are not ascending "
                               f"inside the shard's {len(mm)} bytes")
        return table.tolist()

    def _map(self, shard: int, path: Path, entry: ShardEntry) -> Mapped:
        """Map the shard file read-only (kept open, at most :data:`MAPPED_SHARDS` per process)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(fd)
            raise
        try:
            table = self._table(mm, entry, shard)
        except BaseException:
            mm.close()
            os.close(fd)
            raise
        with self._lock:
            for other in [k for k, m in self.maps.items() if k == shard or os.fstat(m[1]).st_nlink == 0]:
                self._unmap(other)  # evicted copies: free their space now
            self.maps[shard] = (mm, fd, path, table)
            while len(self.maps) > MAPPED_SHARDS:
                self._unmap(next(iter(self.maps)))
        return mm, fd, path, table

    def _unmap(self, shard: int) -> None:
        """(Under the lock.)"""
        mm, fd, _, _ = self.maps.pop(shard)
        mm.close()
        os.close(fd)

    def close(self) -> None:
        """Unmap every copy (the files stay)."""
        with self._lock:
            for shard in list(self.maps):
                self._unmap(shard)
