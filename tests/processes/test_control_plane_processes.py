"""Acceptance of the control plane with real processes, real signals and a real Redis."""

from __future__ import annotations

import json
import signal

import pytest

from shoal.coordinator.errors import StaleEpoch
from shoal.coordinator.fenced import FencedBatch, FencedWriter
from shoal.coordinator.shards import expand
from shoal.events.keys import job_keys
from shoal.core.registry import create_job
from shoal.ops.status import format_status, job_status
from tests.helpers import ControlWatcher, job_spec, run_cli, server_ms

pytestmark = pytest.mark.slow
TTL = 1.0


#: the simulated job of these tests (job_spec: over the tests' common defaults)
SIMULATED_JOB = dict(entrypoint="simulate", min_workers=1, global_batch_size=30, heartbeat_ttl=TTL,
                     simulate_step_time=0.05)


def _world(n: int):
    return lambda d: d.world_size == n


def test_three_join_one_generation_then_a_fourth_is_rejected(r, job_id, procs) -> None:
    create_job(r, job_spec(job_id, SIMULATED_JOB))
    watch = ControlWatcher(r, job_id)
    procs.coordinator("coord")
    for i in range(3):
        procs.worker(job_id, f"w{i}")
    watch.wait_for(_world(3), 30)
    t = watch.table()
    assert t.generation == 1 and t.world_size == 3
    assert sorted(i for m in t.members for i in expand(m.ranges)) == list(range(30))
    fourth = procs.worker(job_id, "w3")
    assert fourth.wait(30) == 4
    assert "rejected" in fourth.log_tail() and "max_workers=3" in fourth.log_tail()
    assert "Traceback" not in fourth.log_tail()
    s = job_status(r, job_id)  # the refusal is in the job's record, not only in the worker's output
    assert s["rejected_joins"] == 1 and "max_workers=3" in s["last_rejection"], s
    assert "rejected joins: 1" in format_status(s)


def test_kill_9_is_failed_and_replanned_within_ttl_plus_1s(r, job_id, procs) -> None:
    create_job(r, job_spec(job_id, SIMULATED_JOB))
    watch = ControlWatcher(r, job_id)
    procs.coordinator("coord")
    ws = [procs.worker(job_id, f"w{i}") for i in range(3)]
    watch.wait_for(_world(3), 30)
    pid_to_id = {rec["pid"]: wid for wid, rec in watch.workers().items()}
    victim = ws[1]
    killed_ms = server_ms(r)
    victim.signal(signal.SIGKILL)
    d = watch.wait_for(_world(2), 10)
    assert int(d.ts_ms) - killed_ms <= TTL * 1000 + 1000
    gone = pid_to_id[victim.pid]
    assert watch.workers()[gone]["state"] == "Failed"
    assert gone not in [m.worker_id for m in watch.table().members]


def test_sigterm_drains_then_leaves_and_nothing_is_failed(r, job_id, procs) -> None:
    create_job(r, job_spec(job_id, SIMULATED_JOB))
    watch = ControlWatcher(r, job_id)
    procs.coordinator("coord")
    ws = [procs.worker(job_id, f"w{i}") for i in range(3)]
    watch.wait_for(_world(3), 30)
    ws[0].signal(signal.SIGTERM)
    watch.wait_for(lambda d: d.left and d.world_size == 2, 10)
    watch.wait_for(lambda d: d.kind == "left", 10)
    assert ws[0].wait(10) == 0
    states = sorted(rec["state"] for rec in watch.workers().values())
    assert states == ["Active", "Active", "Left"]


def test_below_min_workers_pauses_and_a_new_worker_resumes(r, job_id, procs) -> None:
    create_job(r, job_spec(job_id, SIMULATED_JOB, min_workers=2, max_workers=2))
    watch = ControlWatcher(r, job_id)
    procs.coordinator("coord")
    ws = [procs.worker(job_id, f"w{i}") for i in range(2)]
    watch.wait_for(_world(2), 30)
    ws[0].signal(signal.SIGKILL)
    watch.wait_for(lambda d: d.job_state == "paused", 10)
    assert watch.table().paused
    procs.worker(job_id, "w2")
    d = watch.wait_for(lambda d: d.job_state == "running" and d.world_size == 2, 30)
    assert int(d.generation) == 3


def test_standby_takes_over_within_lease_ttl_plus_1s_and_loses_no_event(r, job_id, procs) -> None:
    lease = 1.5
    create_job(r, job_spec(job_id, SIMULATED_JOB))
    watch = ControlWatcher(r, job_id)
    keys = job_keys(job_id)
    a = procs.coordinator("coord-a", "--lease-ttl", str(lease))
    procs.worker(job_id, "w0")
    watch.wait_for(_world(1), 30)
    procs.coordinator("coord-b", "--lease-ttl", str(lease))
    holder = r.get(keys.lease).decode()
    assert holder.startswith("coord-a")
    old_epoch = int(r.get(keys.epoch))
    killed_ms = server_ms(r)
    a.signal(signal.SIGKILL)
    # events sent while no leader acts are handled afterwards
    procs.worker(job_id, "w1")
    d = watch.wait_for(_world(2), 15)
    assert int(d.epoch) == old_epoch + 1
    first_by_b = next(x for x in watch.seen if int(x.epoch) > old_epoch)
    assert int(first_by_b.ts_ms) - killed_ms <= lease * 1000 + 1000
    assert r.get(keys.lease).decode().startswith("coord-b")
    # a write with the old epoch is refused
    stale = FencedWriter(r, keys, holder, old_epoch)
    with pytest.raises(StaleEpoch):
        stale.commit(FencedBatch(keys).hset(keys.state, {"state": "failed"}))
    assert r.hget(keys.state, "state") == b"running"


def test_status_json_reports_state_generation_and_workers(r, job_id, procs, subprocess_env) -> None:
    create_job(r, job_spec(job_id, SIMULATED_JOB))
    watch = ControlWatcher(r, job_id)
    procs.coordinator("coord")
    for i in range(2):
        procs.worker(job_id, f"w{i}")
    watch.wait_for(_world(2), 30)
    out = run_cli(subprocess_env, "status", job_id, "--json", timeout=30)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert s["state"] == "running" and s["generation"] == 1 and s["world_size"] == 2
    assert {w["worker_id"] for w in s["workers"]} == {"w0", "w1"}
    name, token = r.get(job_keys(job_id).lease).decode().split(":")
    assert s["leader"] == name and s["epoch"] == int(r.get(job_keys(job_id).epoch)) >= 1
    assert token not in out.stdout  # the lease token (a fencing credential) stays in Redis
    for w in s["workers"]:
        assert w["state"] in ("Syncing", "Active")
        assert w["heartbeat_age_ms"] is not None and 0 <= w["heartbeat_age_ms"] <= TTL * 1000
        assert "step" in w
    bad = run_cli(subprocess_env, "status", "no-such-job", timeout=30)
    assert bad.returncode == 2 and bad.stderr.strip() == "shoal: no job 'no-such-job' in this Redis"
