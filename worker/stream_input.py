"""The training worker's side of a streaming dataset: per-step ranges by locality, predownload
and the figures its heartbeat publishes.

:class:`StreamInput` turns the generation's table (its ``shard_owners``) and a step's global
batch into this rank's ranges (:func:`shoal.worker.stream_order.assign_step`; every rank
computes the same split, so the slices partition the batch), tells the dataset which of this
rank's upcoming samples to download ahead (``dataset.plan``), and reads the dataset's counters
for the heartbeat. A table without owners (a coordinator that predates them) leaves every
shard unowned: the batch is then split evenly and every sample read remotely - slower, still
exact.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from shoal.events.models import ShardTable
from shoal.worker.data import DataOrder, NormalRanges, StepBatch
from shoal.worker.stream_order import (
    StepAssignment,
    assign_step,
    epoch_windows,
    owner_ranks,
    shard_of,
    shard_offsets,
    window_owners,
)

log = logging.getLogger("shoal.worker.stream")

#: Samples of this rank's upcoming steps handed to ``dataset.plan`` when the dataset does not
#: say (its ``predownload`` attribute).
DEFAULT_PREDOWNLOAD = 512
#: Steps looked ahead at most for the predownload plan.
MAX_PLAN_STEPS = 64
#: Assignments kept (by cursor) so a step's split is computed once per generation.
CACHE_STEPS = 2 * MAX_PLAN_STEPS


def is_streaming(dataset: Any) -> bool:
    """A dataset the streaming path serves: it lists its shards' sample counts and reads by owner."""
    return getattr(dataset, "shard_samples", None) is not None and callable(getattr(dataset, "read", None))


