"""Exactly-once data order: epoch permutations, a global cursor, and shard-table slices.

Every worker derives the same global batch of a step from three numbers it shares with all
others - the job ``seed``, the dataset size ``num_samples`` and the global ``cursor`` - and
takes its own part with the ranges the coordinator's shard table gives its rank. Nothing about
the data order depends on the world size, so a step redone in a later generation with a
different world size consumes exactly the same samples.

The cursor
    One integer: the number of samples consumed since the start of training, over all epochs.
    ``epoch = cursor // num_samples``, ``offset = cursor % num_samples``. A step's global batch is
    ``permutation(num_samples, seed, epoch)[offset : min(offset + global_batch, num_samples)]``
    and the cursor advances by that batch's length **only when the step commits** (the
    optimizer stepped). An aborted step leaves the cursor alone, so its samples are redone, not
    skipped; a committed step is never redone, so no sample is seen twice in an epoch.

The last batch of an epoch
    When ``global_batch`` does not divide ``num_samples``, the last batch of an epoch is
    *short* (``num_samples % global_batch`` samples): nothing is dropped, nothing wraps into the
    next epoch. The engine divides by the actual count (:attr:`StepBatch.count`), so the loss
    and gradient of a short batch are still means. An epoch has
    ``ceil(num_samples / global_batch)`` steps.

Shard tables
    A rank's part of the global batch is a list of ``[start, stop, step]`` triples over
    *positions* ``0 .. global_batch-1`` of the batch (Python slice semantics). The ranges of all
    ranks must partition the positions (:func:`validate_table`). Contiguous (the default):
    rank ``r`` of ``W`` gets ``[[r*B//W, (r+1)*B//W, 1]]``; round-robin: ``[[r, B, W]]``. For a
    short batch the same ranges apply to the positions that exist, so some ranks may get fewer
    samples, or none (as do ranks beyond the batch size: a range with ``start >= stop`` is empty) (they still take part in the all-reduce, with zero gradients).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shoal.worker.stream_order import DEFAULT_WINDOW, shard_aware_permutation

Range = Sequence[int]

#: epochs whose permutation :class:`DataOrder` keeps
PERMS_KEPT = 3
#: global batches :class:`DataOrder` keeps by cursor (a step's batch is asked for by the
#: training thread, the prefetcher's plan and the streaming split, each step again; the
#: streaming plan looks ~20 steps ahead)
BATCHES_KEPT = 64


def _epoch_seed(seed: int, epoch: int) -> list[int]:
    # SeedSequence entropy must be non-negative: hash so any int seed (even negative) works.
    digest = hashlib.sha256(f"shoal-data:{seed}:{epoch}".encode()).digest()
    return [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]


def permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of ``epoch``: a permutation of ``0..num_samples-1`` (int64 array).

    A pure function of its arguments (numpy PCG64 seeded from ``(seed, epoch)``): identical on
    every worker, independent of the world size. It may change across numpy major versions,
    so every worker of a job must run the same numpy.
    """
    if num_samples <= 0:
        raise ValueError(f"num_samples must be positive, got {num_samples}")
    if epoch < 0:
        raise ValueError(f"epoch must be non-negative, got {epoch}")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(_epoch_seed(seed, epoch))))
    return rng.permutation(num_samples).astype(np.int64)


def locate(cursor: int, num_samples: int) -> tuple[int, int]:
    """``(epoch, offset)`` of a global cursor."""
    if cursor < 0:
        raise ValueError(f"cursor must be non-negative, got {cursor}")
    return divmod(cursor, num_samples)


def batch_indices(perm: np.ndarray, cursor: int, global_batch: int) -> np.ndarray:
    """The global batch at ``cursor``: ``perm[offset : min(offset + global_batch, len(perm))]``.

    ``perm`` must be the permutation of epoch ``cursor // len(perm)``; ``offset`` is
    ``cursor % len(perm)``. The result is short at the end of an epoch, never empty.
    """
    if global_batch <= 0:
        raise ValueError(f"global_batch must be positive, got {global_batch}")
    n = len(perm)
    _, offset = locate(cursor, n)
    return perm[offset : min(offset + global_batch, n)]


