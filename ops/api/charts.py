"""The dashboard's charts: a job's committed-step points (page by page, after a cursor) and
the membership marks of ``shoal report`` (:func:`shoal.ops.report.membership_events`: start,
join, failure, leave, pause, end), from the ``progress`` and ``control`` streams.

Marks are recomputed only when the control stream has a new entry (:class:`MarksCache`, the
only state the server keeps, and only as a cache); points are never cached.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import redis

from shoal.events.keys import JobKeys
from shoal.events.streams import ControlEntry
from shoal.ops.report import Marked, membership_events, read_progress
from shoal.ops.streams import last_id, read_range

#: Jobs whose marks :class:`MarksCache` keeps.
CACHED_JOBS = 256


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def mark_json(m: Marked) -> dict:
    return {"ts_ms": m.ts_ms, "generation": m.generation, "kind": m.kind, "label": m.label, "reason": m.reason,
            "joined": list(m.joined), "removed": list(m.removed), "failed": list(m.failed),
            "world_size": m.world_size}


class MarksCache:
    """Each job's marks, keyed by the id of the newest decision they were computed from."""

    def __init__(self, size: int = CACHED_JOBS):
        self._size = size
        self._lock = threading.Lock()
        self._by_job: OrderedDict[str, tuple[str, list[dict]]] = OrderedDict()

    def marks(self, client: redis.Redis, keys: JobKeys) -> list[dict]:
        newest = last_id(client, keys.control)
        with self._lock:
            hit = self._by_job.get(keys.job_id)
            if hit is not None and hit[0] == newest:
                self._by_job.move_to_end(keys.job_id)
                return hit[1]
        decisions = [d for _sid, d in read_range(client, keys.control, ControlEntry, until=newest)]
        marks = [mark_json(m) for m in membership_events(decisions)]
        with self._lock:
            self._by_job[keys.job_id] = (newest, marks)
            self._by_job.move_to_end(keys.job_id)
            while len(self._by_job) > self._size:
                self._by_job.popitem(last=False)
        return marks


def chart_page(client: redis.Redis, keys: JobKeys, cache: MarksCache, *, after: str, limit: int) -> dict:
    """Points after entry id ``after`` (at most about ``limit``; ``more`` says whether more
    follow: ask again after ``last_id``), as columns (``t_ms`` is Redis server time, like the
    marks'; a loss that is not a number is null), the evaluations among them, and every mark."""
    points, evals, last, more = read_progress(client, keys.progress, after=after, limit=limit)
    return {
        "job_id": keys.job_id,
        "last_id": last,
        "more": more,
        "points": {
            "t_ms": [p.t_ms for p in points],
            "step": [p.step for p in points],
            "loss": [_finite(p.loss) for p in points],
            "generation": [p.generation for p in points],
            "world_size": [p.world_size for p in points],
        },
        "evals": [{"t_ms": e.t_ms, "step": e.step, "epoch": e.epoch, "generation": e.generation,
                   "metrics": e.metrics} for e in evals],
        "marks": cache.marks(client, keys),
    }
