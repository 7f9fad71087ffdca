"""A map-style dataset streamed from shard files in a local directory or an S3 prefix.

::

    ds = StreamingDataset("s3://bucket/prefix", decode=to_tensors, cache_limit=50 << 20)
    len(ds); ds[i]; ds.locate(i); ds.plan(upcoming, owned); ds.stats()

The dataset is described by its index (``index.json``, :mod:`shoal.storage.datasets`) whose
shards carry ``samples`` and ``format`` (``packed``: :mod:`~shoal.storage.streaming_format`;
``webdataset``: :mod:`~shoal.storage.streaming_tar`). Global sample id ``i`` is the i-th
sample in index order; :meth:`StreamingDataset.locate` maps it to ``(shard, position)``.

Reading
    ``ds[i]`` reads from the local copy of the shard, downloading the whole shard first if it
    is not cached (verified against the index's size and sha256, then renamed into the cache:
    a shard that fails is never cached and raises :class:`~shoal.storage.errors.ShardCorrupt`
    naming it). :meth:`get_remote` reads one sample with ranged reads instead (counted as
    remote; a packed record's crc32 is checked). :meth:`read` does either per sample: whole
    shards for the shards a worker owns, ranged reads for the others (unless cached anyway).
    A dataset in a local directory (``file://`` or a path) is read in place: nothing is
    copied, each shard is hashed once per cache directory.

Prefetch and cache (remote stores)
    :meth:`plan` tells the dataset which samples this worker reads next, in order. A
    background thread downloads the owned shards of the first ``predownload`` of them, in the
    order they are needed, and the planned order decides eviction: the cache never holds more
    than ``cache_limit`` bytes (:mod:`~shoal.storage.streaming_cache`). Transient store errors
    (endpoint unreachable, 5xx) are retried with exponential backoff for up to
    ``retry_timeout_s``; a missing or corrupt shard is not retried and raises, naming it.

Processes
    The object is safe to use from forked loader processes (and picklable for spawned ones):
    store connections, threads and locks are per process, created on first use after a fork;
    the cache directory and its counters are shared by the processes of one worker (the
    training process and its loaders), so :meth:`stats` counts all of them. Give each worker
    its own ``cache_dir``. The default is a fresh directory per dataset object under
    ``$SHOAL_STREAM_CACHE_ROOT`` (default ``<tmp>/shoal-stream-cache``), removed when the
    process that made it exits, or by the next dataset made on the machine when that process
    was killed.
"""

from __future__ import annotations

import atexit
import bisect
import mmap
import operator
import os
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shoal.storage import streaming_fetch as fetch
from shoal.storage import streaming_format as packed
from shoal.storage import streaming_tar as wds
from shoal.storage.backend import ObjectStore, check_key
from shoal.storage.datasets import INDEX, DatasetIndex, parse_index, shard_key
from shoal.storage.errors import ObjectNotFound, ShardCorrupt, StorageConfigError, translated
from shoal.storage.streaming_cache import Counters, ShardCache, sum_counters

DEFAULT_PREDOWNLOAD = 4096
#: ranged reads in flight at once in :meth:`StreamingDataset.read`
REMOTE_PARALLEL = 8
#: local shard copies a process keeps mapped (least recently mapped dropped first). A rank
#: reads the shards of one shuffle window at a time (16 in the default order, all of them in a
#: one-worker job) and of two across a window's end: fewer maps than that remap a shard on
#: almost every sample (about 5x the per-sample cost, measured). A copy evicted by another
#: process stays on disk until this one reads it again a second or more after it last
#: checked, or maps another shard (then it is unmapped), so the disk space in use can exceed
#: ``cache_limit`` by the evicted shards a process still maps.
MAPPED_SHARDS = 40
#: cached copies the prefetch thread remembers (re-checked with a stat; beyond: forgotten, looked up again)
PREFETCHED_KEPT = 4096
#: a packed shard's offsets table up to this many bytes is read whole by the first ranged read
#: of the shard (and kept per process); beyond it each ranged read fetches its 16 bytes
OFFSETS_TABLE_MAX = 64 * 1024
#: a packed record's (start, end): two little-endian u64 offsets
_OFFSET_PAIR = struct.Struct("<QQ")


