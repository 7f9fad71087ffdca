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
import operator
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shoal.events import envvars
from shoal.storage.backend import ObjectStore, check_key
from shoal.storage.datasets import INDEX, DatasetIndex
from shoal.storage.errors import ObjectNotFound, StorageConfigError, translated
from shoal.storage.streaming_cache import Counters, ShardCache, sum_counters
from shoal.storage.streaming_fetch import ShardFetcher
from shoal.storage.streaming_index import ShardIndex
from shoal.storage.streaming_local import LocalReader
from shoal.storage.streaming_prefetch import ShardPrefetcher
from shoal.storage.streaming_remote import RemoteReader

DEFAULT_PREDOWNLOAD = 4096


class _Proc:
    """What one process owns: its counters, its store connection and whole shard files
    (``fetcher``), its ranged reads (``remote``), mapped copies (``local``) and prefetch
    thread (``prefetch``). Made again on first use in a forked or unpickled copy."""

    def __init__(self, ds: StreamingDataset, store: ObjectStore | None = None) -> None:
        self.pid = os.getpid()
        self.counters = Counters(ds.cache_dir)
        self.fetcher = ShardFetcher(ds.uri, ds._shards, ds._cache, self.counters, ds.retry_timeout_s,
                                    in_place=ds._local, store=store)
        self.remote = RemoteReader(ds._shards, self.fetcher, self.counters)
        self.local = LocalReader(ds._shards, self.fetcher, self.remote, self.counters, in_place=ds._local)
        self.prefetch = ShardPrefetcher(ds._shards, self.fetcher, ds._cache, ds.predownload)


class StreamingDataset:
    """See the module docstring. Constructing it reads nothing; the index is read on first use.

    A facade: the index is a :class:`~shoal.storage.streaming_index.ShardIndex` (one per
    dataset, pickled with it), and each process reads through its own
    :class:`~shoal.storage.streaming_local.LocalReader` (mapped copies),
    :class:`~shoal.storage.streaming_remote.RemoteReader` (ranged reads) and
    :class:`~shoal.storage.streaming_prefetch.ShardPrefetcher`, over one
    :class:`~shoal.storage.streaming_fetch.ShardFetcher` (store connection, whole shards).
    A method that needs the index loads it first (:meth:`_loaded`), then hands over."""

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
        self._shards = ShardIndex(self._where, self.index_key)
        self._proc_state: _Proc | None = _Proc(self, store)

    # -- per process ----------------------------------------------------------------------
    def _proc(self) -> _Proc:
        st = self._proc_state
        if st is None or st.pid != os.getpid():
            st = self._proc_state = _Proc(self)
        return st

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_proc_state"] = None
        return state

    # -- index ----------------------------------------------------------------------------
    def _loaded(self) -> ShardIndex:
        """The shard index, read from the store on first use."""
        shards = self._shards
        if shards.index is None:
            fetcher = self._proc().fetcher
            shards.load(fetcher.retry(f"read index {self._where}/{self.index_key}",
                                      lambda: fetcher.store().get_bytes(self.index_key)))
        return shards

    @property
    def index(self) -> DatasetIndex:
        index = self._loaded().index
        assert index is not None
        return index

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
        return self._loaded().starts[-1]

    def locate(self, i: int) -> tuple[int, int]:
        """(shard number, position in the shard) of global sample ``i``; IndexError outside."""
        return self._loaded().locate_many((i,))[0]

    def shard_of(self, ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """Shard numbers of many sample ids at once (no range check beyond numpy's)."""
        return self._loaded().shard_of(ids)

    # -- reading --------------------------------------------------------------------------
    def __getitem__(self, i: int) -> Any:
        shard, pos = self.locate(operator.index(i))
        return self._finish(self._proc().local.read_locals(shard, [pos])[0])

    def get_remote(self, i: int) -> Any:
        """Sample ``i`` by ranged reads, without downloading its shard."""
        shard, pos = self.locate(int(i))
        return self._finish(self._proc().remote.read(shard, pos))

    def read(self, ids: Iterable[int], owned: set[int] | frozenset[int]) -> list[Any]:
        """The samples ``ids`` in order: whole-shard reads for shards in ``owned`` (and shards
        that happen to be cached), ranged reads for the others (up to
        :data:`~shoal.storage.streaming_remote.REMOTE_PARALLEL` at once, started before the
        local samples are read and decoded, so their round trips overlap that work). Local
        samples are taken shard by shard (one mapping check and one count per shard and call)
        and decoded in the order of ``ids``, then the ranged ones. The first error raises
        (naming the shard)."""
        located = self._loaded().locate_many(ids)
        proc = self._proc()
        fetcher, ranged, copies = proc.fetcher, proc.remote, proc.local
        futures = {}
        local: dict[int, list[int]] = {}  # shard -> slots read from its local copy
        whole: dict[int, bool] = {}  # shard -> read from a local copy (owned, local or cached anyway)
        for slot, (shard, pos) in enumerate(located):
            here = whole.get(shard)
            if here is None:
                here = whole[shard] = shard in owned or self._local or fetcher.cached_path(shard) is not None
            if here:
                local.setdefault(shard, []).append(slot)
            else:
                futures[slot] = ranged.pool().submit(ranged.read, shard, pos)
        try:
            out: list[Any] = [None] * len(located)
            for shard in copies.read_mapped(local, located, out):
                slots = local[shard]
                for slot, sample in zip(slots, copies.read_locals(shard, [located[k][1] for k in slots])):
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

    def __repr__(self) -> str:
        index = self._shards.index
        n = len(index.shards) if index is not None else "?"
        return f"StreamingDataset({self._where!r}, shards={n}, cache_dir={str(self.cache_dir)!r}, cache_limit={self.cache_limit})"

    def _finish(self, sample: dict[str, Any]) -> Any:
        return self.decode(sample) if self.decode is not None else sample

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
        if len(ids):
            self._loaded()
        self._proc().prefetch.plan(ids, owned)

    def wait_prefetched(self, timeout_s: float) -> bool:
        """Wait until every shard of the last plan's horizon is cached (tests, benches)."""
        return self._proc().prefetch.wait(timeout_s)

    def close(self) -> None:
        """Stop this process's prefetch thread and reading threads and unmap its shard copies
        (cached shards stay; the dataset can still be read afterwards)."""
        proc = self._proc_state
        if proc is not None and proc.pid == os.getpid():
            proc.prefetch.close()
            proc.remote.close()
            proc.local.close()

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

    root = Path(envvars.STREAM_CACHE_ROOT.get() or Path(tempfile.gettempdir()) / "shoal-stream-cache")
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
