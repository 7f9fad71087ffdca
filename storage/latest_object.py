"""The ``LATEST`` object of a checkpoint store: which checkpoint is the newest published one.

Content: ``{"step": N, "checkpoint": "step-00000000N", "job": "<job id>", "updated_at": "<UTC ISO>"}``
(``job``: the job that wrote the checkpoint; absent in stores written before it was
recorded; :func:`latest_job` reads it). It is
written (atomically, like every object) only after that checkpoint's manifest, and never
moves to a lower step. The read-compare-write is not atomic across processes: one writer per
store (rank 0 of the current generation) is assumed; the Redis pointer
(:mod:`shoal.storage.latest`) is the cross-process compare-and-set.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime

from shoal.storage.backend import ObjectStore
from shoal.storage.errors import LatestRegression, ObjectNotFound
from shoal.storage.layout import LATEST, checkpoint_dir


def read_latest_step(store: ObjectStore, on_warning: Callable[[str], None] | None = None) -> int | None:
    """The step LATEST names, or None when it is missing or unreadable (``on_warning`` is told
    why when it is corrupt). Backend failures raise StorageError."""
    try:
        raw = store.get_bytes(LATEST)
    except ObjectNotFound:
        return None
    step = parse_latest(raw)
    if step is None and on_warning is not None:
        on_warning(f"{store.uri}/{LATEST} is corrupt ({len(raw)} bytes); ignoring it")
    return step


def parse_latest(raw: bytes) -> int | None:
    """The step in LATEST content, or None unless it is well-formed and self-consistent."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    step = obj.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    if obj.get("checkpoint") != checkpoint_dir(step):
        return None
    return step


def latest_job(store: ObjectStore) -> tuple[int, str | None] | None:
    """``(step, job)`` of a well-formed LATEST (``job`` None when LATEST does not record one),
    None when LATEST is missing or unreadable. Backend failures raise StorageError."""
    try:
        raw = store.get_bytes(LATEST)
    except ObjectNotFound:
        return None
    step = parse_latest(raw)
    if step is None:
        return None
    job = json.loads(raw).get("job")
    return step, job if isinstance(job, str) and job else None


def write_latest(store: ObjectStore, step: int, job_id: str | None = None) -> None:
    """Point LATEST at ``step`` (written by job ``job_id``). Raises LatestRegression (and
    writes nothing) when LATEST already names a higher step; the same step is rewritten
    (idempotent). A corrupt LATEST is replaced."""
    current = read_latest_step(store)
    if current is not None and current > step:
        raise LatestRegression(f"{store.uri}/{LATEST} is at step {current}; refusing to move it back to {step}")
    body = {
        "step": step,
        "checkpoint": checkpoint_dir(step),
        **({"job": job_id} if job_id else {}),
        "updated_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
    }
    store.put_bytes(LATEST, (json.dumps(body) + "\n").encode())
