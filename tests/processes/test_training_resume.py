"""A job survives losing every process and the Redis data: it resumes from storage."""

from __future__ import annotations

import signal

import pytest

from shoal.core.registry import create_job
from shoal.core.jobspec import JobSpec
from shoal.ops.localproc import LocalProcs
from shoal.storage.checkpoint import load_latest
from shoal.storage.uri import open_store
from tests.helpers import ControlWatcher
from shoal.worker import ledger

pytestmark = pytest.mark.slow


def test_wiped_redis_resumes_from_storage_latest_at_the_same_step_and_cursor(r, redis_url, tmp_path) -> None:
    job = "resume-" + tmp_path.name[-6:]
    ckpt = f"file://{tmp_path / 'ckpt'}"
    spec = JobSpec(name=job, entrypoint="tests.entrypoints:slow_digits", global_batch_size=64, max_steps=60,
                   min_workers=1, max_workers=2, heartbeat_interval=0.2, heartbeat_ttl=1.5,
                   checkpoint_uri=ckpt, checkpoint_interval=10, checkpoint_keep=2)
    create_job(r, spec)
    watch = ControlWatcher(r, job)
    env = {"SHOAL_TEST_STEP_DELAY": "0.05"}
    with LocalProcs(redis_url, tmp_path / "logs1", extra_env=env | {"SHOAL_LEDGER_DIR": str(tmp_path / "l1")}) as procs:
        procs.coordinator("coord")
        procs.worker(job, "a")
        procs.worker(job, "b")
        watch.wait_for(lambda d: d.latest_step == 20, 180)
        for p in procs.procs:  # lose every process at once
            p.signal(signal.SIGKILL)
    store = open_store(ckpt)
    state, manifest = load_latest(store)
    assert state.step >= 20 and state.step % 10 == 0
    assert int(state.data_cursor) == state.step * 64
    r.flushdb()  # lose the Redis data too
    create_job(r, spec)
    watch = ControlWatcher(r, job)
    with LocalProcs(redis_url, tmp_path / "logs2", extra_env=env | {"SHOAL_LEDGER_DIR": str(tmp_path / "l2")}) as procs:
        procs.coordinator("coord")
        w = procs.worker(job, "c")
        watch.wait_for(lambda d: d.job_state == "completed", 180)
        assert w.wait(60) == 0
    entries = sorted(ledger.read(tmp_path / "l2"), key=lambda e: e["step"])
    assert entries[0]["step"] == state.step + 1 and entries[0]["cursor"] == int(state.data_cursor)
    assert entries[-1]["step"] == 60
    # and the new run published its own checkpoints, LATEST moving forward from there
    assert load_latest(store)[0].step == 60
