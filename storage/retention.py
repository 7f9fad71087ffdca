"""Retention: keep the newest K complete checkpoints, garbage-collect the rest.

Kept: the ``keep_last`` newest checkpoints with a valid manifest, the one LATEST names (even
if it is older or damaged), and any step in ``protect`` (e.g. the Redis pointer's).
Deleted: every other complete checkpoint, and every partial one (no valid manifest) that is
older than the newest complete checkpoint. A partial checkpoint newer than that may be a
save still in progress and is left alone. Validity here means "manifest parses and names its
step": file hashes are not re-read on every save.

A checkpoint is deleted manifest first, so an interrupted deletion leaves a partial
checkpoint, which the next run removes.
"""

from __future__ import annotations

from collections.abc import Iterable

from shoal.storage.backend import ObjectStore
from shoal.storage.errors import CheckpointCorrupt
from shoal.storage.latest_object import read_latest_step
from shoal.storage.layout import checkpoint_dir, manifest_key
from shoal.storage.verify import list_checkpoint_steps, read_manifest

#: Temporaries of interrupted local writes older than this are swept.
TEMP_MAX_AGE_S = 3600.0


def _has_valid_manifest(store: ObjectStore, step: int) -> bool:
    try:
        read_manifest(store, step, hmac_key=None)
    except CheckpointCorrupt:
        return False
    return True


def delete_checkpoint(store: ObjectStore, step: int) -> None:
    """Remove the checkpoint of ``step``: manifest first, then its other objects."""
    store.delete(manifest_key(step))
    for key in store.list(checkpoint_dir(step) + "/"):
        store.delete(key)


def apply_retention(
    store: ObjectStore,
    *,
    keep_last: int = 3,
    protect: Iterable[int] = (),
    temp_max_age_s: float = TEMP_MAX_AGE_S,
) -> list[int]:
    """Delete what the policy above does not keep; return the deleted steps, ascending.

    ``keep_last`` must be >= 1 (``ValueError``). Backend failures raise StorageError after
    the deletions that already happened (each one leaves the store consistent)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    steps = list_checkpoint_steps(store)
    complete = [s for s in steps if _has_valid_manifest(store, s)]
    keep = set(complete[-keep_last:]) | set(protect)
    latest = read_latest_step(store)
    if latest is not None:
        keep.add(latest)
    newest_complete = complete[-1] if complete else None
    complete_set = set(complete)
    doomed = [
        s
        for s in steps
        if s not in keep and (s in complete_set or (newest_complete is not None and s < newest_complete))
    ]
    for step in doomed:
        delete_checkpoint(store, step)
    store.sweep_temporaries(temp_max_age_s)
    return doomed
