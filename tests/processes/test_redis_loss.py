"""Redis restarts under a running job: from its AOF, and empty.

Each test runs its own real server (AOF on, ``appendfsync always``) so it can SIGKILL it and
start it again on the same port. Training goes on through the outage over gloo; the end
state is checked with the workers' ledgers: every committed step exactly once, every sample
exactly once per epoch, and the processes of the workers kept.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import redis

from shoal.ops.embedded import start_server
from shoal.core.registry import create_job
from shoal.ops.localproc import LocalProcs
from shoal.storage.checkpoint import load_latest
from shoal.storage.latest import LatestPointer
from shoal.storage.uri import open_store
from tests.helpers import ControlWatcher, dump_logs, job_spec
from shoal.worker import ledger

pytestmark = pytest.mark.slow
STEPS = 100  # over one epoch (79 steps) into the second
DIGITS = 5000  # samples in shoal.examples.digits


def _restart(server, *, empty: bool):
    server.kill()
    if empty:
        shutil.rmtree(server.run_dir)
    return start_server(server.run_dir, port=server.port, appendonly=True, fsync="always")


def _train_through_redis_restart(tmp_path: Path, *, empty: bool) -> tuple[list[dict], dict, dict]:
    """A 2-worker job on a Redis of its own, restarted (from its AOF, or ``empty``) once step 20
    is checkpointed, run to completion: the ledger, the worker pids before and after, and the
    checkpoint URI with the LATEST pointer."""
    server = start_server(tmp_path / "redis", appendonly=True, fsync="always")
    job = "loss-" + tmp_path.name[-6:]
    ckpt = f"file://{tmp_path / 'ckpt'}"
    client = redis.Redis.from_url(server.url, socket_timeout=10)
    create_job(client, job_spec(job, entrypoint="tests.entrypoints:slow_digits", global_batch_size=64, max_steps=STEPS,
                                epochs=2, min_workers=2, max_workers=2, checkpoint_uri=ckpt, checkpoint_interval=10,
                                checkpoint_keep=2))
    watch = ControlWatcher(client, job)
    env = {"SHOAL_TEST_STEP_DELAY": "0.05", "SHOAL_LEDGER_DIR": str(tmp_path / "ledger")}
    try:
        with LocalProcs(server.url, tmp_path / "logs", extra_env=env) as procs:
            procs.coordinator("coord")
            agent = procs.start("agent", "agent", job, "--workers", "2", "--backoff", "0.2", "--max-restarts", "0",
                                "--run-dir", str(tmp_path / "agent"))
            try:
                watch.wait_for(lambda d: d.latest_step == 20, 120)
                before = {r["pid"] for r in watch.workers().values() if r["state"] == "Active"}
                server = _restart(server, empty=empty)
                client = redis.Redis.from_url(server.url, socket_timeout=10)
                watch = ControlWatcher(client, job)
                watch.wait_for(lambda d: d.job_state == "completed", 180)
                assert agent.wait(60) == 0
            except BaseException:
                dump_logs(procs, tmp_path / "agent")
                raise
        after = {r["pid"] for r in watch.workers().values()}
        pointer = LatestPointer.from_json(client.get(f"shoal:{{{job}}}:latest"))
        return ledger.read(tmp_path / "ledger"), {"before": before, "after": after}, {"ckpt": ckpt, "pointer": pointer}
    finally:
        server.stop()


def test_redis_restarted_from_its_aof_changes_nothing_for_the_job(tmp_path) -> None:
    entries, pids, _ = _train_through_redis_restart(tmp_path, empty=False)
    verdict = ledger.verify(entries, DIGITS)
    assert verdict.ok, verdict.problem
    assert verdict.steps == STEPS
    assert pids["before"] == pids["after"]  # nobody was restarted (the agent may restart no one: --max-restarts 0)


def test_redis_restarted_empty_the_job_comes_back_and_no_step_is_committed_twice(tmp_path) -> None:
    entries, pids, where = _train_through_redis_restart(tmp_path, empty=True)
    verdict = ledger.verify(entries, DIGITS)
    assert verdict.ok, verdict.problem  # no step twice, no gap, every sample once per epoch
    assert verdict.steps == STEPS
    # the same processes carried on with their state: they rejoined the job the agent
    # registered again, with new worker ids, in generations numbered on above the old ones
    assert pids["before"] == pids["after"]
    gens = sorted({e["generation"] for e in entries})
    wiped_at = next(e["step"] for e in sorted(entries, key=lambda e: e["step"]) if e["generation"] == gens[-1])
    assert wiped_at > 20 and len(gens) >= 2 and gens[-1] > gens[0]
    # LATEST moved forward again in the new Redis and in the store, to the final step
    assert where["pointer"].step == STEPS
    # nobody waited out a collective timeout: a worker whose record vanished aborts its group
    # at once (its heartbeat finds it), so its peer that left first is not waited for
    logs = "".join(f.read_text() for f in (tmp_path / "agent").glob("slot-*.log"))
    assert "Timed out waiting" not in logs and "took longer than" not in logs, logs[-3000:]
    state, _ = load_latest(open_store(where["ckpt"]))
    per_epoch = -(-DIGITS // 64)  # the last batch of an epoch is short; nothing wraps
    assert state.step == STEPS and int(state.data_cursor) == DIGITS + (STEPS - per_epoch) * 64
