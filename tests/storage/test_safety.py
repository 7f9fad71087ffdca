"""Safe loading: pickle payloads are refused unexecuted; HMAC-signed manifests are enforced."""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import pickle
from pathlib import Path

import pytest
import torch
from tests.storage.support import Warnings, tiny_state

from shoal.storage.backend import ObjectStore
from shoal.storage.checkpoint import load_checkpoint, load_latest, save_checkpoint
from shoal.storage.errors import UnsafeCheckpoint
from shoal.storage.layout import file_key, manifest_key
from shoal.storage.manifest import HMAC_ENV
from shoal.storage.memory import MemoryStore
from shoal.storage.resume import resume


HMAC_SECRET = "hmac-key-that-must-never-show-up"


class _CreatesFile:
    """Unpickling this calls ``open(path, "w")``: a visible side effect of code execution."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (builtins.open, (str(self.path), "w"))


def _zip_payload(sentinel: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(3), "evil": _CreatesFile(sentinel)}, buf)
    return buf.getvalue()


def _plant(store: ObjectStore, step: int, name: str, data: bytes) -> None:
    """Replace a state file and re-seal the manifest (size + sha256), as an attacker with
    write access to the store would, so only deserialization can catch it."""
    store.put_bytes(file_key(step, name), data)
    manifest = json.loads(store.get_bytes(manifest_key(step)))
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    store.put_bytes(manifest_key(step), json.dumps(manifest).encode())


def test_payloads_are_armed(tmp_path: Path) -> None:
    """Control: unrestricted unpickling of these payloads really creates the file."""
    a, b = tmp_path / "control-zip", tmp_path / "control-raw"
    torch.load(io.BytesIO(_zip_payload(a)), weights_only=False).get("evil").close()
    pickle.loads(pickle.dumps(_CreatesFile(b))).close()
    assert a.exists() and b.exists()


@pytest.mark.parametrize("name", ["model.pt", "optimizer.pt"])
@pytest.mark.parametrize("kind", ["torch-zip", "raw-pickle"])
def test_pickle_payload_is_refused_and_never_executed(object_store: ObjectStore, tmp_path: Path, name: str, kind: str) -> None:
    sentinel = tmp_path / "pwned"
    save_checkpoint(object_store, tiny_state(1))
    save_checkpoint(object_store, tiny_state(2))
    payload = _zip_payload(sentinel) if kind == "torch-zip" else pickle.dumps(_CreatesFile(sentinel))
    _plant(object_store, 2, name, payload)

    with pytest.raises(UnsafeCheckpoint, match=name):
        load_checkpoint(object_store, 2)
    # No silent fallback to step 1 from a store that has been tampered with.
    with pytest.raises(UnsafeCheckpoint):
        load_latest(object_store)
    with pytest.raises(UnsafeCheckpoint):
        resume(object_store)
    assert not sentinel.exists()


def test_tampered_manifest_refused_with_hmac(monkeypatch: pytest.MonkeyPatch, object_store: ObjectStore) -> None:
    monkeypatch.setenv(HMAC_ENV, HMAC_SECRET)
    save_checkpoint(object_store, tiny_state(1))
    save_checkpoint(object_store, tiny_state(2))
    assert load_checkpoint(object_store, 2)[0].step == 2  # untampered: fine

    manifest = json.loads(object_store.get_bytes(manifest_key(2)))
    assert len(manifest["hmac"]) == 64
    manifest["data_cursor"] = {"sample": 0}  # e.g. replay data from the start
    object_store.put_bytes(manifest_key(2), json.dumps(manifest).encode())
    with pytest.raises(UnsafeCheckpoint, match="HMAC does not match"):
        load_checkpoint(object_store, 2)
    with pytest.raises(UnsafeCheckpoint):
        load_latest(object_store)


def test_hmac_covers_state_files_through_their_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HMAC_ENV, HMAC_SECRET)
    s = MemoryStore()
    save_checkpoint(s, tiny_state(1))
    other = io.BytesIO()
    torch.save({"w": torch.ones(64), "b": torch.arange(8)}, other)
    _plant(s, 1, "model.pt", other.getvalue())  # valid tensors, re-sealed sha, stale HMAC
    with pytest.raises(UnsafeCheckpoint, match="HMAC"):
        load_checkpoint(s, 1)


def test_stripped_or_wrongly_keyed_hmac_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    s = MemoryStore()
    monkeypatch.setenv(HMAC_ENV, HMAC_SECRET)
    save_checkpoint(s, tiny_state(1))
    manifest = json.loads(s.get_bytes(manifest_key(1)))
    manifest["hmac"] = None
    s.put_bytes(manifest_key(1), json.dumps(manifest).encode())
    with pytest.raises(UnsafeCheckpoint, match="no HMAC"):
        load_checkpoint(s, 1)

    save_checkpoint(s, tiny_state(2))
    monkeypatch.setenv(HMAC_ENV, "another-key")
    with pytest.raises(UnsafeCheckpoint, match="does not match"):
        load_checkpoint(s, 2)
    assert load_checkpoint(s, 2, hmac_key=HMAC_SECRET.encode())[0].step == 2


def test_signed_manifest_without_key_loads_with_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    s = MemoryStore()
    save_checkpoint(s, tiny_state(1), hmac_key=HMAC_SECRET.encode())
    monkeypatch.delenv(HMAC_ENV, raising=False)
    warnings = Warnings()
    state, manifest = load_checkpoint(s, 1, on_warning=warnings)
    assert state.step == 1 and manifest.hmac is not None
    assert "not verified" in warnings[0]


def test_hmac_key_never_stored_or_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HMAC_ENV, HMAC_SECRET)
    s = MemoryStore()
    manifest = save_checkpoint(s, tiny_state(1))
    blobs = b"".join(s.get_bytes(k) for k in s.list())
    assert HMAC_SECRET.encode() not in blobs
    assert HMAC_SECRET not in repr(manifest)
    manifest_json = json.loads(s.get_bytes(manifest_key(1)))
    manifest_json["epoch"] = 99
    s.put_bytes(manifest_key(1), json.dumps(manifest_json).encode())
    with pytest.raises(UnsafeCheckpoint) as info:
        load_checkpoint(s, 1)
    assert HMAC_SECRET not in str(info.value)