class NormalRanges(tuple):
    """Ranges already in :func:`shoal.worker.prefetch.normalize_ranges`' form (a tuple of
    ``(start, stop, step)`` int triples): what a streaming dataset's per-step assignment
    returns, so that planning the same step again does not convert them again. Equal to (and
    hashes as) the plain tuple."""

    __slots__ = ()


def rank_slice(batch: np.ndarray | Sequence[int], ranges: Sequence[Range]) -> np.ndarray:
    """This rank's samples of ``batch``: the concatenation of ``batch[start:stop:step]`` for
    each ``[start, stop, step]`` in ``ranges`` (positions beyond a short batch are absent)."""
    arr = np.asarray(batch, dtype=np.int64)
    if len(ranges) == 1 and len(ranges[0]) == 3 and int(ranges[0][2]) == 1 and int(ranges[0][0]) >= 0 \
            and int(ranges[0][1]) >= 0:  # one contiguous block (the contiguous strategy): a slice
        return arr[int(ranges[0][0]) : int(ranges[0][1])].copy()
    positions: list[int] = []
    for r in ranges:
        if len(r) != 3:
            raise ValueError(f"a shard range is [start, stop, step], got {list(r)!r}")
        start, stop, step = int(r[0]), int(r[1]), int(r[2])
        if start < 0 or stop < 0 or step <= 0:
            raise ValueError(f"invalid shard range {list(r)!r}: need start, stop >= 0 and step > 0")
        positions += range(start, min(stop, len(arr)), step)
    # one gather, whatever the number of ranges (a streaming dataset's split has a dozen or
    # more a step: a slice and a concatenation each cost more than the positions in a list)
    return arr[positions] if positions else np.empty(0, dtype=np.int64)


