"""Samples of a streaming dataset read by ranged reads, without downloading their shard.

One ranged GET per sample, plus, for a packed shard whose records vary in size, the shard's
offsets table once per process (or, for a table over :data:`OFFSETS_TABLE_MAX`, the sample's
two offsets before each record); a record of known size (the index's ``record_size``) needs
no offsets at all. A packed record's crc32 is checked.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from shoal.storage import streaming_format as packed
from shoal.storage.datasets import shard_key
from shoal.storage.errors import ShardCorrupt
from shoal.storage.streaming_cache import Counters
from shoal.storage.streaming_fetch import ShardFetcher
from shoal.storage.streaming_index import ShardIndex

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

#: ranged reads in flight at once in :meth:`StreamingDataset.read <shoal.storage.streaming.StreamingDataset.read>`
REMOTE_PARALLEL = 8
#: a packed shard's offsets table up to this many bytes is read whole by the first ranged read
#: of the shard (and kept per process); beyond it each ranged read fetches its 16 bytes. A
#: mapped local copy keeps its table as a list up to the same size
#: (:mod:`~shoal.storage.streaming_local`)
OFFSETS_TABLE_MAX = 64 * 1024


class RemoteReader:
    """One process's ranged reads of the shards in ``index`` through ``fetcher``'s store
    connection (transient errors retried there), counted in ``counters`` as ``remote_reads``
    and ``remote_bytes``.

    Made per process by the dataset. :meth:`read` may run on any thread (the dataset runs
    several at once on :meth:`pool`'s threads): the offsets tables it keeps are in a dict
    changed by single operations only (two threads may both fetch a table; either is kept). Errors name the shard: a short read, a header or record that does
    not match the index, a record outside the shard - ShardCorrupt; a missing shard -
    ObjectNotFound; a store that stays unreachable - StorageError after the retry budget.
    :meth:`close` (the dataset's) shuts the threads down; :meth:`pool` makes them again."""

    def __init__(self, index: ShardIndex, fetcher: ShardFetcher, counters: Counters) -> None:
        self._index = index
        self._fetcher = fetcher
        self._counters = counters
        self._lock = threading.Lock()
        self._offsets: dict[int, np.ndarray] = {}  # packed shards' offset tables
        self._pool: ThreadPoolExecutor | None = None  # threads for parallel ranged reads, made on first use

    def pool(self) -> ThreadPoolExecutor:
        """:data:`REMOTE_PARALLEL` threads to run :meth:`read` on."""
        with self._lock:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(REMOTE_PARALLEL, thread_name_prefix="shoal-stream-remote")
            return self._pool

    def close(self) -> None:
        """Stop the threads (reads not started are cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def read(self, shard: int, pos: int) -> dict[str, Any]:
        """The sample at ``pos`` of ``shard`` (not passed to the dataset's ``decode``)."""
        entry = self._index.shards[shard]
        key = shard_key(self._index.index_key, entry.name)
        n = int(entry.samples or 0)
        if entry.record_size is not None:  # fixed-size records (the index says): no offsets to read
            start = packed.shard_overhead(n) + pos * entry.record_size
            end = start + entry.record_size
        elif entry.format == "packed" and 8 * (n + 1) > OFFSETS_TABLE_MAX and shard not in self._offsets:
            # a large table: just this sample's two offsets (16 bytes) rather than the table
            a, length = packed.offsets_span(pos)
            start, end = packed.offset_pair(self._ranged(key, a, length, shard))
        elif entry.format == "packed":
            table = self._offsets.get(shard)
            if table is None:
                raw = self._ranged(key, 0, packed.HEADER + 8 * (n + 1), shard)
                try:
                    if packed.parse_header(raw) != n:
                        raise packed.FormatError(f"header says {packed.parse_header(raw)} samples, index says {n}")
                    table = packed.offsets_table(memoryview(raw)[packed.HEADER:], n)
                except packed.FormatError as exc:
                    raise ShardCorrupt(f"dataset shard {self._index.label(shard)}: {exc}") from exc
                if len(self._offsets) > 256:
                    self._offsets.clear()
                self._offsets[shard] = table
            start, end = int(table[pos]), int(table[pos + 1])
        else:
            assert entry.offsets is not None
            start, end = entry.offsets[pos], entry.offsets[pos + 1]
        if not 0 <= start <= end <= entry.size:
            raise ShardCorrupt(f"dataset shard {self._index.label(shard)}: sample {pos} lies outside the shard")
        raw = self._ranged(key, start, end - start, shard)
        self._counters.add("remote_reads")
        return self._index.decode(shard, pos, raw, entry.format)

    def _ranged(self, key: str, start: int, length: int, shard: int) -> bytes:
        fetcher = self._fetcher
        raw = fetcher.retry(f"ranged read of {self._index.label(shard)}",
                            lambda: fetcher.store().get_range(key, start, length))
        self._counters.add("remote_bytes", len(raw))
        if len(raw) != length:
            raise ShardCorrupt(f"dataset shard {self._index.label(shard)}: short read ({len(raw)} of {length} bytes)")
        return raw