class StreamInput:
    """Per-step assignment, predownload plan and counters for one worker (see the module
    docstring). Call :meth:`use_table` when a generation starts; the other methods are cheap
    for a cursor already seen in that generation."""

    def __init__(self, dataset: Any, order: DataOrder, *, tolerance: int = 0) -> None:
        if order.shard_samples is None:
            raise ValueError("a streaming input needs the shard-aware data order")
        self.dataset = dataset
        self.order = order
        self.tolerance = tolerance
        self.offsets = shard_offsets(order.shard_samples)
        self.num_shards = len(order.shard_samples)
        self.predownload = int(getattr(dataset, "predownload", None) or DEFAULT_PREDOWNLOAD)
        self.generation = -1
        self.rank = 0
        self.world = 1
        self._owner = np.full(self.num_shards, -1, dtype=np.int64)
        #: this rank's shards in the current table
        self.owned: frozenset[int] = frozenset()
        #: epoch -> who reads each shard in it (the table's owners rebalanced per window)
        self._epoch_owner: dict[int, np.ndarray] = {}
        #: epoch -> the shards this rank reads whole in it (:meth:`reading`)
        self._reading: dict[int, frozenset[int]] = {}
        self._lock = threading.Lock()
        self._cache: dict[tuple[int, tuple[int, ...] | None], StepAssignment] = {}
        #: (cursor, active) -> this rank's ranges of that step (what the prefetcher asks twice a step)
        self._ranges: dict[tuple[int, tuple[int, ...] | None], NormalRanges] = {}
        #: cursor -> (the next step's cursor, the ids this rank reads from its own shards in the
        #: step, their shards): :meth:`plan_ahead`'s per-step part, computed once per generation
        self._ahead: dict[int, tuple[int, np.ndarray, frozenset[int]]] = {}
        #: the steps of the last plan's horizon: (cursor, next cursor, ids, shards) each
        self._horizon: list[tuple[int, int, np.ndarray, frozenset[int]]] = []
        #: the last trained step's balance error and this rank's remote samples in it
        self.balance_error = 0
        self.step_remote = 0
        #: what :meth:`figures` returned last (the progress history records it), and when
        self.last_figures: dict[str, Any] = {}
        self._figures_at = -float("inf")
        #: (generation, shards ahead) of the last plan handed to the dataset
        self._planned: tuple[int, frozenset[int]] | None = None

    def use_table(self, table: ShardTable, worker_id: str) -> None:
        """Take ``table``'s owners and this worker's rank in it (no-op for the same generation)."""
        if table.generation == self.generation:
            return
        me = table.member(worker_id)
        if me is None:
            return
        rank_of = {m.worker_id: m.rank for m in table.members}
        self._owner = owner_ranks(table.shard_owners, self.num_shards, rank_of)
        self.generation, self.rank, self.world = table.generation, me.rank, table.world_size
        self.owned = frozenset(np.flatnonzero(self._owner == me.rank).tolist())
        self._cache.clear()
        self._ranges.clear()
        self._ahead.clear()
        self._horizon = []
        self._reading.clear()
        with self._lock:
            self._epoch_owner.clear()
        if table.shard_owners is None:
            log.warning("generation %d's table names no shard owners: every sample is read remotely",
                        table.generation)

    def epoch_owner(self, epoch: int) -> np.ndarray:
        """Who reads each shard locally in ``epoch`` (:func:`window_owners`)."""
        with self._lock:  # also called by the prefetcher's result thread
            got = self._epoch_owner.get(epoch)
            if got is None:
                windows = epoch_windows(self.order.shard_samples, self.order.seed, epoch, self.order.window)
                got = window_owners(self.order.shard_samples, windows, self._owner, self.world)
                while len(self._epoch_owner) >= 3:
                    self._epoch_owner.pop(min(self._epoch_owner))
                self._epoch_owner[epoch] = got
            return got

    def reading(self, cursor: int) -> frozenset[int]:
        """The shards this rank reads whole (from its cache) in the epoch of ``cursor``
        (samples of the others it is given: ranged reads)."""
        epoch = cursor // self.order.num_samples
        got = self._reading.get(epoch)
        if got is None:
            got = frozenset(np.flatnonzero(self.epoch_owner(epoch) == self.rank).tolist())
            while len(self._reading) >= 3:
                self._reading.pop(min(self._reading))
            self._reading[epoch] = got
        return got

    def assignment(self, batch: StepBatch, active: Sequence[int] | None = None) -> StepAssignment:
        """The split of ``batch`` among the table's ranks (``active``: the ranks that take part)."""
        key = (batch.cursor, None if active is None else tuple(sorted(active)))
        got = self._cache.get(key)
        if got is None:
            got = assign_step(shard_of(batch.indices, self.offsets), self.epoch_owner(batch.epoch), self.world, active,
                              self.tolerance)
            if len(self._cache) >= CACHE_STEPS:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = got
        return got

    def ranges(self, batch: StepBatch, active: Sequence[int] | None = None) -> NormalRanges:
        """This rank's ranges of ``batch``."""
        key = (batch.cursor, None if active is None else tuple(sorted(active)))
        got = self._ranges.get(key)
        if got is None:
            got = NormalRanges(self.assignment(batch, active).ranges(self.rank))
            if len(self._ranges) >= CACHE_STEPS:
                self._ranges.pop(next(iter(self._ranges)))
            self._ranges[key] = got
        return got

    def note_step(self, batch: StepBatch, active: Sequence[int] | None = None) -> None:
        """Record the figures of the step about to train (balance error, remote samples)."""
        a = self.assignment(batch, active)
        self.balance_error = a.balance_error
        self.step_remote = a.remote_count(self.rank)

    def _step_ahead(self, cursor: int) -> tuple[int, np.ndarray, frozenset[int]]:
        """The step at ``cursor`` as the predownload plan sees it: (the next step's cursor, the
        ids this rank reads from the shards it reads whole in that epoch, their shards)."""
        got = self._ahead.get(cursor)
        if got is None:
            batch = self.order.batch(cursor)
            a = self.assignment(batch)
            mine = a.positions[self.rank]
            ids = batch.indices[mine[~a.remote[mine]]]  # the samples it reads from its own shards
            got = (batch.next_cursor, ids, frozenset(shard_of(ids, self.offsets).tolist()))
            if len(self._ahead) >= CACHE_STEPS:
                for old in [c for c in self._ahead if c < cursor] or [next(iter(self._ahead))]:
                    del self._ahead[old]
            self._ahead[cursor] = got
        return got

    def plan_ahead(self, cursor: int, end: int | None) -> None:
        """Hand this rank's next samples (about ``predownload`` of them, from ``cursor`` on, in
        order) to ``dataset.plan`` with its owned shards: it downloads their owned shards in the
        background and evicts what is needed last. Never raises for the dataset's sake: a
        failing plan is logged, the reads themselves then fail or succeed as they will.

        Called every step: each step's part is computed once (:meth:`_step_ahead`), and the
        dataset re-ranks its cache and wakes its downloader only when the set of shards ahead
        changed (their order of need moves a little each step; the next change re-ranks)."""
        plan = getattr(self.dataset, "plan", None)
        if plan is None or self.generation < 0:
            return
        # the last call's steps from ``cursor`` on (the committed cursor moves a step at a
        # time), then more until the horizon holds ``predownload`` samples
        h = self._horizon
        at = next((k for k, step in enumerate(h) if step[0] == cursor), None)
        h = [step for step in h[at:] if end is None or step[0] < end] if at is not None else []
        count = sum(len(step[2]) for step in h)
        c = h[-1][1] if h else cursor
        while len(h) < MAX_PLAN_STEPS and count < self.predownload and (end is None or c < end):
            nxt, ids, of_step = self._step_ahead(c)
            h.append((c, nxt, ids, of_step))
            count += len(ids)
            c = nxt
        self._horizon = h
        shards = frozenset().union(*(step[3] for step in h))
        epochs = {step[0] // self.order.num_samples for step in h}
        steps = [step[2] for step in h]
        ahead = (self.generation, shards)
        if ahead == self._planned:
            return
        self._planned = ahead
        owned: set[int] = set()
        for epoch in epochs:
            owned |= self.reading(epoch * self.order.num_samples)
        ids = np.concatenate(steps) if steps else np.zeros(0, dtype=np.int64)
        try:
            plan(ids, owned)
        except Exception as exc:  # noqa: BLE001 - the reads report a real failure with its shard
            log.warning("predownload plan failed (%s: %s)", type(exc).__name__, exc)

    def figures(self, max_age: float = 0.0) -> dict[str, Any]:
        """Heartbeat fields: bytes downloaded, cache hit rate, shards owned, remote reads,
        balance error (the dataset's counters where it has them). The counters are read again
        only when the last reading is older than ``max_age`` seconds."""
        now = time.monotonic()
        if self.last_figures and now - self._figures_at < max_age:
            return {**self.last_figures, "shards_owned": len(self.owned), "balance_error": int(self.balance_error)}
        self._figures_at = now
        stats: dict[str, Any] = {}
        try:
            stats = dict(self.dataset.stats()) if callable(getattr(self.dataset, "stats", None)) else {}
        except Exception as exc:  # noqa: BLE001 - figures only
            log.debug("dataset stats failed: %s", exc)
        hits, misses = int(stats.get("cache_hits", 0) or 0), int(stats.get("cache_misses", 0) or 0)
        out: dict[str, Any] = {"shards_owned": len(self.owned), "balance_error": int(self.balance_error)}
        if "bytes_downloaded" in stats:
            out["bytes_downloaded"] = int(stats["bytes_downloaded"]) + int(stats.get("remote_bytes", 0) or 0)
        if hits + misses:
            out["cache_hit_rate"] = round(hits / (hits + misses), 4)
        if "remote_reads" in stats:
            out["remote_reads"] = int(stats["remote_reads"])
        self.last_figures = out
        return out
