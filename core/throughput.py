"""Throughput over a window of committed steps, and model FLOPs utilisation (MFU).

One rule for every reader (``shoal status`` and the HTTP API, ``shoal report``, rank 0's
TensorBoard scalars; the dashboard's ``app.js`` mirrors :func:`rolling_rates`): the rate at a
committed step is the committed steps gained over the last :data:`WINDOW_S` seconds of
committed-step points (rank 0's ``progress`` entries: the step and when it was committed,
about two a second), divided by the time they span. A step that takes longer than the others
(an evaluation or a checkpoint before it, a slow batch) then moves the rate by its share of the
window, not by the ratio of one step time to another, as 1 / the last step time did. Pauses
in the window (a membership change) count: the rate is what the job makes, not what a step
costs.

Pure functions, no I/O; times are seconds on one clock (Redis server time for stream entry
ids, a worker's monotonic clock for its own points).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Seconds of committed steps the rates are measured over.
WINDOW_S = 30.0


@dataclass(frozen=True)
class Rate:
    """Committed steps per second over ``span_s`` seconds ending at the newest point."""

    steps_per_s: float
    #: the seconds the rate was measured over (at most about the window, more only when the
    #: two newest points are farther apart than that: steps slower than the window)
    span_s: float
    #: the committed steps gained over them
    steps: int


def _start(times: Sequence[float], end: int, window_s: float) -> int:
    """Index of the oldest point at most ``window_s`` before point ``end``, or the one just
    before ``end`` when that is farther (two points are needed for a rate)."""
    lo = end
    while lo > 0 and times[end] - times[lo - 1] <= window_s:
        lo -= 1
    return min(lo, end - 1) if end > 0 else 0


def _gained(steps: Sequence[int], lo: int, hi: int) -> int:
    """Steps gained from point ``lo`` to ``hi``: a step that went back (the job resumed from an
    older checkpoint) counts nothing, the steps made again after it count."""
    return sum(max(0, steps[k + 1] - steps[k]) for k in range(lo, hi))


def window_rate(points: Sequence[tuple[float, int]], window_s: float = WINDOW_S) -> Rate | None:
    """The rate at the newest of ``points`` (``(seconds, committed step)``, oldest first); None
    with fewer than two points or no time between them."""
    if len(points) < 2:
        return None
    times = [t for t, _ in points]
    steps = [s for _, s in points]
    end = len(points) - 1
    lo = _start(times, end, window_s)
    span = times[end] - times[lo]
    if span <= 0:
        return None
    gained = _gained(steps, lo, end)
    return Rate(gained / span, span, gained)


def rolling_rates(points: Sequence[tuple[float, int]], window_s: float = WINDOW_S) -> list[float | None]:
    """:func:`window_rate` at every point (None at the first): a report's or a chart's
    throughput line. Linear in the number of points."""
    times = [t for t, _ in points]
    steps = [s for _, s in points]
    gained = [0]  # steps gained from the first point to each one
    for k in range(1, len(points)):
        gained.append(gained[-1] + max(0, steps[k] - steps[k - 1]))
    out: list[float | None] = []
    lo = 0
    for end in range(len(points)):
        while lo < end and times[end] - times[lo] > window_s:
            lo += 1
        start = min(lo, end - 1) if end > 0 else 0
        span = times[end] - times[start]
        out.append((gained[end] - gained[start]) / span if end > 0 and span > 0 else None)
    return out


@dataclass(frozen=True)
class Throughput:
    """A job's rates at one steps/s (None where a figure is not known)."""

    steps_per_s: float
    samples_per_s: float
    #: samples/s x tokens per sample (the job's ``TrainingSetup.tokens_per_sample``)
    tokens_per_s: float | None = None
    #: samples/s x FLOPs of one sample's forward and backward (measured, or the spec's)
    flops_per_s: float | None = None
    #: ``flops_per_s`` over the peak FLOP/s of every member together (0..1)
    mfu: float | None = None


def throughput(steps_per_s: float, samples_per_step: int, *, tokens_per_sample: float | None = None,
               flops_per_sample: float | None = None, peak_flops: float | None = None) -> Throughput:
    """The rates of a job committing ``steps_per_s`` global batches of ``samples_per_step``
    samples a second. ``peak_flops``: of all the members together (their devices' dense peak
    at the job's precision); MFU is left out without it (a CPU, a GPU not in the table and no
    ``peak_flops`` in the spec)."""
    samples = steps_per_s * samples_per_step
    flops = samples * flops_per_sample if flops_per_sample else None
    return Throughput(steps_per_s=steps_per_s, samples_per_s=samples,
                      tokens_per_s=samples * tokens_per_sample if tokens_per_sample else None,
                      flops_per_s=flops, mfu=mfu(flops, peak_flops))


def mfu(flops_per_s: float | None, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved over peak FLOP/s (None when either is unknown)."""
    if not flops_per_s or not peak_flops or peak_flops <= 0:
        return None
    return flops_per_s / peak_flops
