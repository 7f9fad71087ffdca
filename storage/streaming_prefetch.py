"""The background download of the shards a worker reads next, and the eviction order they set.

:meth:`ShardPrefetcher.plan` takes the sample ids a worker reads next, in order: it ranks the
worker's owned shards by the positions of their first and last upcoming samples (written to
the cache's ``.needs`` for the worker's other processes: the eviction order,
:mod:`~shoal.storage.streaming_cache`) and hands the owned shards of the first
``predownload`` samples to a thread that downloads them in that order.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from shoal.storage.streaming_cache import ShardCache
from shoal.storage.streaming_fetch import ShardFetcher
from shoal.storage.streaming_index import ShardIndex

#: cached copies the prefetch thread remembers (re-checked with a stat; beyond: forgotten, looked up again)
PREFETCHED_KEPT = 4096


class ShardPrefetcher:
    """One process's prefetch of the shards in ``index`` into ``cache``, through ``fetcher``.

    Made per process by the dataset; only the process that plans (a worker's training
    process) starts the thread, on its first :meth:`plan`. :meth:`plan` returns at once and
    may be called from any thread; a newer plan makes the thread start over from its first
    shard. A prefetch never evicts a shard needed before its own, and stops at the first
    shard the cache has no room for. A prefetch error is never raised here: the shard is left
    alone from then on, and the read that needs it downloads it and raises. :meth:`close`
    stops the thread (waiting up to 10 s); a later plan starts it again."""

    def __init__(self, index: ShardIndex, fetcher: ShardFetcher, cache: ShardCache, predownload: int) -> None:
        self._index = index
        self._fetcher = fetcher
        self._cache = cache
        self._predownload = predownload
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = False
        self._want: list[int] = []  # shards to prefetch, in order
        #: shard -> its cached copy, as the prefetch thread last found or made it: a later
        #: plan re-checks it with one stat (an eviction unlinks it), not a lookup
        self._prefetched: dict[int, str] = {}
        self._failed: set[int] = set()  # shards whose prefetch failed (demand reads raise)
        self._needs: dict[str, tuple[int, int]] | None = None  # last needs written (skip rewriting them)

    def plan(self, ids: np.ndarray, owned: set[int] | frozenset[int]) -> None:
        """This worker reads ``ids`` (int64) next, in this order; see the module. The index
        must be loaded unless ``ids`` is empty."""
        shards = self._index.shard_of(ids) if len(ids) else np.zeros(0, dtype=np.int64)
        uniq, first = np.unique(shards, return_index=True)
        last = len(shards) - 1 - np.unique(shards[::-1], return_index=True)[1]  # same uniq order
        order = np.argsort(first, kind="stable")
        needs = {self._index.shards[int(uniq[k])].sha256: (int(first[k]), int(last[k])) for k in order
                 if int(uniq[k]) in owned}
        if needs != self._needs:
            self._cache.write_needs(needs)
            self._needs = needs
        horizon = min(len(ids), self._predownload)
        want = [int(uniq[k]) for k in order if first[k] < horizon and int(uniq[k]) in owned]
        with self._lock:
            self._want = want
            if self._thread is None or not self._thread.is_alive():
                self._stop = False
                self._thread = threading.Thread(target=self._loop, daemon=True, name="shoal-stream-prefetch")
                self._thread.start()
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop:
            self._wake.wait(1.0)
            self._wake.clear()
            with self._lock:
                want = list(self._want)
            for shard in want:
                if self._stop or self._wake.is_set():
                    break  # a newer plan: start over from its first shard
                if shard in self._failed:
                    continue
                known = self._prefetched.get(shard)
                if known is not None and os.path.exists(known):
                    continue
                try:
                    got = self._fetcher.ensure_cached(shard, demand=False)
                except Exception:  # noqa: BLE001 - the demand read raises it, naming the shard
                    self._failed.add(shard)
                    continue
                if got is None:
                    break  # the cache is full of shards needed sooner
                if len(self._prefetched) >= PREFETCHED_KEPT:
                    self._prefetched.clear()
                self._prefetched[shard] = os.fspath(got[0])

    def wait(self, timeout_s: float) -> bool:
        """Wait until every shard of the last plan's horizon is cached or failed (tests,
        benches); False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                want = list(self._want)
            if all(s in self._failed or self._fetcher.cached_path(s) is not None for s in want):
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        """Stop the thread, if running (waits up to 10 s for the download in progress)."""
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            self._thread.join(timeout=10)
