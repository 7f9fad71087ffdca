"""A checkpoint belongs to its job (issue 35, storage/ownership.py): every checkpoint records
the job that wrote it (manifest and LATEST), a job resumes only its own, and another job's is
refused with one line naming both jobs and the fix; data-parallel and sharded checkpoints
alike, on every backend. Checkpoints written before jobs were recorded stay resumable."""

from __future__ import annotations

import json
import threading

import pytest

from shoal.storage.checkpoint import save_checkpoint, save_sharded_checkpoint
from shoal.storage.errors import ForeignCheckpoint
from shoal.storage.layout import LATEST
from shoal.storage.local import LocalStore
from shoal.storage.manifest import Manifest
from shoal.storage.ownership import Owner, check_owned, checkpoint_owner, missing_local
from shoal.storage.resume import resume
from shoal.storage.verify import read_manifest
from tests.storage.support import tiny_state
from tests.storage.test_sharded import _part


def _assert_refusal(exc: ForeignCheckpoint, uri: str) -> None:
    line = str(exc)
    assert "\n" not in line
    assert "job 'a'" in line and "job 'b'" in line  # both jobs
    assert "its own checkpoint_uri" in line and f"init_from: {uri}" in line  # both ways out


def test_a_job_resumes_its_own_checkpoint_and_another_job_is_refused(object_store) -> None:
    save_checkpoint(object_store, tiny_state(3), job_id="a")
    save_checkpoint(object_store, tiny_state(7), job_id="a")
    assert read_manifest(object_store, 7).job_id == "a"
    assert json.loads(object_store.get_bytes(LATEST))["job"] == "a"
    assert checkpoint_owner(object_store) == Owner(7, "a")

    state, manifest = resume(object_store, job_id="a")
    assert state.step == 7 and manifest.job_id == "a"
    with pytest.raises(ForeignCheckpoint) as refused:
        resume(object_store, job_id="b")
    _assert_refusal(refused.value, object_store.uri)
    with pytest.raises(ForeignCheckpoint):
        check_owned(object_store, "b")
    # a warm start reads any job's checkpoint: no job is named
    assert resume(object_store)[0].step == 7


def test_the_owner_comes_from_the_manifest_when_latest_does_not_record_it(tmp_path) -> None:
    """A LATEST written before jobs were recorded (or rewritten by hand): the newest manifest
    that reads says whose the store is; an unreadable newest one is passed over."""
    store = LocalStore(tmp_path)
    save_checkpoint(store, tiny_state(3), job_id="a")
    save_checkpoint(store, tiny_state(5), job_id="a")
    store.put_bytes(LATEST, json.dumps({"step": 5, "checkpoint": "step-000000005"}).encode())
    (tmp_path / "step-000000005" / "manifest.json").write_text("{not json")
    assert checkpoint_owner(store) == Owner(3, "a")
    with pytest.raises(ForeignCheckpoint):
        check_owned(store, "b")


def test_a_fallback_to_an_older_checkpoint_of_another_job_is_refused_too(tmp_path) -> None:
    """The newest checkpoint is b's own but damaged; the one a resume falls back to is a's."""
    store = LocalStore(tmp_path)
    save_checkpoint(store, tiny_state(3), job_id="a")
    save_checkpoint(store, tiny_state(5), job_id="b")
    (tmp_path / "step-000000005" / "model.pt").write_bytes(b"damaged")
    with pytest.raises(ForeignCheckpoint) as refused:
        resume(store, job_id="b")
    assert "job 'a'" in str(refused.value) and "step 3" in str(refused.value)


def test_checkpoints_from_before_jobs_were_recorded_stay_resumable(tmp_path) -> None:
    store = LocalStore(tmp_path)
    manifest = save_checkpoint(store, tiny_state(4), hmac_key=b"k" * 16)
    assert manifest.job_id is None
    # the bytes are those an older writer made: no job_id in the file, nor in the signed bytes
    assert b"job_id" not in manifest.to_json() and b"job_id" not in manifest.canonical_bytes()
    assert "job" not in json.loads(store.get_bytes(LATEST))
    assert checkpoint_owner(store, hmac_key=b"k" * 16) == Owner(4, None)
    assert resume(store, job_id="any", hmac_key=b"k" * 16)[0].step == 4


def test_the_job_is_part_of_the_signed_bytes(tmp_path) -> None:
    store = LocalStore(tmp_path)
    signed = save_checkpoint(store, tiny_state(4), hmac_key=b"k" * 16, job_id="a")
    assert read_manifest(store, 4, hmac_key=b"k" * 16).job_id == "a"
    forged = signed.model_copy(update={"job_id": "b"})  # another owner, the same HMAC
    assert forged.canonical_bytes() != signed.canonical_bytes()
    with pytest.raises(Exception, match="HMAC does not match"):
        forged.check_signature(b"k" * 16, where="forged")
    with pytest.raises(Exception, match="job_id"):
        Manifest.parse(signed.to_json().replace(b'"job_id": "a"', b'"job_id": "a b"'))


def test_a_sharded_checkpoint_records_its_job_and_is_refused_to_another(tmp_path) -> None:
    store = LocalStore(tmp_path)
    other = threading.Thread(target=save_sharded_checkpoint, args=(store, _part(1).snapshot()),
                             kwargs={"job_id": "a"})
    other.start()
    manifest = save_sharded_checkpoint(store, _part(0).snapshot(), parts_timeout_s=30, job_id="a")
    other.join()
    assert manifest.shards == 2 and manifest.job_id == "a"
    assert checkpoint_owner(store) == Owner(4, "a")
    assert resume(store, job_id="a")[0].step == 4
    with pytest.raises(ForeignCheckpoint) as refused:
        resume(store, job_id="b")
    _assert_refusal(refused.value, store.uri)


def test_an_empty_store_has_no_owner_and_a_missing_directory_is_seen_without_creating_it(tmp_path) -> None:
    assert checkpoint_owner(LocalStore(tmp_path / "empty")) is None
    assert check_owned(LocalStore(tmp_path / "empty"), "b") is None
    gone = tmp_path / "never"
    assert missing_local(f"file://{gone}") and missing_local(str(gone)) and not gone.exists()
    assert not missing_local(f"file://{tmp_path}") and not missing_local("s3://bucket/prefix")
