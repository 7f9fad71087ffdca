"""Streaming datasets: a shard-aware sample order and the per-step assignment by locality.

A streaming dataset (:class:`shoal.storage.streaming.StreamingDataset`, anything with a
``shard_samples`` list) stores its samples in shards: global sample id ``i`` is the i-th
sample in index order, so shard ``s`` holds the ids ``offsets[s] .. offsets[s+1]-1``.

The order (:func:`shard_aware_permutation`)
    Per epoch: shuffle the shards with a ``(seed, epoch)`` RNG, cut the shuffled list into
    windows of ``window`` shards and shuffle the samples inside each window. The result is a
    permutation of ``0..n-1``, a pure function of its arguments - never of the world size - so
    the global cursor, the commit-only advance and the exactly-once rules of
    :mod:`shoal.worker.data` apply unchanged, a step redone by another world size consumes the
    same global batch, and after a full restart the cursor alone says which shard and which
    position come next. Consecutive global batches draw from the ``window`` shards of one
    window (two at a window's edge): a worker needs only a few shards at a time.

Who reads a shard (:func:`window_owners`)
    The table's owners (sticky across generations, :mod:`shoal.coordinator.owners`) are
    rebalanced inside each window of the epoch by moving whole shards, so that each rank's
    share of every window is even; a shard is in one window per epoch, so in a cold cache
    this costs no download at all. With the stratified shuffle, each rank's share of every
    batch then follows its share of the window: few samples are left to move.

The assignment (:func:`assign_step`)
    Every rank computes, from the step's global batch, each sample's shard and these owners,
    the same split of the batch's *positions* among
    the ranks: a rank takes the samples of the shards it owns (read from its cache), then the
    counts are balanced to within a tolerance by moving samples of the fullest rank to the
    emptiest one, which reads them remotely (ranged reads) - unless it read their shard whole
    in the epoch before: samples of such shards move first (the highest position among them,
    else the highest), and the receiver reads them from its cache while it still holds them.
    Samples of shards nobody in the step owns (an owner that left, a member still catching up)
    go to the emptiest ranks. The split is returned as ordinary shard-table ranges
    (``[start, stop, 1]`` runs of positions), so the slices of all ranks partition the batch
    exactly (:func:`shoal.worker.data.validate_table`) and everything downstream (the engine,
    the prefetcher's keys, the ledger) is unchanged.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: Shards per shuffle window when the dataset does not say (``shuffle_window`` attribute).
DEFAULT_WINDOW = 16


def _rng(seed: int, epoch: int, what: str) -> np.random.Generator:
    digest = hashlib.sha256(f"shoal-stream:{what}:{seed}:{epoch}".encode()).digest()
    entropy = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def shard_offsets(shard_samples: Sequence[int]) -> np.ndarray:
    """``offsets[s]``: the first global id of shard ``s``; ``offsets[-1]`` the total (int64)."""
    counts = np.asarray(shard_samples, dtype=np.int64)
    if counts.ndim != 1 or (counts < 0).any():
        raise ValueError("shard_samples must be a list of non-negative sample counts")
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def epoch_windows(shard_samples: Sequence[int], seed: int, epoch: int, window: int) -> list[np.ndarray]:
    """The shards of each shuffle window of ``epoch``, in order (shard numbers, int64)."""
    if window < 1:
        raise ValueError(f"shuffle window must be at least 1 shard, got {window}")
    if epoch < 0:
        raise ValueError(f"epoch must be non-negative, got {epoch}")
    shards = _rng(seed, epoch, "shards").permutation(len(shard_samples)).astype(np.int64)
    return [shards[w : w + window] for w in range(0, len(shards), window)]


def shard_aware_permutation(shard_samples: Sequence[int], seed: int, epoch: int, window: int) -> np.ndarray:
    """The sample order of ``epoch``: a permutation of ``0..sum(shard_samples)-1`` (int64).

    Shards are shuffled and cut into consecutive windows of ``window`` shards
    (:func:`epoch_windows`); inside a window, each shard's samples are shuffled and the shards
    are interleaved in rounds - round ``j`` takes the ``j``-th sample of every shard that has
    one, always in the window's one random cycle of its shards - so any run of consecutive
    samples draws from every shard of the window in proportion, and a run of as many samples
    as the window has shards (while they all have samples left) holds one of each: a
    stratified shuffle. A rank's share of a batch then follows its share of the window's
    shards with no sampling noise to even out by remote reads (a fresh shard order in every
    round would leave each batch's partial rounds at its two ends uneven). A pure function of
    its arguments (numpy PCG64 seeded from ``(seed, epoch)``). ValueError on an empty dataset,
    a negative epoch or window < 1."""
    offsets = shard_offsets(shard_samples)
    total = int(offsets[-1])
    if total <= 0:
        raise ValueError("a streaming dataset with no samples")
    windows = epoch_windows(shard_samples, seed, epoch, window)
    rng = _rng(seed, epoch, "samples")
    out = np.empty(total, dtype=np.int64)
    at = 0
    for shards in windows:
        cycle = rng.permutation(len(shards))  # the shards' places in every round
        ids, rounds, places = [], [], []
        for place, sh in zip(cycle.tolist(), shards.tolist()):
            count = int(offsets[sh + 1] - offsets[sh])
            ids.append(offsets[sh] + rng.permutation(count))
            rounds.append(np.arange(count))
            places.append(np.full(count, place))
        if not ids:
            continue
        ids_a, rounds_a, places_a = np.concatenate(ids), np.concatenate(rounds), np.concatenate(places)
        ordered = ids_a[np.lexsort((places_a, rounds_a))]
        out[at : at + len(ordered)] = ordered
        at += len(ordered)
    return out


def window_owners(shard_samples: Sequence[int], windows: Sequence[np.ndarray], owner: np.ndarray,
                  world: int) -> np.ndarray:
    """Who reads each shard locally in one epoch: the table's ``owner`` (``owner[s]``: a rank,
    -1: nobody), rebalanced inside each window so that every rank's share of the window's
    samples is as even as whole shards allow. Shards without an owner go, largest first, to
    the least-loaded rank; then a shard of the most-loaded rank moves to the least-loaded one
    while that narrows the gap. Each shard is in exactly one window per epoch, so it is still
    downloaded once; only shards that must move do. A pure function."""
    counts = np.asarray(shard_samples, dtype=np.int64)
    eff = np.where((owner >= 0) & (owner < world), owner, -1).astype(np.int64)
    ranks = list(range(world))
    for win in windows:
        loads = dict.fromkeys(ranks, 0)
        pool = []
        for sh in win.tolist():
            if eff[sh] >= 0:
                loads[int(eff[sh])] += int(counts[sh])
            else:
                pool.append(sh)
        for sh in sorted(pool, key=lambda x: (-int(counts[x]), x)):
            r = min(ranks, key=lambda a: (loads[a], a))
            eff[sh] = r
            loads[r] += int(counts[sh])
        while True:
            hi = max(ranks, key=lambda a: (loads[a], -a))
            lo = min(ranks, key=lambda a: (loads[a], a))
            gap = loads[hi] - loads[lo]
            mine = [sh for sh in win.tolist() if eff[sh] == hi and 0 < counts[sh] < gap]
            if not mine:
                break
            sh = min(mine, key=lambda x: (abs(gap - 2 * int(counts[x])), -x))
            eff[sh] = lo
            loads[hi] -= int(counts[sh])
            loads[lo] += int(counts[sh])
    return eff


def shard_of(ids: np.ndarray | Sequence[int], offsets: np.ndarray) -> np.ndarray:
    """The shard of each global id (vectorised; ``offsets`` from :func:`shard_offsets`)."""
    return np.searchsorted(offsets, np.asarray(ids, dtype=np.int64), side="right") - 1


def owner_ranks(shard_owners: Mapping[str, Sequence[Sequence[int]]] | None, num_shards: int,
                rank_of: Mapping[str, int]) -> np.ndarray:
    """``owner[s]``: the rank owning shard ``s`` (-1: nobody in ``rank_of``). ``shard_owners``
    is a table's field: worker id -> ``[start, stop]`` half-open ranges of shard numbers."""
    owner = np.full(num_shards, -1, dtype=np.int64)
    for wid, ranges in (shard_owners or {}).items():
        rank = rank_of.get(wid)
        if rank is None:
            continue
        for start, stop in ranges:
            owner[max(0, int(start)) : min(num_shards, int(stop))] = rank
    return owner


