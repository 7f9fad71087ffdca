"""Read-side checks of a checkpoint, without deserializing anything.

:func:`read_manifest` parses and authenticates a manifest; :func:`read_verified_files`
returns the state files' bytes only after checking each size and sha256 against it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from shoal.storage.backend import ObjectStore
from shoal.storage.errors import CheckpointCorrupt, ObjectNotFound
from shoal.storage.layout import expected_files, file_key, manifest_key, step_of_key
from shoal.storage.manifest import FROM_ENV, HmacKey, Manifest, resolve_hmac_key
from shoal.storage.train_state import FILES

Warn = Callable[[str], None]


def read_manifest(
    store: ObjectStore, step: int, *, hmac_key: HmacKey = FROM_ENV, on_warning: Warn | None = None
) -> Manifest:
    """The manifest of ``step`` (parsed, step-consistent, HMAC-checked; files not read).

    Raises CheckpointCorrupt when it is missing or malformed, UnsafeCheckpoint when the HMAC
    check fails, StorageError when the backend fails."""
    where = manifest_key(step)
    try:
        raw = store.get_bytes(where)
    except ObjectNotFound as exc:
        raise CheckpointCorrupt(f"{store.uri}/{where}: missing (checkpoint incomplete)") from exc
    manifest = Manifest.parse(raw, where=f"{store.uri}/{where}")
    manifest.check_signature(resolve_hmac_key(hmac_key), where=f"{store.uri}/{where}", on_warning=on_warning)
    if manifest.step != step:
        raise CheckpointCorrupt(f"{store.uri}/{where}: manifest says step {manifest.step}")
    if manifest.shards is None:
        unknown = set(manifest.files) - set(FILES.values())
        complete = FILES["model"] in manifest.files
    else:
        allowed = expected_files(manifest.shards)
        unknown = set(manifest.files) - allowed
        complete = {n for n in allowed if n.startswith("shard-")} <= set(manifest.files)
    if unknown or not complete:
        raise CheckpointCorrupt(f"{store.uri}/{where}: unexpected file set {sorted(manifest.files)}")
    return manifest


def read_verified_files(store: ObjectStore, manifest: Manifest) -> dict[str, bytes]:
    """Every file of ``manifest`` after checking its size and sha256; CheckpointCorrupt
    names the first file that is missing, truncated/extended or differs."""
    return {name: read_verified_file(store, manifest, name) for name in manifest.files}


def read_verified_file(store: ObjectStore, manifest: Manifest, name: str) -> bytes:
    """The bytes of file ``name`` of ``manifest``'s checkpoint once its size and sha256 match;
    CheckpointCorrupt when it is not listed, missing, truncated/extended or differs."""
    entry = manifest.files.get(name)
    key = file_key(manifest.step, name)
    where = f"{store.uri}/{key}"
    if entry is None:
        raise CheckpointCorrupt(f"{where}: not listed in the manifest")
    try:
        data = store.get_bytes(key)
    except ObjectNotFound as exc:
        raise CheckpointCorrupt(f"{where}: missing") from exc
    if len(data) != entry.size:
        raise CheckpointCorrupt(f"{where}: size {len(data)} bytes, manifest says {entry.size} (truncated?)")
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise CheckpointCorrupt(f"{where}: sha256 {digest[:12]}... does not match manifest {entry.sha256[:12]}...")
    return data


def list_checkpoint_steps(store: ObjectStore) -> list[int]:
    """Steps of every checkpoint directory present, complete or not, ascending."""
    return sorted({s for s in (step_of_key(k) for k in store.list("step-")) if s is not None})


def verify_checkpoint(
    store: ObjectStore, step: int, *, hmac_key: HmacKey = FROM_ENV, on_warning: Warn | None = None
) -> Manifest:
    """Check the whole checkpoint of ``step`` (manifest, HMAC, every file's size and sha256)
    without deserializing it; return its manifest. Raises like :func:`read_manifest` and
    :func:`read_verified_files`."""
    manifest = read_manifest(store, step, hmac_key=hmac_key, on_warning=on_warning)
    read_verified_files(store, manifest)
    return manifest


def ignore_warning(_message: str) -> None:
    """The ``on_warning`` used when the caller passes none."""
