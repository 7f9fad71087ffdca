"""Slices sized by speed (``batch_split: by_speed``): pure functions of the facts, no clock
of their own (they count committed steps, passed in), each decision with a reason for people.

The facts
    Each worker's heartbeat carries two counters since its process started: the samples it
    trained in committed steps (its slices', or the chunks it took when the steps are evened
    out within them: ``shoal.worker.steal``) and the seconds of those steps' own work (data,
    forward, backward: not the wait for peers) - ``Heartbeat.work_samples`` and
    ``work_seconds``. :func:`observe` turns two looks at them into the worker's rate over
    the steps in between (every step counts, however rarely the coordinator samples), once
    they hold at least :data:`WINDOW_STEPS` of its steps (one step's own work swings with the
    machine's other load: a window of a few steps is what a split can follow), and smooths
    it (:data:`SMOOTHING`). Nothing else travels: worker -> heartbeat -> coordinator
    -> shard table -> worker.

The split (:func:`sizes_for`)
    A global batch of ``n`` positions goes out in contiguous blocks, rank by rank, each
    block's size in proportion to its member's rate (largest remainders; ties to the lower
    rank), bounded: no member's rate counts for less than 1/:data:`MAX_SKEW` of the fastest
    one's (a member that looked stopped in one window is not starved; a stuck one is the step
    timeout's business), every member gets a sample while ``n`` allows, and a member with no
    rate yet (a joiner) counts with the median of the others'. The global batch never changes:
    shoal sums the losses and divides by the global count, so the update is the same as with
    equal slices, up to the order of float additions.

When (:func:`look`)
    At every generation the coordinator plans anyway (a join, a failure, a leave) the slices
    follow the newest rates. Between those, once the current generation has committed
    :data:`FIRST_LOOK` steps while its slices are equal (planned before every member had a
    rate), then every ``batch_split_every`` steps (``JobStatus.high_step``), the coordinator
    looks once: it re-plans only when the new split would shorten the predicted step - the
    slowest member's slice over its rate - by more than :data:`MIN_GAIN`; else it looks again
    ``batch_split_every`` steps later. So a balanced job never switches for nothing, and a
    member whose speed changes is followed within a look. Such a re-plan is a re-slice: a
    generation of the same members at the same ranks that keeps the running one's process
    group (``ShardTable.continues``; the members switch to it in place, ``shoal.worker.decide``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from shoal.events.records import Split

#: The weight of the newest window in a worker's smoothed rate (an exponential moving average).
SMOOTHING = 0.5
#: A worker's rate is taken over windows of at least this many of its steps (samples: as many
#: slices of its current size).
WINDOW_STEPS = 2
#: No member's rate counts for less than the fastest's over this.
MAX_SKEW = 8.0
#: Re-plan between membership changes only when the predicted step shortens by more than this
#: (a re-slice costs about nothing: its members switch in place, see ``ShardTable.continues``;
#: what this keeps out is chasing the noise of the measured rates).
MIN_GAIN = 0.05
#: A generation planned before every member had a rate (equal slices) is looked at this many
#: committed steps after it was planned, not ``batch_split_every``: its first steps measure
#: the rates, and every step on equal slices waits for the slowest member.
FIRST_LOOK = 2

Range = tuple[int, int, int]


@dataclass(frozen=True)
class Work:
    """One heartbeat's work counters (``Heartbeat.work_samples``, ``work_seconds``)."""

    samples: int
    seconds: float


@dataclass(frozen=True)
class Look:
    """:func:`look`'s verdict: the split record to keep, whether to re-plan now, and why."""

    split: Split
    replan: bool
    reason: str


def observe(split: Split, work: Mapping[str, Work], n: int) -> Split:
    """``split`` once ``work`` was sampled: each worker's rate over the samples and seconds
    since the window's start (its process's start at first), folded into its smoothed rate
    once the window holds :data:`WINDOW_STEPS` of its slices of a global batch of ``n``
    (the current split's size, an equal share before one), which starts the next window; a
    shorter window grows on. Counters that went back (not the same process) only start a
    new window."""
    if not work:
        return split
    rates, seen = dict(split.rates), dict(split.seen)
    for wid, w in work.items():
        before = seen.get(wid, [0, 0.0])
        samples, seconds = w.samples - before[0], w.seconds - before[1]
        if samples < 0 or seconds < 0:
            seen[wid] = [w.samples, w.seconds]
            continue
        share = split.sizes.get(wid) or n // max(1, len(work))
        if samples == 0 or seconds <= 0 or samples < WINDOW_STEPS * share:
            continue
        seen[wid] = [w.samples, w.seconds]
        rate = samples / seconds
        old = rates.get(wid)
        rates[wid] = round(rate if old is None else SMOOTHING * rate + (1 - SMOOTHING) * old, 3)
    return replace(split, rates=rates, seen=seen)


def forget(split: Split, keep: Iterable[str]) -> Split:
    """``split`` without the workers not in ``keep`` (gone workers' rates never count again:
    a worker id is never reused)."""
    keep = set(keep)
    if keep >= split.rates.keys() | split.seen.keys():
        return split
    return replace(split, rates={w: r for w, r in split.rates.items() if w in keep},
                   seen={w: s for w, s in split.seen.items() if w in keep})


def equal_sizes(n: int, world: int) -> list[int]:
    """The equal split's block sizes (``shoal.coordinator.shards``' contiguous strategy)."""
    base, rem = divmod(n, world)
    return [base + (1 if r < rem else 0) for r in range(world)]


