"""``init_from`` in the job spec and the checks at submit (issue 35): a warm start names a
store with a checkpoint; a job's own checkpoint_uri holding another job's checkpoints is
refused with one line naming both jobs and the fix. No Redis, no user code."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shoal.core.errors import ConfigError
from shoal.core.jobspec import JobSpec
from shoal.ops.submit import check_checkpoints
from shoal.storage.checkpoint import save_checkpoint
from shoal.storage.local import LocalStore
from tests.storage.support import tiny_state


def spec(**fields) -> JobSpec:
    return JobSpec(**{"name": "b", "entrypoint": "simulate", **fields})


def test_init_from_is_a_store_uri_other_than_the_jobs_own(tmp_path) -> None:
    assert spec(init_from=f"file://{tmp_path}/a").init_from == f"file://{tmp_path}/a"
    assert spec(init_from="s3://bucket/a", init_from_optimizer=True).init_from_optimizer
    with pytest.raises(ValidationError, match="must start with file:// or s3://"):
        spec(init_from=str(tmp_path))
    with pytest.raises(ValidationError, match="must not carry credentials"):
        spec(init_from="s3://user:pw@bucket/a")
    with pytest.raises(ValidationError, match="init_from_optimizer applies to a warm start"):
        spec(init_from_optimizer=True)
    with pytest.raises(ValidationError, match="init_from is the job's own checkpoint_uri"):
        spec(init_from=f"file://{tmp_path}/a/", checkpoint_uri=f"file://{tmp_path}/a")
    # a spec stored before the fields existed reads back without them
    assert JobSpec.from_stored('{"name": "b", "entrypoint": "simulate"}').init_from is None


def test_submit_refuses_an_init_from_without_a_checkpoint(tmp_path) -> None:
    for uri, needle in ((f"file://{tmp_path}/never", "no such directory"),
                        (f"file://{tmp_path}", "holds no checkpoint")):
        with pytest.raises(ConfigError, match=needle) as refused:
            check_checkpoints(spec(init_from=uri))
        assert "\n" not in str(refused.value) and str(refused.value).startswith(f"init_from {uri}: ")
    assert not (tmp_path / "never").exists()  # the check created nothing
    save_checkpoint(LocalStore(tmp_path / "a"), tiny_state(5), job_id="a")
    check_checkpoints(spec(init_from=f"file://{tmp_path}/a"))  # another job's: that is what init_from is for


def test_submit_refuses_a_checkpoint_uri_holding_another_jobs_checkpoints(tmp_path) -> None:
    save_checkpoint(LocalStore(tmp_path / "a"), tiny_state(5), job_id="a")
    uri = f"file://{tmp_path}/a"
    with pytest.raises(ConfigError) as refused:
        check_checkpoints(spec(checkpoint_uri=uri))
    line = str(refused.value)
    assert "\n" not in line and "job 'a'" in line and "job 'b'" in line and f"init_from: {uri}" in line
    check_checkpoints(spec(name="a", checkpoint_uri=uri))  # its own: resumed
    check_checkpoints(spec(checkpoint_uri=f"file://{tmp_path}/fresh"))  # a new store
    assert not (tmp_path / "fresh").exists()
    # the fix the line names: another store, warm-started from a's
    check_checkpoints(spec(checkpoint_uri=f"file://{tmp_path}/b", init_from=uri))