class _Proc:
    """What one process owns: store connection, prefetch thread, locks, counters."""

    def __init__(self, cache_root: Path) -> None:
        self.pid = os.getpid()
        self.store: ObjectStore | None = None
        self.lock = threading.Lock()
        self.counters = Counters(cache_root)
        self.offsets: dict[int, np.ndarray] = {}  # packed shards' offset tables (ranged reads)
        self.verified: set[int] = set()  # local shards hashed by this process
        self.thread: threading.Thread | None = None
        self.wake = threading.Event()
        self.want: list[int] = []  # shards to prefetch, in order
        #: shard -> its cached copy, as the prefetch thread last found or made it: a later
        #: plan re-checks it with one stat (an eviction unlinks it), not a lookup
        self.prefetched: dict[int, str] = {}
        self.failed: set[int] = set()  # shards whose prefetch failed (demand reads raise)
        self.needs: dict[str, tuple[int, int]] | None = None  # last needs written (skip rewriting them)
        self.pool: Any = None  # threads for parallel ranged reads, made on first use
        #: shard -> mapped local copy (LRU order): the map, its fd, its path, its records'
        #: offsets (None for a packed table over OFFSETS_TABLE_MAX: read from the map per record)
        self.maps: dict[int, tuple[mmap.mmap, int, Path, list[int] | None]] = {}
        self.touched: dict[int, float] = {}  # shard -> when its copy's mtime was last set
        self.stop = False