def contiguous_table(global_batch: int, world_size: int) -> list[list[list[int]]]:
    """Ranges of every rank for the contiguous strategy: near-equal consecutive blocks."""
    _check_world(global_batch, world_size)
    return [
        [[r * global_batch // world_size, (r + 1) * global_batch // world_size, 1]]
        for r in range(world_size)
    ]


def round_robin_table(global_batch: int, world_size: int) -> list[list[list[int]]]:
    """Ranges of every rank for the round-robin strategy: rank ``r`` takes positions ``r, r+W, ...``."""
    _check_world(global_batch, world_size)
    return [[[r, global_batch, world_size]] for r in range(world_size)]


def _check_world(global_batch: int, world_size: int) -> None:
    if global_batch <= 0 or world_size <= 0:
        raise ValueError(f"need global_batch > 0 and world_size > 0, got {global_batch}, {world_size}")


def validate_table(table: Sequence[Sequence[Range]], global_batch: int) -> None:
    """Raise ValueError unless the ranges of all ranks cover each position ``0..global_batch-1``
    exactly once (the exactly-once condition within a step)."""
    seen = np.zeros(global_batch, dtype=np.int64)
    positions = np.arange(global_batch)
    for rank, ranges in enumerate(table):
        for r in ranges:
            if len(r) != 3 or int(r[2]) <= 0 or int(r[0]) < 0 or int(r[1]) < 0:
                raise ValueError(f"rank {rank}: invalid shard range {list(r)!r}")
            if int(r[1]) > global_batch:
                raise ValueError(f"rank {rank}: range {list(r)!r} beyond global batch {global_batch}")
            np.add.at(seen, positions[int(r[0]) : int(r[1]) : int(r[2])], 1)
    if (seen > 1).any():
        raise ValueError(f"positions assigned twice: {np.flatnonzero(seen > 1)[:10].tolist()}")
    if (seen == 0).any():
        raise ValueError(f"positions assigned to no rank: {np.flatnonzero(seen == 0)[:10].tolist()}")


@dataclass(frozen=True)
class StepBatch:
    """The global batch of one step, as every rank computes it from the cursor."""

    cursor: int
    epoch: int
    offset: int
    num_samples: int
    indices: np.ndarray  # dataset indices of the whole global batch, in position order

    @property
    def count(self) -> int:
        """Samples in the global batch (short at the end of an epoch): the loss divisor."""
        return len(self.indices)

    @property
    def next_cursor(self) -> int:
        """The cursor after this step commits."""
        return self.cursor + self.count

    @property
    def last_of_epoch(self) -> bool:
        """True when committing this step completes the epoch."""
        return self.offset + self.count >= self.num_samples

    def for_rank(self, ranges: Sequence[Range]) -> np.ndarray:
        """Dataset indices of this rank's part of the batch (see :func:`rank_slice`)."""
        return rank_slice(self.indices, ranges)


def micro_batches(local: np.ndarray | Sequence[int], micro_batch: int | None) -> list[np.ndarray]:
    """How the engine splits a rank's slice into forward/backward passes: consecutive chunks
    of ``micro_batch`` samples (the last one shorter), the whole slice when ``micro_batch`` is
    None, nothing for an empty slice. The prefetcher plans its items with this split, so it
    must stay the engine's (``StepEngine._forward_backward``; a test checks they agree)."""
    arr = np.asarray(local, dtype=np.int64)
    mb = micro_batch or max(1, len(arr))
    return [arr[start : start + mb] for start in range(0, len(arr), mb)]


class DataOrder:
    """Caches the permutation of the current epoch; :meth:`batch` gives a step's global batch.

    ``num_samples`` is the dataset length, ``seed`` the job seed, ``global_batch`` the
    configured global batch size (the last batch of an epoch is shorter). ``shard_samples``
    (a streaming dataset's samples per shard; they must add up to ``num_samples``) selects
    the shard-aware order with ``window`` shards per shuffle window
    (:func:`shoal.worker.stream_order.shard_aware_permutation`); without it the plain
    :func:`permutation`.
    """

    def __init__(self, num_samples: int, seed: int, global_batch: int, *,
                 shard_samples: Sequence[int] | None = None, window: int = DEFAULT_WINDOW) -> None:
        if num_samples <= 0 or global_batch <= 0:
            raise ValueError(f"need num_samples > 0 and global_batch > 0, got {num_samples}, {global_batch}")
        if shard_samples is not None and sum(int(c) for c in shard_samples) != num_samples:
            raise ValueError(f"shard sample counts add up to {sum(int(c) for c in shard_samples)}, "
                             f"not the dataset's {num_samples} samples")
        self.shard_samples = None if shard_samples is None else [int(c) for c in shard_samples]
        self.window = window
        self.num_samples = num_samples
        self.seed = seed
        self.global_batch = global_batch
        #: epoch -> its permutation, the last :data:`PERMS_KEPT` used (a look-ahead that
        #: crosses an epoch's end alternates between two epochs: both stay cached)
        self._perms: dict[int, np.ndarray] = {}
        self._batches: dict[int, StepBatch] = {}
        self._lock = threading.Lock()

    def steps_per_epoch(self) -> int:
        return -(-self.num_samples // self.global_batch)

    def cursor_after(self, steps: int) -> int:
        """The cursor once ``steps`` steps committed from the start (each epoch's last batch
        is short: the next epoch starts at a multiple of ``num_samples``)."""
        epochs, within = divmod(steps, self.steps_per_epoch())
        return epochs * self.num_samples + within * self.global_batch

    def perm(self, epoch: int) -> np.ndarray:
        with self._lock:  # the prefetcher's threads ask too
            got = self._perms.pop(epoch, None)
            if got is None:
                if self.shard_samples is None:
                    got = permutation(self.num_samples, self.seed, epoch)
                else:
                    got = shard_aware_permutation(self.shard_samples, self.seed, epoch, self.window)
                got.flags.writeable = False  # its batches are views of it, shared by every caller
                while len(self._perms) >= PERMS_KEPT:
                    self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = got  # most recently used last
            return got

    def batch(self, cursor: int) -> StepBatch:
        """The global batch at ``cursor`` (which must be a committed cursor: 0 or a previous
        batch's ``next_cursor``). The same object for a cursor asked for again soon: its
        ``indices`` are a view of the epoch's permutation, never to be written."""
        got = self._batches.get(cursor)
        if got is not None:
            return got
        epoch, offset = locate(cursor, self.num_samples)
        idx = batch_indices(self.perm(epoch), cursor, self.global_batch)
        got = StepBatch(cursor=cursor, epoch=epoch, offset=offset, num_samples=self.num_samples, indices=idx)
        with self._lock:
            while len(self._batches) >= BATCHES_KEPT:
                self._batches.pop(next(iter(self._batches)))
            self._batches[cursor] = got
        return got
