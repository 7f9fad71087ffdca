"""The evaluations of checkpointed steps, kept in the checkpoint store: what retention's
"keep the best checkpoint by a metric" (``checkpoint_keep_best``) reads.

Rank 0 records each evaluation it reports as ``evals/step-<step>.json`` (``{"step", "metrics"}``,
plain JSON: nothing is unpickled); :func:`best_step` picks, among the steps that still have a
checkpoint, the one whose metric is best. An unreadable record is skipped, never fatal.
"""

from __future__ import annotations

import json
import math

from shoal.storage.backend import ObjectStore
from shoal.storage.errors import StorageError

PREFIX = "evals"


def record_eval(store: ObjectStore, step: int, metrics: dict[str, float]) -> None:
    """Keep ``metrics`` of committed ``step``. Raises StorageError."""
    store.put_bytes(f"{PREFIX}/step-{step:09d}.json", json.dumps({"step": step, "metrics": metrics}).encode())


def best_step(store: ObjectStore, metric: str, mode: str, among: set[int]) -> int | None:
    """The step of ``among`` whose recorded ``metric`` is lowest (``mode`` min) or highest
    (max); ties go to the newer step; None when none of them has it. Raises StorageError
    when the store cannot be listed."""
    best: tuple[float, int] | None = None
    for key in store.list(f"{PREFIX}/"):
        try:
            doc = json.loads(store.get_bytes(key))
            step, value = int(doc["step"]), float(doc["metrics"][metric])
        except (StorageError, ValueError, KeyError, TypeError):
            continue
        if step not in among or not math.isfinite(value):
            continue
        score = value if mode == "min" else -value
        if best is None or (score, -step) < (best[0], -best[1]):
            best = (score, step)
    return None if best is None else best[1]