def weights(ids: Sequence[str], rates: Mapping[str, float]) -> list[float] | None:
    """The members' rates as they count for the split (bounded, a joiner at the median);
    None when no member has a rate yet."""
    known = [rates[w] for w in ids if rates.get(w, 0) > 0]
    if not known:
        return None
    fill = statistics.median(known)
    raw = [rates[w] if rates.get(w, 0) > 0 else fill for w in ids]
    top = max(raw)
    return [max(top / MAX_SKEW, r) for r in raw]


def sizes_for(n: int, ids: Sequence[str], rates: Mapping[str, float]) -> list[int]:
    """Each member's samples of a global batch of ``n``, in proportion to its rate (see the
    module docstring); the equal split when no member has a rate yet. Sums to ``n``."""
    if not ids:
        return []
    w = weights(ids, rates)
    if w is None:
        return equal_sizes(n, len(ids))
    total = sum(w)
    exact = [n * x / total for x in w]
    sizes = [int(x) for x in exact]
    by_remainder = sorted(range(len(ids)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in by_remainder[: n - sum(sizes)]:
        sizes[i] += 1
    if n >= len(ids):  # every member takes part with a sample: from the largest blocks
        for i in range(len(ids)):
            while sizes[i] == 0:
                big = max(range(len(ids)), key=lambda j: (sizes[j], -j))
                sizes[big] -= 1
                sizes[i] += 1
    return sizes


def ranges(sizes: Sequence[int]) -> list[list[Range]]:
    """Contiguous blocks of ``sizes``, rank by rank (an empty block: no range)."""
    out, start = [], 0
    for size in sizes:
        out.append([(start, start + size, 1)] if size else [])
        start += size
    return out


def predicted_step(sizes: Sequence[int], ids: Sequence[str], rates: Mapping[str, float]) -> float | None:
    """Seconds of the slowest member's own work with ``sizes`` (None: a member has no rate)."""
    if any(rates.get(w, 0) <= 0 for w in ids):
        return None
    return max(size / rates[w] for size, w in zip(sizes, ids))


def _describe(ids: Sequence[str], sizes: Sequence[int], rates: Mapping[str, float]) -> str:
    parts = []
    for w, size in zip(ids, sizes):
        rate = rates.get(w, 0)
        parts.append(f"{w} {size}" + (f" ({rate:.4g}/s)" if rate > 0 else " (no rate yet)"))
    return ", ".join(parts)


def plan(split: Split, ids: Sequence[str], n: int, generation: int, step: int) -> tuple[Split, list[int], str]:
    """The sizes of ``generation``'s members ``ids`` (rank order) for ``n`` positions, the
    split record that remembers them (the departed forgotten; the next look ``step`` +
    ``batch_split_every``), and a reason for people."""
    split = forget(split, ids)
    sizes = sizes_for(n, ids, split.rates)
    measured = weights(ids, split.rates) is not None
    said = (f"slices by speed: {_describe(ids, sizes, split.rates)}" if measured
            else "slices by speed: no rates measured yet, equal slices")
    sized = dict(zip(ids, sizes)) if measured else {}  # empty: equal slices, looked at after FIRST_LOOK steps
    return replace(split, sizes=sized, generation=generation, step=step), sizes, said


def look(split: Split, ids: Sequence[str], n: int, generation: int, high_step: int, every: int) -> Look:
    """Whether the running generation ``generation`` (members ``ids``, rank order; its
    newest committed step ``high_step``) should be re-planned now for speed. Not before
    ``every`` steps since it was planned or last looked at (:data:`FIRST_LOOK` steps while its
    slices are equal: planned before every member had a rate); then only when every member
    has a rate and the new split shortens the predicted step by more than :data:`MIN_GAIN`
    (else the next look is ``every`` steps later)."""
    if split.generation != generation:  # planned before by_speed was on (an older coordinator): from now
        return Look(replace(split, generation=generation, step=high_step, sizes={}), False,
                    "slices by speed: first look")
    due = split.step + (every if split.sizes else min(every, FIRST_LOOK))
    if high_step < due:
        return Look(split, False, f"slices by speed: next look at step {due}")
    missing = [w for w in ids if split.rates.get(w, 0) <= 0]
    if missing:
        return Look(split, False, f"slices by speed: no rate yet for {', '.join(missing)}")
    current = [split.sizes.get(w, 0) for w in ids]
    if sum(current) != n:
        current = equal_sizes(n, len(ids))
    new = sizes_for(n, ids, split.rates)
    now_s, then_s = predicted_step(current, ids, split.rates), predicted_step(new, ids, split.rates)
    later = replace(split, step=high_step, sizes=dict(zip(ids, current)))
    if new == current or then_s >= (1 - MIN_GAIN) * now_s:
        return Look(later, False, f"slices by speed kept at step {high_step}: predicted step {now_s * 1000:.0f} ms, "
                                  f"{then_s * 1000:.0f} ms re-planned (less than {MIN_GAIN:.0%} shorter)")
    return Look(later, True, f"slices by speed re-planned at step {high_step}: predicted step {now_s * 1000:.0f} ms -> "
                             f"{then_s * 1000:.0f} ms ({_describe(ids, current, split.rates)} -> "
                             f"{', '.join(f'{w} {s}' for w, s in zip(ids, new))})")
