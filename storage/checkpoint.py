"""Write and read checkpoints; pick the newest one that verifies.

Write order of :func:`save_checkpoint` (each object is written atomically by the store):

1. delete an existing ``manifest.json`` at this step (re-saving a step makes it invisible
   first, so old manifest + new files can never be mistaken for a checkpoint). The step
   LATEST names is never unpublished: while its checkpoint is whole (manifest verifies,
   files of the recorded sizes), a re-save of it writes nothing and returns the manifest
   that is there (a step's state is the same on every
   replica; re-writing it would leave LATEST naming no checkpoint for the time of the write);
2. every state file (``torch.save``, size and sha256 computed while writing; files are
   written concurrently, all have ended before the next step);
3. ``manifest.json`` -- from this moment the checkpoint exists;
4. ``LATEST`` (never backwards);
5. retention (:mod:`shoal.storage.retention`).

A crash before step 4 leaves LATEST naming the previous complete checkpoint; the new
directory either has no manifest (nothing loads it, retention removes it) or is complete
but unpublished (ignored while LATEST is valid).

Reading verifies before deserializing: the manifest parses (strict JSON) and, when an HMAC
key is configured, authenticates; every file exists with the recorded size and sha256; only
then is anything handed to ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterable
from typing import Any

import torch

from shoal.storage.backend import ObjectStore
from shoal.storage.errors import (
    CheckpointCorrupt,
    LatestRegression,
    NoCheckpoint,
    ObjectNotFound,
    StorageError,
    UnsafeCheckpoint,
)
from shoal.storage.latest_object import read_latest_step, write_latest
from shoal.storage.layout import file_key, manifest_key
from shoal.storage.manifest import FROM_ENV, FileEntry, HmacKey, Manifest, resolve_hmac_key
from shoal.storage.retention import apply_retention
from shoal.storage.resume_point import ResumePoint
from shoal.storage.safe_load import check_saveable, load_state_bytes
from shoal.storage.sharded import ShardedCheckpoint, ShardedTrainState, open_sharded, wait_for_shards, write_shard
from shoal.storage.threads import LazyPool
from shoal.storage.train_state import FILES, TrainState
from shoal.storage.verify import Warn, ignore_warning, list_checkpoint_steps, read_manifest, read_verified_files

_OVERLAP_MIN = 1024 * 1024
_MAX_PARALLEL_FILES = 4
_HASHER = LazyPool(_MAX_PARALLEL_FILES, "shoal-sha256")


class _HashingWriter:
    """File wrapper counting and hashing what torch.save writes through it. Large chunks
    are hashed on a helper thread while this thread writes them (both release the GIL);
    each write returns only when both are done, so the caller's buffer is never used after
    it was handed back."""

    def __init__(self, f) -> None:
        self._f = f
        self.size = 0
        self._sha = hashlib.sha256()

    def write(self, data) -> int:
        nbytes = memoryview(data).nbytes
        if nbytes >= _OVERLAP_MIN:
            hashed = _HASHER.get().submit(self._sha.update, data)
            try:
                n = self._f.write(data)
            finally:
                hashed.result()
        else:
            self._sha.update(data)
            n = self._f.write(data)
        self.size += nbytes
        return n

    def flush(self) -> None:
        self._f.flush()

    def entry(self) -> FileEntry:
        return FileEntry(size=self.size, sha256=self._sha.hexdigest())


#: ``on_phase(phase, step)``: called at the points of a save where a crash matters (fault
#: injection; see shoal/faults.py): ``ckpt_write`` with a state file written but unpublished,
#: ``ckpt_before_latest`` with the manifest written and LATEST not moved.
PhaseHook = Callable[[str, int], None]


def _write_state_file(store: ObjectStore, key: str, obj: Any, on_phase: PhaseHook | None = None, step: int = 0) -> FileEntry:
    with store.open_write(key) as f:
        w = _HashingWriter(f)
        torch.save(obj, w)
        if on_phase is not None:
            on_phase("ckpt_write", step)
    return w.entry()


def _write_state_files(store: ObjectStore, step: int, parts: dict[str, Any], on_phase: PhaseHook | None = None) -> dict[str, FileEntry]:
    """Write all state files concurrently (one thread each: serializing, hashing and
    writing overlap across files). Returns only when every write has ended; the first
    failure is raised after the others finished, so nothing is still writing afterwards."""
    if len(parts) == 1:
        ((name, obj),) = parts.items()
        return {name: _write_state_file(store, file_key(step, name), obj, on_phase, step)}
    with ThreadPoolExecutor(max_workers=min(len(parts), _MAX_PARALLEL_FILES),
                            thread_name_prefix="shoal-save") as pool:
        futures = {name: pool.submit(_write_state_file, store, file_key(step, name), obj, on_phase, step)
                   for name, obj in parts.items()}
    return {name: f.result() for name, f in futures.items()}


def _published(store: ObjectStore, step: int, key: HmacKey) -> Manifest | None:
    """The manifest of the checkpoint LATEST names at ``step`` when it is whole - the
    manifest verifies and every file it lists has its size (not read back: a re-save comes
    right after the save of the same step, and a model's files can be large) - else None
    (then a re-save repairs it)."""
    try:
        manifest = read_manifest(store, step, hmac_key=key, on_warning=ignore_warning)
        for name, entry in manifest.files.items():
            if store.size(file_key(step, name)) != entry.size:
                return None
    except (CheckpointCorrupt, UnsafeCheckpoint, ObjectNotFound):  # damaged, or signed with another key
        return None
    return manifest


def _before_save(store: ObjectStore, step: int, parts: dict[str, Any], key: bytes | None) -> Manifest | None:
    """Checks before anything is written: every part loadable back (ValueError), LATEST not
    past ``step`` (LatestRegression). The manifest of ``step`` when LATEST already names it
    whole (a re-save then writes nothing), else None."""
    for name, obj in parts.items():
        check_saveable(obj, name)
    current = read_latest_step(store)
    if current is not None and current > step:
        raise LatestRegression(f"{store.uri}/LATEST is at step {current}; refusing to save step {step}")
    return _published(store, step, key) if current == step else None


def save_checkpoint(
    store: ObjectStore,
    state: TrainState,
    *,
    keep_last: int | None = 3,
    hmac_key: HmacKey = FROM_ENV,
    on_warning: Warn | None = None,
    on_phase: PhaseHook | None = None,
    protect: Callable[[], Iterable[int]] | None = None,
    job_id: str | None = None,
) -> Manifest:
    """Write ``state`` as the checkpoint of ``state.step``, publish it in LATEST, then apply
    retention (``keep_last`` newest; None disables; the steps ``protect()`` names are kept
    too: a job's Redis LATEST pointer, which lags the store's while the coordinator is away;
    when ``protect`` raises, retention is skipped this time). Returns the manifest written.
    ``job_id``: the job writing it, recorded in the manifest and in LATEST
    (:mod:`shoal.storage.ownership`).
    ``on_phase``: see :data:`PhaseHook`; an exception from it fails the save.

    Errors: ``ValueError`` for state that could not be loaded back and LatestRegression
    when LATEST already names a higher step (both: nothing written); StorageError from
    the store (the checkpoint stays invisible, LATEST unchanged). Retention failures do
    not fail the save: they go to ``on_warning``.
    """
    fields = state.manifest_fields()
    parts = state.components()
    key = resolve_hmac_key(hmac_key)
    step = state.step
    published = _before_save(store, step, parts, key)
    if published is not None:
        return published

    store.delete(manifest_key(step))
    files = _write_state_files(store, step, parts, on_phase)
    return _publish(store, step, files, fields, key, keep_last=keep_last, on_warning=on_warning, on_phase=on_phase,
                    protect=protect, job_id=job_id)


def _publish(store: ObjectStore, step: int, files: dict[str, FileEntry], fields: dict[str, Any], key: bytes | None,
             *, keep_last: int | None, on_warning: Warn | None, on_phase: PhaseHook | None,
             protect: Callable[[], Iterable[int]] | None, job_id: str | None) -> Manifest:
    """Steps 3-5 of the write order: the manifest, LATEST, retention."""
    manifest = Manifest.create(files=files, job_id=job_id, **fields).signed(key)
    store.put_bytes(manifest_key(step), manifest.to_json())
    if on_phase is not None:
        on_phase("ckpt_before_latest", step)
    write_latest(store, step, job_id)  # checks again: another writer may have moved it meanwhile

    if keep_last is not None:
        try:
            pinned = list(protect()) if protect is not None else []
        except Exception as exc:  # noqa: BLE001 - never delete what might still be named
            if on_warning is not None:
                on_warning(f"retention after step {step} skipped: cannot tell which checkpoints are pinned ({exc})")
            return manifest
        try:
            apply_retention(store, keep_last=keep_last, protect=pinned)
        except StorageError as exc:
            if on_warning is not None:
                on_warning(f"retention after step {step} failed: {exc}")
    return manifest


#: how long member 0 of a sharded save waits for the other members' parts
PARTS_TIMEOUT_S = 120.0


def save_sharded_checkpoint(
    store: ObjectStore,
    state: ShardedTrainState,
    *,
    keep_last: int | None = 3,
    hmac_key: HmacKey = FROM_ENV,
    on_warning: Warn | None = None,
    on_phase: PhaseHook | None = None,
    protect: Callable[[], Iterable[int]] | None = None,
    parts_timeout_s: float = PARTS_TIMEOUT_S,
    job_id: str | None = None,
) -> Manifest | None:
    """One member's part of a sharded checkpoint (:mod:`shoal.storage.sharded`): its shard
    files; member 0 also the replicated files and, once every member's part is there, the
    manifest, LATEST and retention as :func:`save_checkpoint`. Returns the manifest (member
    0) or None (the others, and a re-save of the published step, which writes nothing).

    Errors as :func:`save_checkpoint`'s; member 0 raises CheckpointCorrupt when a part is
    missing after ``parts_timeout_s`` (LATEST unchanged)."""
    fields = state.manifest_fields()
    parts = state.components() if state.shard == 0 else {}
    key = resolve_hmac_key(hmac_key)
    step = state.step
    published = _before_save(store, step, parts, key)
    if published is not None:
        return published if state.shard == 0 else None
    # the files of other attempts at this step have other names (another shard size) or the
    # same bytes (the same step's state): the old manifest stays true until replaced
    write_shard(store, state, _HashingWriter)
    if on_phase is not None:
        on_phase("ckpt_write", step)
    if state.shard != 0:
        return None
    files = _write_state_files(store, step, parts, on_phase) if parts else {}
    files.update(wait_for_shards(store, step, state.shard_size, parts_timeout_s))
    return _publish(store, step, files, fields, key, keep_last=keep_last, on_warning=on_warning, on_phase=on_phase,
                    protect=protect, job_id=job_id)


def load_checkpoint(
    store: ObjectStore, step: int, *, hmac_key: HmacKey = FROM_ENV, on_warning: Warn | None = None
) -> tuple[TrainState | ShardedCheckpoint, Manifest]:
    """Load the checkpoint of ``step`` after verifying all of it (see module docstring).

    A sharded checkpoint comes back as a :class:`ShardedCheckpoint`: its replicated files
    and shard indexes read and verified, the shards' data fetched (and verified) by its
    reader when a load needs it.

    Raises CheckpointCorrupt (incomplete or damaged), UnsafeCheckpoint (HMAC failure or a
    file the weights-only loader refuses), StorageError (backend). Never returns part of a
    checkpoint."""
    manifest = read_manifest(store, step, hmac_key=hmac_key, on_warning=on_warning)
    if manifest.shards is not None:
        return open_sharded(store, manifest), manifest
    blobs = read_verified_files(store, manifest)
    parts = {name: load_state_bytes(data, where=f"{store.uri}/{file_key(step, name)}") for name, data in blobs.items()}
    state = TrainState(
        model=parts[FILES["model"]],
        optimizer=parts.get(FILES["optimizer"]),
        scheduler=parts.get(FILES["scheduler"]),
        rng=parts.get(FILES["rng"]),
        scaler=parts.get(FILES["scaler"]),
        **ResumePoint.counters(manifest),
    )
    return state, manifest


def load_latest(
    store: ObjectStore,
    *,
    start_step: int | None = None,
    hmac_key: HmacKey = FROM_ENV,
    on_warning: Warn | None = None,
) -> tuple[TrainState | ShardedCheckpoint, Manifest]:
    """Load the newest usable checkpoint at or below ``start_step`` (default: what LATEST
    names; when LATEST is missing or corrupt, every checkpoint present is a candidate).

    Candidates are tried newest first; a corrupt or incomplete one is reported through
    ``on_warning`` with the reason and the next older one is tried. Checkpoints newer than
    the pointer were never published and are not considered. Raises NoCheckpoint when none
    verifies, UnsafeCheckpoint at once on a security failure (no silent fallback from a
    tampered store), StorageError when the backend fails.
    """
    warn = on_warning if on_warning is not None else ignore_warning
    key = resolve_hmac_key(hmac_key)
    present = list_checkpoint_steps(store)
    head = start_step if start_step is not None else read_latest_step(store, warn)
    if head is None:
        if present:
            warn(f"{store.uri}: no usable LATEST; scanning {len(present)} checkpoint directories")
        candidates = sorted(present, reverse=True)
    else:
        candidates = [head] + sorted((s for s in present if s < head), reverse=True)
    rejected: list[str] = []
    for step in candidates:
        try:
            return load_checkpoint(store, step, hmac_key=key, on_warning=warn)
        except CheckpointCorrupt as exc:
            rejected.append(str(exc))
            warn(f"skipping checkpoint of step {step}: {exc}; falling back to an older one")
    detail = "; ".join(rejected) if rejected else "store holds no checkpoints"
    raise NoCheckpoint(f"{store.uri}: no complete checkpoint ({detail})")