@dataclass(frozen=True)
class StepAssignment:
    """One step's split. ``positions[r]``: rank ``r``'s positions of the global batch
    (ascending); ``remote[p]``: position ``p`` is read by a rank that does not own its shard."""

    positions: tuple[np.ndarray, ...]
    remote: np.ndarray

    def ranges(self, rank: int) -> tuple[tuple[int, int, int], ...]:
        """Rank ``rank``'s positions as shard-table ranges: ``(start, stop, 1)`` runs."""
        return positions_to_ranges(self.positions[rank])

    @property
    def balance_error(self) -> int:
        """Largest minus smallest sample count over the ranks that take part."""
        counts = [len(p) for p in self.positions]
        return max(counts) - min(counts) if counts else 0

    def remote_count(self, rank: int | None = None) -> int:
        """Samples read remotely in this step (by ``rank``, or by every rank)."""
        if rank is None:
            return int(self.remote.sum())
        return int(self.remote[self.positions[rank]].sum())


def positions_to_ranges(positions: np.ndarray | Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """Ascending positions as the shortest list of ``(start, stop, 1)`` runs."""
    out: list[tuple[int, int, int]] = []
    start = prev = None
    # a batch's few dozen: plain ints beat numpy calls
    for p in positions.tolist() if isinstance(positions, np.ndarray) else positions:
        if prev is None or p != prev + 1:
            if start is not None:
                out.append((start, prev + 1, 1))
            start = p
        prev = p
    if start is not None:
        out.append((start, prev + 1, 1))
    return tuple(out)


def split_by_owner(readers: Sequence[int], world: int, active: Sequence[int] | None = None,
                   tolerance: int = 0) -> list[list[int]] | None:
    """:func:`assign_step`'s common case in plain ints: ``readers[p]``, the rank reading
    position ``p``'s shard. When every reader takes part (is in ``active``, default all)
    and no rank's count exceeds another's by more than ``tolerance + 1``, each rank's
    positions (ascending): nothing moves, nothing is read remotely. Otherwise None (the
    counts need balancing, or some samples have no reader taking part)."""
    ranks = range(world) if active is None else sorted(set(active))
    if not ranks:
        return None
    if readers and (min(readers) < 0 or max(readers) >= world
                    or (active is not None and not set(ranks).issuperset(readers))):
        return None
    parts = [[p for p, x in enumerate(readers) if x == r] for r in range(world)]  # comprehensions: the fastest plain loop
    counts = [len(parts[r]) for r in ranks]
    if max(counts) - min(counts) > tolerance + 1:
        return None
    return parts


def assign_step(shards: np.ndarray, owner: np.ndarray, world: int, active: Sequence[int] | None = None,
                tolerance: int = 0, held: np.ndarray | None = None) -> StepAssignment:
    """Split a global batch among ``world`` ranks by locality (see the module docstring).

    ``shards[p]``: the shard of the sample at position ``p``; ``owner[s]``: the rank owning
    shard ``s`` (-1: nobody); ``active``: the ranks that take samples (default all; the others
    - members receiving state in a generation's first step - get none). After the split, no
    active rank holds more than ``tolerance + 1`` samples more than another. A pure function:
    every rank computes the same split."""
    active = list(range(world)) if active is None else sorted(set(active))
    shards = np.asarray(shards, dtype=np.int64)
    n = len(shards)
    if not active:
        raise ValueError("no rank takes part in the step")
    owned_by = owner[shards] if n else np.empty(0, dtype=np.int64)
    parts = split_by_owner(owned_by.tolist(), world, active, tolerance)
    if parts is not None:  # the common case: every sample's owner takes part and the counts are even
        return StepAssignment(positions=tuple(np.asarray(p, dtype=np.int64) for p in parts),
                              remote=np.zeros(n, dtype=bool))
    take = np.full(n, -1, dtype=np.int64)
    is_active = np.zeros(world, dtype=bool)
    is_active[active] = True
    mine = (owned_by >= 0) & is_active[np.clip(owned_by, 0, world - 1)]
    take[mine] = owned_by[mine]
    return _balanced(take, owned_by, world, active, tolerance, None if held is None or not n else held[shards])


def _balanced(take: np.ndarray, owned_by: np.ndarray, world: int, active: list[int], tolerance: int,
              held_by: np.ndarray | None = None) -> StepAssignment:
    """The split of :func:`assign_step` from ``take`` (each position's owner when active,
    else -1): unowned positions go to the emptiest ranks, then samples move until the counts
    are within ``tolerance + 1``; ``held_by[p]``: the rank holding position ``p``'s shard
    besides its owner (-1: none)."""
    n = len(take)
    # per rank, ascending: the positions of its own shards, and the others it was given
    own: dict[int, list[int]] = {r: np.flatnonzero(take == r).tolist() for r in active}
    given: dict[int, list[int]] = {r: [] for r in active}
    holder = held_by.tolist() if held_by is not None else None

    def count(a: int) -> int:
        return len(own[a]) + len(given[a])

    def pick(ps: list[int], to: int) -> int:
        """The highest of ``ps`` whose shard ``to`` holds, else the highest (removed)."""
        if holder is not None:
            for k in range(len(ps) - 1, -1, -1):
                if holder[ps[k]] == to:
                    return ps.pop(k)
        return ps.pop()

    # samples nobody active owns: to the emptiest rank, position by position
    for p in np.flatnonzero(take < 0).tolist():
        given[min(active, key=lambda a: (count(a), a))].append(p)
    # balance: a sample of the fullest rank to the emptiest, until within tolerance; one the
    # fullest reads remotely anyway moves first (no extra remote read), then one whose shard
    # the emptiest holds (read from its cache), else the highest position
    while True:
        hi = max(active, key=lambda a: (count(a), -a))
        lo = min(active, key=lambda a: (count(a), a))
        if count(hi) - count(lo) <= tolerance + 1:
            break
        p = pick(given[hi], lo) if given[hi] else pick(own[hi], lo)
        bisect.insort(own[lo] if owned_by[p] == lo else given[lo], p)
    buckets = {r: own[r] + given[r] for r in active}
    positions = tuple(np.sort(np.asarray(buckets.get(r, []), dtype=np.int64)) for r in range(world))
    remote = np.zeros(n, dtype=bool)
    for r in range(world):
        remote[positions[r]] = owned_by[positions[r]] != r
    return StepAssignment(positions=positions, remote=remote)
