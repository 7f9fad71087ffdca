"""The progress history ``shoal report`` draws: rank 0 appends committed steps to a stream.

:class:`ProgressRecorder` writes one entry (``step``, ``loss``, ``generation``,
``world_size``, ``t``; optional ``input_wait``: seconds the step waited for its batches) to
``job_keys(J).progress`` at most every ``interval`` seconds, plus the first committed step
of every generation (so a report sees exactly when training went on after a membership
change). The entry id is Redis server time, the clock the coordinator's
``control`` stream uses. Recording never raises into the training loop: on a Redis error the
entry is dropped and recording pauses for ``error_backoff`` seconds. Nothing in the
coordinator reads this stream.

The throughput figures (:meth:`ProgressRecorder.figures`: FLOPs per sample, the device's
peak FLOP/s, tokens per sample; :mod:`shoal.worker.flops`) ride on the first entry of each
generation and on the next entry after they changed, so a reader finds the newest ones near
any point of the history.

Rank 0 also appends each evaluation (:meth:`ProgressRecorder.record_eval`, never skipped by
the interval): ``kind`` = ``eval``, ``step``, ``epoch``, ``generation``, ``metrics`` (JSON of
name -> finite float), ``t``. Entries without ``kind`` are committed steps.
"""

from __future__ import annotations

import logging
import math
import time

import redis

from shoal.events.keys import PROGRESS_MAXLEN, JobKeys
from shoal.events.streams import ProgressEntry

log = logging.getLogger("shoal.worker.progress")


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(float(seconds), 6)


class ProgressRecorder:
    def __init__(self, client: redis.Redis, keys: JobKeys, *, interval: float = 0.5, error_backoff: float = 5.0):
        self.client = client
        self.keys = keys
        self.interval = interval
        self.error_backoff = error_backoff
        self._last_t: float | None = None
        self._last_generation: int | None = None
        self._quiet_until = 0.0
        self.recorded = 0
        self.dropped = 0
        #: the throughput figures, and whether the next entry carries them
        self._figures: dict[str, float | int | None] = {}
        self._figures_due = False

    def figures(self, *, flops_per_sample: float | None = None, peak_flops: float | None = None,
                tokens_per_sample: int | None = None) -> None:
        """The throughput figures entries carry from now on (see the module docstring)."""
        figures = {"flops_per_sample": flops_per_sample, "peak_flops": peak_flops,
                   "tokens_per_sample": tokens_per_sample}
        figures = {k: v if v is not None and v > 0 and math.isfinite(v) else None for k, v in figures.items()}
        if figures != self._figures:
            self._figures, self._figures_due = figures, True

    def record(self, step: int, loss: float | None, generation: int, world_size: int, t: float | None = None, *,
               input_wait: float | None = None, compute: float | None = None,
               exposed_comm: float | None = None, stream: dict | None = None) -> bool:
        """Append this committed step if due; True when an entry was written. Never raises.
        The step's time split, each left out when None: ``input_wait`` (seconds rank 0's step
        waited for its batches), ``compute`` (its data, forward and backward, input wait
        included) and ``exposed_comm`` (waiting on the all-reduce after its backward).
        ``stream``: a streaming dataset's figures of rank 0 (``bytes_downloaded``,
        ``cache_hit_rate``, ``remote_reads``), written as ``downloaded``, ``hit_rate``,
        ``remote``."""
        try:
            now = time.time() if t is None else float(t)
            new_generation = generation != self._last_generation
            if not new_generation and self._last_t is not None and now - self._last_t < self.interval:
                return False
            if now < self._quiet_until:
                return False
            figures = stream or {}
            rates = self._figures if new_generation or self._figures_due else {}
            entry = ProgressEntry(step=int(step), loss=math.nan if loss is None else float(loss),
                                  generation=int(generation), world_size=int(world_size), t=round(now, 3),
                                  input_wait=_rounded(input_wait), compute=_rounded(compute),
                                  exposed_comm=_rounded(exposed_comm), downloaded=figures.get("bytes_downloaded"),
                                  hit_rate=figures.get("cache_hit_rate"), remote=figures.get("remote_reads"),
                                  **rates)
            self.client.xadd(self.keys.progress, entry.to_fields(), maxlen=PROGRESS_MAXLEN, approximate=True)
        except redis.RedisError as exc:
            self.dropped += 1
            self._quiet_until = (time.time() if t is None else float(t)) + self.error_backoff
            log.debug("progress entry of step %s dropped: %s", step, exc)
            return False
        except (TypeError, ValueError) as exc:  # a bad value must not stop training either
            self.dropped += 1
            log.debug("progress entry of step %s dropped: %s", step, exc)
            return False
        self._last_t = now
        self._last_generation = generation
        self._figures_due = self._figures_due and not rates
        self.recorded += 1
        return True

    def record_eval(self, step: int, epoch: int, generation: int, metrics: dict[str, float],
                    t: float | None = None) -> bool:
        """Append an evaluation (``shoal report`` draws its metrics against step and time);
        True when written. Never raises: on a Redis error it is dropped, like a step entry
        (but not held back by the pause after one: evaluations are rare)."""
        try:
            now = time.time() if t is None else float(t)
            entry = ProgressEntry(kind="eval", step=int(step), epoch=int(epoch), generation=int(generation),
                                  metrics=metrics, t=round(now, 3))
            self.client.xadd(self.keys.progress, entry.to_fields(), maxlen=PROGRESS_MAXLEN, approximate=True)
        except (redis.RedisError, TypeError, ValueError) as exc:
            self.dropped += 1
            log.debug("evaluation of step %s not recorded: %s", step, exc)
            return False
        self.recorded += 1
        return True