class StreamingDataset:
    """See the module docstring. Constructing it reads nothing; the index is read on first use."""

    def __init__(
        self,
        uri: str,
        *,
        decode: Callable[[dict[str, Any]], Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        predownload: int = DEFAULT_PREDOWNLOAD,
        index_key: str = INDEX,
        retry_timeout_s: float = 60.0,
    ) -> None:
        from shoal.storage.uri import open_store

        if "://" not in uri and not uri.startswith("/"):
            uri = str(Path(uri).absolute())  # a plain relative path: the directory it names now
        if uri.startswith("memory:"):
            raise StorageConfigError("a StreamingDataset needs file:// or s3:// (memory stores are per process)")
        if not isinstance(predownload, int) or predownload < 0:
            raise StorageConfigError(f"predownload must be an int >= 0 (samples), got {predownload!r}")
        if cache_limit is not None and (not isinstance(cache_limit, int) or cache_limit <= 0):
            raise StorageConfigError(f"cache_limit must be a positive int (bytes) or None, got {cache_limit!r}")
        if decode is not None and not callable(decode):
            raise StorageConfigError(f"decode must be a callable (a top-level function), got {type(decode).__name__}")
        self.uri = uri
        self.decode = decode
        self.cache_limit = cache_limit
        self.predownload = predownload
        self.index_key = check_key(index_key)
        self.retry_timeout_s = retry_timeout_s
        if uri.startswith(("/", "file:")):
            from urllib.parse import unquote, urlsplit

            folder = Path(unquote(urlsplit(uri).path) if uri.startswith("file:") else uri)
            if not folder.is_dir():  # open_store would create it
                raise ObjectNotFound(f"dataset directory {folder} does not exist")
        store = open_store(uri)  # validates the URI and the S3 settings now
        self._local = store.local_path(index_key) is not None
        self._where = store.uri
        if cache_dir is None:
            cache_dir = _default_cache_dir()
            atexit.register(_remove_if_owner, cache_dir, os.getpid())
        self.cache_dir = Path(cache_dir).absolute()
        self._cache = ShardCache(self.cache_dir, cache_limit)
        self._cache.sweep()
        self._index: DatasetIndex | None = None
        self._cum: np.ndarray | None = None
        self._starts: list[int] = []  # the same as a list (bisect in locate)
        self._proc_state: _Proc | None = _Proc(self.cache_dir)
        self._proc_state.store = store

    # -- per process ----------------------------------------------------------------------
    def _proc(self) -> _Proc:
        st = self._proc_state
        if st is None or st.pid != os.getpid():
            st = self._proc_state = _Proc(self.cache_dir)
        return st

    def _store(self) -> ObjectStore:
        st = self._proc()
        if st.store is None:
            from shoal.storage.uri import open_store

            st.store = open_store(self.uri)
        return st.store

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_proc_state"] = None
        return state

    # -- index ----------------------------------------------------------------------------
    @property
    def index(self) -> DatasetIndex:
        if self._index is None:
            raw = self._retry(f"read index {self._where}/{self.index_key}",
                              lambda: self._store().get_bytes(self.index_key))
            index = parse_index(raw, f"{self._where}/{self.index_key}")
            for s in index.shards:
                if s.samples is None or s.format is None:
                    raise ShardCorrupt(
                        f"{self._where}/{self.index_key}: shard {s.name} has no sample count or format "
                        "(write the index with shoal dataset pack / shoal dataset index)"
                    )
                if s.format == "webdataset" and s.offsets is None:
                    raise ShardCorrupt(f"{self._where}/{self.index_key}: webdataset shard {s.name} has no offsets")
            self._cum = np.concatenate([[0], np.cumsum([s.samples for s in index.shards], dtype=np.int64)])
            self._starts = [int(x) for x in self._cum]
            self._index = index
        return self._index

    @property
    def shard_samples(self) -> list[int]:
        """Samples per shard, in index order."""
        return [int(s.samples or 0) for s in self.index.shards]

    @property
    def shard_sizes(self) -> list[int]:
        """Bytes per shard, in index order."""
        return [s.size for s in self.index.shards]

    @property
    def total_bytes(self) -> int:
        return sum(self.shard_sizes)

    def __len__(self) -> int:
        _ = self.index
        assert self._cum is not None
        return int(self._cum[-1])

    def locate(self, i: int) -> tuple[int, int]:
        """(shard number, position in the shard) of global sample ``i``; IndexError outside."""
        return self._locate_many((i,))[0]

    def _locate_many(self, ids: Iterable[int]) -> list[tuple[int, int]]:
        """:meth:`locate` of every id, in one loop of plain ints: a loader reads a step's
        few dozen ids between long decodes, when numpy's calls cost several times a bisect
        (cold caches: 116 against 29 us for 32 ids, measured)."""
        if self._index is None:
            _ = self.index
        starts = self._starts
        n = starts[-1]
        out = []
        for i in ids:
            i = int(i)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError(f"sample {i} out of range for a dataset of {n} samples")
            shard = bisect.bisect_right(starts, i) - 1
            out.append((shard, i - starts[shard]))
        return out

    def shard_of(self, ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Shard numbers of many sample ids at once (no range check beyond numpy's)."""
        _ = self.index
        assert self._cum is not None
        return np.searchsorted(self._cum, np.asarray(ids, dtype=np.int64), side="right") - 1

    def _label(self, shard: int) -> str:
        return f"{self._where}/{shard_key(self.index_key, self.index.shards[shard].name)}"

    # -- reading --------------------------------------------------------------------------
    def __getitem__(self, i: int) -> Any:
        shard, pos = self.locate(operator.index(i))
        return self._finish(self._read_local(shard, pos))

    def get_remote(self, i: int) -> Any:
        """Sample ``i`` by ranged reads, without downloading its shard."""
        shard, pos = self.locate(int(i))
        return self._finish(self._read_remote(shard, pos))

    def read(self, ids: Iterable[int], owned: set[int] | frozenset[int]) -> list[Any]:
        """The samples ``ids`` in order: whole-shard reads for shards in ``owned`` (and shards
        that happen to be cached), ranged reads for the others (up to :data:`REMOTE_PARALLEL`
        at once, started before the local samples are read and decoded, so their round trips
        overlap that work). Local samples are taken shard by shard (one mapping check and one
        count per shard and call) and decoded in the order of ``ids``, then the ranged ones.
        The first error raises (naming the shard)."""
        located = self._locate_many(ids)
        futures = {}
        local: dict[int, list[int]] = {}  # shard -> slots read from its local copy
        whole: dict[int, bool] = {}  # shard -> read from a local copy (owned, local or cached anyway)
        for slot, (shard, pos) in enumerate(located):
            here = whole.get(shard)
            if here is None:
                here = whole[shard] = shard in owned or self._local or self._cached_path(shard) is not None
            if here:
                local.setdefault(shard, []).append(slot)
            else:
                futures[slot] = self._pool().submit(self._read_remote, shard, pos)
        try:
            out: list[Any] = [None] * len(located)
            for shard in self._read_mapped(local, located, out):
                slots = local[shard]
                for slot, sample in zip(slots, self._read_locals(shard, [located[k][1] for k in slots])):
                    out[slot] = sample
            decode = self.decode
            if decode is not None:  # the local samples' decode overlaps the ranged reads
                if futures:
                    out = [s if slot in futures else decode(s) for slot, s in enumerate(out)]
                else:
                    out = [decode(s) for s in out]
            for slot, fut in futures.items():
                out[slot] = self._finish(fut.result())
        finally:
            for fut in futures.values():
                fut.cancel()  # an error raised: reads not started yet are not needed
        return out

    def _read_mapped(self, local: dict[int, list[int]], located: list[tuple[int, int]], out: list[Any]) -> list[int]:
        """Fill ``out`` (undecoded samples) for the shards of ``local`` (shard -> slots) whose
        copy this process has mapped and checked for eviction within the last second: their
        records are sliced under one lock (the offsets table was checked when mapped) and
        decoded shard by shard, the hits counted once. Returns the shards left for
        :meth:`_read_locals`: not mapped, due for the eviction check, or without a table.
        A step's samples come from a dozen shards or more, two or three of each: a call per
        shard (its lock, clock, counter and checks) cost as much as decoding its records."""
        proc = self._proc()
        left: list[int] = []
        got: list[tuple[int, list[int], list[bytes]]] = []
        now = time.monotonic()
        touched = proc.touched
        with proc.lock:
            maps = proc.maps
            for shard, slots in local.items():
                mapped = maps.get(shard)
                if mapped is None or mapped[3] is None or now - touched.get(shard, -10.0) > 1.0:
                    left.append(shard)
                    continue
                mm, table = mapped[0], mapped[3]
                got.append((shard, slots, [mm[table[p] : table[p + 1]] for p in (located[k][1] for k in slots)]))
        if got:
            proc.counters.add("cache_hits", sum(len(g[1]) for g in got))
        for shard, slots, records in got:
            for k, sample in zip(slots, self._decode_verified(shard, [located[k][1] for k in slots], records)):
                out[k] = sample
        return left

    def _decode_verified(self, shard: int, positions: Sequence[int], records: list[bytes]) -> list[dict[str, Any]]:
        """The samples in ``records`` (at ``positions`` of ``shard``) from a whole local copy,
        which was verified against the index's sha256 (downloaded, or hashed in place): that
        covers every record, so their crc32s are not checked again. A packed shard's records
        are decoded in one list; an error decodes them again one by one, to name the sample."""
        fmt = self.index.shards[shard].format
        if fmt == "packed":
            try:
                return [packed.decode_record(rec, check_crc=False) for rec in records]
            except packed.FormatError:
                pass
        return [self._decode(shard, pos, rec, fmt, verified=True) for pos, rec in zip(positions, records)]

    def _pool(self) -> Any:
        proc = self._proc()
        with proc.lock:
            if proc.pool is None:
                from concurrent.futures import ThreadPoolExecutor

                proc.pool = ThreadPoolExecutor(REMOTE_PARALLEL, thread_name_prefix="shoal-stream-remote")
            return proc.pool

    def __repr__(self) -> str:
        n = len(self._index.shards) if self._index is not None else "?"
        return f"StreamingDataset({self._where!r}, shards={n}, cache_dir={str(self.cache_dir)!r}, cache_limit={self.cache_limit})"

    def _finish(self, sample: dict[str, Any]) -> Any:
        return self.decode(sample) if self.decode is not None else sample

    def _cached_path(self, shard: int) -> Path | None:
        entry = self.index.shards[shard]
        return self._cache.lookup(entry.sha256, fetch.suffix(entry), entry.size)

    def _read_local(self, shard: int, pos: int) -> dict[str, Any]:
        return self._read_locals(shard, [pos])[0]

    def _read_locals(self, shard: int, positions: Sequence[int]) -> list[dict[str, Any]]:
        """The samples at ``positions`` of ``shard`` from its local copy (downloaded first
        when not cached; the first of them then counts as a miss)."""
        proc = self._proc()
        entry = self.index.shards[shard]
        for _ in range(3):  # evicted by another process between download and open: again
            with proc.lock:
                mapped = proc.maps.get(shard)
                if mapped is not None and self._evicted(proc, shard, mapped):
                    self._unmap(proc, shard)  # evicted since: do not keep its space alive
                    mapped = None
            hit = True
            if mapped is None:
                path, hit = self._shard_file(shard, demand=True)
                try:
                    mapped = self._map(proc, shard, path, entry)
                except FileNotFoundError:
                    continue
            with proc.lock:
                mm, table = mapped[0], mapped[3]
                size = len(mm)
                records = []
                for pos in positions:
                    start, end = (table[pos], table[pos + 1]) if table is not None else \
                        _OFFSET_PAIR.unpack_from(mm, packed.offsets_span(pos)[0])
                    if not 0 <= start <= end <= size:
                        raise ShardCorrupt(f"dataset shard {self._label(shard)}: sample {pos} lies outside the shard")
                    records.append(mm[start:end])
            if hit:
                proc.counters.add("cache_hits", len(positions))
            else:
                proc.counters.add("cache_misses")
                if len(positions) > 1:
                    proc.counters.add("cache_hits", len(positions) - 1)
            return self._decode_verified(shard, positions, records)
        # the cache is too small for what this worker's processes read at once: read these
        # samples remotely rather than fail (counted in remote_reads)
        return [self._read_remote(shard, pos) for pos in positions]

    def _evicted(self, proc: _Proc, shard: int, mapped: tuple[mmap.mmap, int, Path, list[int] | None]) -> bool:
        """(Under ``proc.lock``.) Whether the mapped copy was evicted since it was mapped (its
        file unlinked); also marks a copy still there as used (its mtime: least-recently-used
        eviction). Both at most once a second per shard and process: a syscall each, on
        every read of a few samples, showed in the loaders' profile."""
        now = time.monotonic()
        if now - proc.touched.get(shard, -10.0) <= 1.0:
            return False
        proc.touched[shard] = now
        if os.fstat(mapped[1]).st_nlink == 0:
            return True
        if not self._local:
            try:
                os.utime(mapped[2])
            except FileNotFoundError:
                return True
        return False

    def _offsets(self, mm: mmap.mmap, entry: Any, shard: int) -> list[int] | None:
        """Where each record of a mapped copy starts (and the last ends): a packed shard's
        own table (its header checked against the index; None when the table is larger than
        :data:`OFFSETS_TABLE_MAX`: a list of ints costs ~36 bytes an entry, in every process
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
                raise ShardCorrupt(f"dataset shard {self._label(shard)}: {exc}") from exc
            if 8 * (n + 1) > OFFSETS_TABLE_MAX:
                return None
            table = packed.offsets_table(mm[packed.HEADER : first], n)
        if len(table) and (table[0] < first or table[-1] > len(mm) or bool((np.diff(table) < 0).any())):
            raise ShardCorrupt(f"dataset shard {self._label(shard)}: its records' offsets are not ascending "
                               f"inside the shard's {len(mm)} bytes")
        return table.tolist()

    def _map(self, proc: _Proc, shard: int, path: Path, entry: Any) -> tuple[mmap.mmap, int, Path, list[int] | None]:
        """Map the shard file read-only (kept open, at most :data:`MAPPED_SHARDS` per process)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(fd)
            raise
        try:
            table = self._offsets(mm, entry, shard)
        except BaseException:
            mm.close()
            os.close(fd)
            raise
        with proc.lock:
            for other in [k for k, m in proc.maps.items() if k == shard or os.fstat(m[1]).st_nlink == 0]:
                self._unmap(proc, other)  # evicted copies: free their space now
            proc.maps[shard] = (mm, fd, path, table)
            while len(proc.maps) > MAPPED_SHARDS:
                self._unmap(proc, next(iter(proc.maps)))
        return mm, fd, path, table

    @staticmethod
    def _unmap(proc: _Proc, shard: int) -> None:
        mm, fd, _, _ = proc.maps.pop(shard)
        mm.close()
        os.close(fd)

    def _decode(self, shard: int, pos: int, raw: bytes, fmt: str, *, verified: bool = False) -> dict[str, Any]:
        """The sample in record ``raw``; ``verified``: from a copy of the shard whose sha256
        was checked (a packed record's crc32 is then not checked again)."""
        try:
            return packed.decode_record(raw, check_crc=not verified) if fmt == "packed" else wds.decode_range(raw)
        except packed.FormatError as exc:
            raise ShardCorrupt(f"dataset shard {self._label(shard)}: sample {pos}: {exc}") from exc

    def _read_remote(self, shard: int, pos: int) -> dict[str, Any]:
        proc = self._proc()
        entry = self.index.shards[shard]
        key = shard_key(self.index_key, entry.name)
        n = int(entry.samples or 0)
        if entry.record_size is not None:  # fixed-size records (the index says): no offsets to read
            start = packed.shard_overhead(n) + pos * entry.record_size
            end = start + entry.record_size
        elif entry.format == "packed" and 8 * (n + 1) > OFFSETS_TABLE_MAX and shard not in proc.offsets:
            # a large table: just this sample's two offsets (16 bytes) rather than the table
            a, length = packed.offsets_span(pos)
            start, end = packed.offset_pair(self._ranged(key, a, length, shard))
        elif entry.format == "packed":
            table = proc.offsets.get(shard)
            if table is None:
                raw = self._ranged(key, 0, packed.HEADER + 8 * (n + 1), shard)
                try:
                    if packed.parse_header(raw) != n:
                        raise packed.FormatError(f"header says {packed.parse_header(raw)} samples, index says {n}")
                    table = packed.offsets_table(memoryview(raw)[packed.HEADER:], n)
                except packed.FormatError as exc:
                    raise ShardCorrupt(f"dataset shard {self._label(shard)}: {exc}") from exc
                if len(proc.offsets) > 256:
                    proc.offsets.clear()
                proc.offsets[shard] = table
            start, end = int(table[pos]), int(table[pos + 1])
        else:
            assert entry.offsets is not None
            start, end = entry.offsets[pos], entry.offsets[pos + 1]
        if not 0 <= start <= end <= entry.size:
            raise ShardCorrupt(f"dataset shard {self._label(shard)}: sample {pos} lies outside the shard")
        raw = self._ranged(key, start, end - start, shard)
        proc.counters.add("remote_reads")
        return self._decode(shard, pos, raw, entry.format)

    def _ranged(self, key: str, start: int, length: int, shard: int) -> bytes:
        raw = self._retry(f"ranged read of {self._label(shard)}",
                          lambda: self._store().get_range(key, start, length))
        self._proc().counters.add("remote_bytes", len(raw))
        if len(raw) != length:
            raise ShardCorrupt(f"dataset shard {self._label(shard)}: short read ({len(raw)} of {length} bytes)")
        return raw

    # -- whole shards ---------------------------------------------------------------------
    def _shard_file(self, shard: int, *, demand: bool) -> tuple[Path, bool]:
        """(local verified file of the shard, whether it was there already)."""
        entry = self.index.shards[shard]
        store = self._store()
        key = shard_key(self.index_key, entry.name)
        if self._local:
            local = store.local_path(key)
            assert local is not None
            self._verify_in_place(shard, local)
            return local, True
        got = self._ensure_cached(shard, demand=demand)
        assert got is not None
        return got

    def _ensure_cached(self, shard: int, *, demand: bool) -> tuple[Path, bool] | None:
        entry = self.index.shards[shard]
        return fetch.fetch_to_cache(self._cache, self._store, shard_key(self.index_key, entry.name), entry,
                                    self._label(shard), demand=demand, counters=self._proc().counters,
                                    retry_timeout_s=self.retry_timeout_s)

    def _verify_in_place(self, shard: int, path: Path) -> None:
        proc = self._proc()
        if shard in proc.verified:
            return
        fetch.verify_in_place(self._cache, path, self.index.shards[shard], self._label(shard))
        with proc.lock:
            proc.verified.add(shard)

    def _retry(self, what: str, fn: Callable[[], Any]) -> Any:
        return fetch.retry(what, fn, self.retry_timeout_s, self._proc().counters)

    # -- planning ---------------------------------------------------------------------------
    def plan(self, upcoming_ids: Sequence[int] | np.ndarray, owned: set[int] | frozenset[int]) -> None:
        """This worker reads ``upcoming_ids`` next, in this order: prefetch the owned shards
        of the first ``predownload`` of them in the background, and rank every owned shard by
        its first and last need for eviction. Returns at once; a prefetch error is not raised here (the
        read that needs the shard raises it). A no-op for a local directory.

        Call it again as reading proceeds - at least whenever the set of shards ahead changes
        (the training worker does exactly that, with the ids from the committed cursor on):
        eviction follows the order of the last plan, so a plan never renewed keeps ranking
        shards already read as needed soon. Only one process of a worker plans (the training
        process); its loaders just read."""
        if self._local:
            return
        ids = np.asarray(upcoming_ids, dtype=np.int64)
        shards = self.shard_of(ids) if len(ids) else np.zeros(0, dtype=np.int64)
        uniq, first = np.unique(shards, return_index=True)
        last = len(shards) - 1 - np.unique(shards[::-1], return_index=True)[1]  # same uniq order
        order = np.argsort(first, kind="stable")
        needs = {self.index.shards[int(uniq[k])].sha256: (int(first[k]), int(last[k])) for k in order
                 if int(uniq[k]) in owned}
        proc = self._proc()
        if needs != proc.needs:
            self._cache.write_needs(needs)
            proc.needs = needs
        horizon = min(len(ids), self.predownload)
        want = [int(uniq[k]) for k in order if first[k] < horizon and int(uniq[k]) in owned]
        with proc.lock:
            proc.want = want
            if proc.thread is None or not proc.thread.is_alive():
                proc.stop = False
                proc.thread = threading.Thread(target=self._prefetch_loop, args=(proc,), daemon=True,
                                               name="shoal-stream-prefetch")
                proc.thread.start()
        proc.wake.set()

    def _prefetch_loop(self, proc: _Proc) -> None:
        while not proc.stop:
            proc.wake.wait(1.0)
            proc.wake.clear()
            with proc.lock:
                want = list(proc.want)
            for shard in want:
                if proc.stop or proc.wake.is_set():
                    break  # a newer plan: start over from its first shard
                if shard in proc.failed:
                    continue
                known = proc.prefetched.get(shard)
                if known is not None and os.path.exists(known):
                    continue
                try:
                    got = self._ensure_cached(shard, demand=False)
                except Exception:  # noqa: BLE001 - the demand read raises it, naming the shard
                    proc.failed.add(shard)
                    continue
                if got is None:
                    break  # the cache is full of shards needed sooner
                if len(proc.prefetched) >= PREFETCHED_KEPT:
                    proc.prefetched.clear()
                proc.prefetched[shard] = os.fspath(got[0])

    def wait_prefetched(self, timeout_s: float) -> bool:
        """Wait until every shard of the last plan's horizon is cached (tests, benches)."""
        proc = self._proc()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with proc.lock:
                want = list(proc.want)
            if all(s in proc.failed or self._cached_path(s) is not None for s in want):
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        """Stop this process's prefetch thread and reading threads and unmap its shard copies
        (cached shards stay; the dataset can still be read afterwards)."""
        proc = self._proc_state
        if proc is not None and proc.pid == os.getpid() and proc.thread is not None:
            proc.stop = True
            proc.wake.set()
            proc.thread.join(timeout=10)
        if proc is not None and proc.pid == os.getpid() and proc.pool is not None:
            proc.pool.shutdown(wait=True, cancel_futures=True)
            proc.pool = None
        if proc is not None and proc.pid == os.getpid():
            with proc.lock:
                for shard in list(proc.maps):
                    self._unmap(proc, shard)

    # -- visibility -------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Monotonic counters of every process using this cache directory, plus the cache's
        current ``cached_bytes``, ``shards_cached`` and ``cache_limit`` (0: none)."""
        self._proc()  # make sure this process's counter file exists
        out = sum_counters(self.cache_dir)
        used, count = self._cache.usage()
        out.update(cached_bytes=used, shards_cached=count, cache_limit=self.cache_limit or 0)
        return out


def _default_cache_dir() -> str:
    """A fresh ``<pid>-<random>`` directory under ``$SHOAL_STREAM_CACHE_ROOT`` (default
    ``<tmp>/shoal-stream-cache``), after removing the ones of processes that no longer run
    (a worker killed with SIGKILL never runs its exit handler)."""
    from shoal.core.procs import pid_runs
    from shoal.storage.streaming_cache import _pid_of

    root = Path(os.environ.get("SHOAL_STREAM_CACHE_ROOT") or Path(tempfile.gettempdir()) / "shoal-stream-cache")
    with translated(f"create {root}"):
        root.mkdir(parents=True, exist_ok=True)
        for old in root.iterdir():
            pid = _pid_of(old.name.split("-", 1)[0])
            if old.is_dir() and pid is not None and not pid_runs(pid):
                shutil.rmtree(old, ignore_errors=True)
        return tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=root)


def _remove_if_owner(path: str, pid: int) -> None:
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)
