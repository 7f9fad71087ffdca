"""A checkpoint belongs to the job that wrote it.

Every checkpoint records its job: the manifest's ``job_id`` and the store's LATEST object's
``job``. A job resumes only its own checkpoints; a store holding another job's is refused
with :class:`~shoal.storage.errors.ForeignCheckpoint` (one line naming both jobs and the
fix), at submit (``shoal submit``/``create``, ``POST /jobs``) and again by every worker
before it loads anything. Refusal rather than a directory per job under the URI: the store's
layout stays what it is (a job running now resumes from its existing checkpoints after an
upgrade, a path seen in the store is the path in the spec), and a reused path is a mistake
to be told about, not silently turned into a fresh start. Starting from another job's
checkpoint is asked for explicitly, with ``init_from`` (a warm start at step 0).

Checkpoints written before jobs were recorded name no job: any job may resume them, as
before.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from shoal.storage.backend import ObjectStore
from shoal.storage.errors import CheckpointCorrupt, ForeignCheckpoint, ObjectNotFound, UnsafeCheckpoint
from shoal.storage.latest_object import latest_job
from shoal.storage.manifest import FROM_ENV, HmacKey
from shoal.storage.verify import ignore_warning, list_checkpoint_steps, read_manifest


@dataclass(frozen=True)
class Owner:
    """The newest checkpoint of a store: its step and the job that wrote it (None: a
    checkpoint from before jobs were recorded)."""

    step: int
    job: str | None


def checkpoint_owner(store: ObjectStore, *, hmac_key: HmacKey = FROM_ENV) -> Owner | None:
    """Who wrote the store's newest checkpoint: LATEST's ``job`` when it records one, else the
    ``job_id`` of the newest manifest that reads (LATEST's step first, then the others, newest
    first). None when the store holds no checkpoint with a readable manifest. Reads only
    LATEST and manifests, never a state file. StorageError when the backend fails."""
    latest = latest_job(store)
    if latest is not None and latest[1] is not None:
        return Owner(*latest)
    present = sorted(list_checkpoint_steps(store), reverse=True)
    head = [latest[0]] if latest is not None else []
    for step in head + [s for s in present if not head or s < head[0]]:
        try:
            manifest = read_manifest(store, step, hmac_key=hmac_key, on_warning=ignore_warning)
        except (CheckpointCorrupt, UnsafeCheckpoint, ObjectNotFound):
            continue
        return Owner(step, manifest.job_id)
    return None


def foreign(uri: str, owner: str, step: int, job_id: str) -> str:
    """The one line of a refusal: both jobs, and the two ways out."""
    return (f"checkpoint_uri {uri} holds the checkpoints of job {owner!r} (its LATEST: step {step}); job "
            f"{job_id!r} does not resume another job's checkpoint: give job {job_id!r} its own checkpoint_uri, or "
            f"warm-start it from those weights with init_from: {uri}")


def check_owned(store: ObjectStore, job_id: str, *, hmac_key: HmacKey = FROM_ENV) -> Owner | None:
    """The store's :class:`Owner` when job ``job_id`` may resume from it (its own
    checkpoints, checkpoints naming no job, or none); ForeignCheckpoint when its newest
    checkpoint is another job's. StorageError when the backend fails."""
    owner = checkpoint_owner(store, hmac_key=hmac_key)
    if owner is not None and owner.job is not None and owner.job != job_id:
        raise ForeignCheckpoint(foreign(store.uri, owner.job, owner.step, job_id))
    return owner


def missing_local(uri: str) -> bool:
    """Whether ``uri`` names a local directory that does not exist (opening a ``file://``
    store creates its directory: a check must not)."""
    if uri.startswith("/"):
        return not Path(uri).is_dir()
    parts = urlsplit(uri)
    return parts.scheme == "file" and not Path(unquote(parts.path)).is_dir()
