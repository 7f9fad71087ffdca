"""Resume a job: find its newest usable checkpoint, from Redis if it knows, else from storage.

Order of authority:

1. the job's Redis pointer (:mod:`shoal.storage.latest`), the coordinator-agreed view;
2. the store's ``LATEST`` object, when Redis has no (valid) pointer -- e.g. Redis was wiped
   or replaced -- or cannot be reached;
3. a scan of every checkpoint's manifest, when LATEST is missing or corrupt as well.

From the chosen starting step, :func:`~storage.checkpoint.load_latest` falls back to older
checkpoints that verify; if none at or below the Redis pointer's step does (retention
already removed them), the store's LATEST is used. Every fallback is reported through
``on_warning``.

With a ``job_id``, only that job's checkpoints are resumed (:mod:`shoal.storage.ownership`):
a store whose newest checkpoint another job wrote raises ForeignCheckpoint before anything
is loaded.
"""

from __future__ import annotations

import redis

from shoal.storage.backend import ObjectStore
from shoal.storage.checkpoint import load_latest
from shoal.storage.errors import ForeignCheckpoint, NoCheckpoint, PointerCorrupt, StorageUnavailable
from shoal.storage.latest import read_pointer
from shoal.storage.manifest import FROM_ENV, HmacKey, Manifest
from shoal.storage.ownership import check_owned, foreign
from shoal.storage.train_state import TrainState
from shoal.storage.verify import Warn, ignore_warning


def resume(
    store: ObjectStore,
    r: redis.Redis | None = None,
    job_id: str | None = None,
    *,
    hmac_key: HmacKey = FROM_ENV,
    on_warning: Warn | None = None,
) -> tuple[TrainState, Manifest]:
    """Load the checkpoint to resume from (see module docstring).

    Raises NoCheckpoint when nothing verifies (a fresh job), ForeignCheckpoint when the
    checkpoint is another job's, UnsafeCheckpoint on a security failure, StorageError when
    the store fails. Redis trouble never fails a resume."""
    warn = on_warning if on_warning is not None else ignore_warning
    if job_id is not None:
        check_owned(store, job_id, hmac_key=hmac_key)
        loaded = _resume(store, r, job_id, hmac_key=hmac_key, warn=warn)
        owner = loaded[1].job_id
        if owner is not None and owner != job_id:  # an older one, fallen back to
            raise ForeignCheckpoint(foreign(store.uri, owner, loaded[1].step, job_id))
        return loaded
    return _resume(store, r, job_id, hmac_key=hmac_key, warn=warn)


def _resume(store: ObjectStore, r: redis.Redis | None, job_id: str | None, *, hmac_key: HmacKey,
            warn: Warn) -> tuple[TrainState, Manifest]:
    start: int | None = None
    unsaid = ""
    if r is not None and job_id is not None:
        try:
            pointer = read_pointer(r, job_id)
        except (PointerCorrupt, StorageUnavailable) as exc:
            warn(f"Redis LATEST pointer unusable ({exc}); using the store's LATEST")
            pointer = None
        if pointer is None:
            # said only if the store has a checkpoint after all (Redis lost the pointer): a new
            # job has neither, and that is no warning
            unsaid = f"job {job_id} has no Redis LATEST pointer; using {store.uri}/LATEST"
        elif pointer.store != store.uri:
            warn(f"Redis LATEST pointer names store {pointer.store}, not {store.uri}; ignoring it")
        else:
            start = pointer.step
    if start is not None:
        try:
            return load_latest(store, start_step=start, hmac_key=hmac_key, on_warning=warn)
        except NoCheckpoint as exc:
            warn(f"nothing verifies at or below the Redis pointer's step {start} ({exc}); using {store.uri}/LATEST")
    loaded = load_latest(store, hmac_key=hmac_key, on_warning=warn)
    if unsaid:
        warn(unsaid)
    return loaded
