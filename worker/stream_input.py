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
from dataclasses import dataclass
from typing import Any

import numpy as np

from shoal.events.models import ShardTable
from shoal.worker.data import DataOrder, NormalRanges, StepBatch
from shoal.worker.stream_order import (
    assign_step,
    epoch_windows,
    owner_ranks,
    positions_to_ranges,
    shard_of,
    shard_offsets,
    split_by_owner,
    window_owners,
)

log = logging.getLogger("shoal.worker.stream")

#: Samples of this rank's upcoming steps handed to ``dataset.plan`` when the dataset does not
#: say (its ``predownload`` attribute).
DEFAULT_PREDOWNLOAD = 512
#: Steps looked ahead at most for the predownload plan.
MAX_PLAN_STEPS = 64
#: Steps' splits kept (by cursor) so a step's split is computed once per generation.
CACHE_STEPS = 2 * MAX_PLAN_STEPS
#: Steps split at once when the plan meets one not split yet (:meth:`StreamInput._step_ahead`)
AHEAD_CHUNK = 8
#: Epochs whose per-position shards and readers are kept: 8 bytes a sample each (a plan that
#: crosses an epoch's end looks at two; DataOrder keeps 3 permutations of 8 bytes a sample)
EPOCHS_KEPT = 2


@dataclass(frozen=True, slots=True)
class StepSplit:
    """What one rank needs of one step's split (:func:`~shoal.worker.stream_order.assign_step`):
    its ranges, the step's balance error, its remote samples, the next step's cursor, and the
    ids it reads from the shards it reads whole (with those shards: the predownload plan)."""

    ranges: NormalRanges
    balance_error: int
    remote: int
    next_cursor: int
    ids: np.ndarray
    shards: frozenset[int]


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
        #: (cursor, active) -> this rank's part of that step's split, computed once per
        #: generation (the prefetcher asks for a step's ranges twice a step, the plan once)
        self._steps: dict[tuple[int, tuple[int, ...] | None], StepSplit] = {}
        #: epoch -> the shard of each position of its order (any generation)
        self._shard_seq: dict[int, np.ndarray] = {}
        #: epoch -> who reads each position's shard in it (this generation): a step's split
        #: starts from a slice of it, not from locating the batch's ids again
        self._reader_seq: dict[int, np.ndarray] = {}
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
        self._steps.clear()
        self._reader_seq.clear()
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

    def _shards_of_epoch(self, epoch: int) -> np.ndarray:
        """The shard of each position of ``epoch``'s order (int32)."""
        got = self._shard_seq.get(epoch)
        if got is None:
            got = shard_of(self.order.perm(epoch), self.offsets).astype(np.int32)
            while len(self._shard_seq) >= EPOCHS_KEPT:
                self._shard_seq.pop(min(self._shard_seq))
            self._shard_seq[epoch] = got
        return got

    def _readers_of_epoch(self, epoch: int) -> np.ndarray:
        """Who reads each position's shard in ``epoch`` (:meth:`epoch_owner` by position, int32)."""
        got = self._reader_seq.get(epoch)
        if got is None:
            got = self.epoch_owner(epoch).astype(np.int32)[self._shards_of_epoch(epoch)]
            while len(self._reader_seq) >= EPOCHS_KEPT:
                self._reader_seq.pop(min(self._reader_seq))
            self._reader_seq[epoch] = got
        return got

    def split(self, batch: StepBatch, active: Sequence[int] | None = None) -> StepSplit:
        """This rank's part of the split of ``batch`` among the table's ranks (``active``: the
        ranks that take part; default all). The common case - every reader takes part and
        the counts are even - is read off the epoch's readers by position
        (:func:`~shoal.worker.stream_order.split_by_owner`, plain ints: a step's few dozen
        positions cost less than numpy's calls); otherwise :func:`assign_step` balances."""
        key = (batch.cursor, None if active is None else tuple(sorted(active)))
        got = self._steps.get(key)
        if got is None:
            got = self._split(batch, active)
            if len(self._steps) >= CACHE_STEPS:
                self._steps.pop(next(iter(self._steps)))
            self._steps[key] = got
        return got

    def _split(self, batch: StepBatch, active: Sequence[int] | None) -> StepSplit:
        lo, hi = batch.offset, batch.offset + batch.count
        shards = self._shards_of_epoch(batch.epoch)[lo:hi].tolist()
        parts = split_by_owner(self._readers_of_epoch(batch.epoch)[lo:hi].tolist(), self.world, active,
                               self.tolerance)
        if parts is not None:
            mine = local = parts[self.rank]
            error, remote = max(map(len, parts)) - min(map(len, parts)), 0
        else:
            # a sample that must move goes preferably to the rank that read its shard whole in
            # the epoch before (in its cache unless evicted since: no ranged read)
            held = self.epoch_owner(batch.epoch - 1) if batch.epoch > 0 else None
            a = assign_step(np.asarray(shards, dtype=np.int64), self.epoch_owner(batch.epoch), self.world, active,
                            self.tolerance, held)
            mine = a.positions[self.rank].tolist()
            local = [p for p in mine if not a.remote[p]]  # the samples it reads from its own shards
            error, remote = a.balance_error, a.remote_count(self.rank)
        return StepSplit(ranges=NormalRanges(positions_to_ranges(mine)), balance_error=error, remote=remote,
                         next_cursor=batch.next_cursor, ids=batch.indices[local],
                         shards=frozenset(map(shards.__getitem__, local)))

    def ranges(self, batch: StepBatch, active: Sequence[int] | None = None) -> NormalRanges:
        """This rank's ranges of ``batch``."""
        return self.split(batch, active).ranges

    def note_step(self, batch: StepBatch, active: Sequence[int] | None = None) -> None:
        """Record the figures of the step about to train (balance error, remote samples)."""
        got = self.split(batch, active)
        self.balance_error = got.balance_error
        self.step_remote = got.remote

    def _step_ahead(self, cursor: int) -> StepSplit:
        """The step at ``cursor`` as the predownload plan sees it (every rank taking part).
        A step not split yet is split with the :data:`AHEAD_CHUNK` - 1 steps after it: the plan
        needs one new step per step, and a run of them costs less than as many single ones
        (the code and the epoch's arrays are then in the CPU's caches, not evicted by a
        training step in between)."""
        got = self._steps.get((cursor, None))
        if got is None:
            got = step = self.split(self.order.batch(cursor))
            for _ in range(AHEAD_CHUNK - 1):
                step = self.split(self.order.batch(step.next_cursor))
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
            step = self._step_ahead(c)
            h.append((c, step.next_cursor, step.ids, step.shards))
            count += len(step.ids)
            c = step.next_cursor
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
