"""Load with faults: 20 simulated jobs of 3 workers each (60 real worker processes) served
by two ``shoal coordinator`` replicas. While they run, some workers and the coordinator that
leads most jobs are ``kill -9``'d; every job must still complete, the jobs that lost a worker
re-plan on their survivors, and the other replica takes over the dead one's jobs.
A fast in-process test pins down how a simulated job completes across such faults.

Cost on 2 cores: starting the 60 Python processes (~0.3 CPU-s of imports each) takes 8-17 s
depending on what else runs; each worker holds ~42 MB RSS (2.5 GB in all, much of it shared
pages). The jobs then run MAX_STEPS simulated steps (~20 s); the test takes 35-50 s and prints
its figures (``-rP`` shows them).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest
import redis

from shoal.coordinator.loop import Coordinator
from shoal.events.keys import COORDINATOR_GROUP, job_keys
from shoal.ops.embedded import free_port
from shoal.core.registry import create_job
from shoal.core.jobspec import JobSpec
from shoal.ops.localproc import LocalProcs
from tests.helpers import ControlWatcher, server_ms, wait_until
from shoal.worker.membership import Membership
from shoal.worker.simulated import SimulatedWorker

JOBS = 20
WORKERS = 3
#: One worker is killed in every KILL_EVERY-th job (5 jobs of 20).
KILL_EVERY = 4
STEP_S = 0.05
#: Long enough that no job ends before the kills: the jobs started first have been running
#: for as long as it took to start all 60 processes when the kills happen.
MAX_STEPS = 400


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _wait_serving(port: int, proc, timeout: float = 30) -> None:
    def serving() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5):
                return True
        except OSError:
            assert proc.popen.poll() is None, proc.log_tail()
            return False

    wait_until(serving, timeout, lambda: f"{proc.name} serving metrics on port {port}\n{proc.log_tail()}", interval=0.1)


def _leader(r, job: str) -> str:
    """The replica leading ``job``. Its 1.5 s lease can lapse for a moment while 60 processes
    start or exit on a slow machine; the next renewal (or a takeover) holds it again."""
    lease = job_keys(job).lease
    held = wait_until(lambda: r.get(lease), 15, f"a replica holding {lease}", interval=0.1)
    return held.decode().split(":", 1)[0]


def _step(r, job: str, watch: ControlWatcher) -> int:
    """The most advanced member's simulated step (from the heartbeats)."""
    keys = job_keys(job)
    beats = [json.loads(b) for b in r.mget([keys.heartbeat(w) for w in watch.workers()]) if b]
    return max((int(b.get("step") or 0) for b in beats), default=0)


def _wait(watch: ControlWatcher, pred, timeout: float, r, job: str, procs) -> None:
    """``watch.wait_for``; on a timeout, the job's worker processes (exit code, log tail) and
    the events it holds join the message: a job that stalls among 20 names its own cause."""
    try:
        watch.wait_for(pred, timeout)
    except AssertionError as exc:
        keys = job_keys(job)
        events = [f"{sid.decode()} {f.get(b'data', b'')[:120].decode(errors='replace')}" for sid, f in r.xrange(keys.events)][-20:]
        pending = r.xpending(keys.events, COORDINATOR_GROUP) if r.exists(keys.events) else None
        who = "\n".join(f"--- {p.name} (pid {p.pid}, exit {p.popen.poll()}):\n{p.log_tail(15)}" for p in procs)
        raise AssertionError(f"{exc}\nlease: {r.get(keys.lease)!r}; events: {events}; pending: {pending}\n{who}") from None


@pytest.mark.slow
def test_many_jobs_complete_through_worker_and_coordinator_kills(r, redis_url, tmp_path) -> None:
    run = f"ld{os.getpid() % 10000}-{int(time.time() * 1000) % 100000}"
    jobs = [f"{run}-{i:02d}" for i in range(JOBS)]
    watches = {j: ControlWatcher(r, j) for j in jobs}
    with LocalProcs(redis_url, tmp_path / "logs") as procs:
        ports = {name: free_port() for name in ("coord-a", "coord-b")}
        coords = {name: procs.coordinator(name, "--lease-ttl", "1.5", "--no-launcher", "--metrics-port", str(port))
                  for name, port in ports.items()}
        for name, port in ports.items():  # both replicas serve before any job exists
            _wait_serving(port, coords[name])
        t0 = time.monotonic()
        workers = {}
        for j in jobs:  # registered while both replicas run: each job goes to whichever refreshes first
            create_job(r, JobSpec(name=j, entrypoint="simulate", min_workers=2, max_workers=WORKERS,
                                  global_batch_size=30, heartbeat_interval=0.2, heartbeat_ttl=1.0,
                                  simulate_step_time=STEP_S, max_steps=MAX_STEPS))
            workers[j] = [procs.worker(j, f"{j}-w{k}") for k in range(WORKERS)]
        for j in jobs:
            _wait(watches[j], lambda d: d.world_size == 3, 60, r, j, workers[j])
        started_s = time.monotonic() - t0
        rss = sum(_rss_mb(p.pid) for ps in workers.values() for p in ps)

        # who leads what, and how far each job got
        leader = {j: _leader(r, j) for j in jobs}
        dead_coord = max(coords, key=lambda c: sum(1 for v in leader.values() if v == c))
        survivor = next(c for c in coords if c != dead_coord)
        led_by_dead = [j for j in jobs if leader[j] == dead_coord]
        epochs = {j: int(r.get(job_keys(j).epoch)) for j in jobs}
        # the least advanced jobs lose a worker: most steps left before they complete
        steps = {j: _step(r, j, watches[j]) for j in jobs}
        victims = sorted(jobs, key=steps.get)[: JOBS // KILL_EVERY]
        running = {j for j in jobs if r.hget(job_keys(j).state, "state") == b"running"}
        assert set(victims) <= running, steps
        killed: dict[str, str] = {}  # job -> worker id
        for j in victims:
            by_pid = {rec["pid"]: wid for wid, rec in watches[j].workers().items()}
            proc = workers[j][1]
            killed[j] = by_pid[proc.pid]
            proc.signal(signal.SIGKILL)
        coords[dead_coord].signal(signal.SIGKILL)
        killed_ms = server_ms(r)

        for j in jobs:
            _wait(watches[j], lambda d: d.job_state == "completed", 60, r, j, workers[j])
        done_s = time.monotonic() - t0

        for j in jobs:
            keys = job_keys(j)
            state = r.hgetall(keys.state)
            assert state[b"state"] == b"completed", (j, state)
            summary = json.loads(state[b"summary"])
            assert summary["step"] == MAX_STEPS, (j, summary)
            assert r.xlen(keys.dead) == 0, j  # no event was lost to a dead letter on the way
            # every live worker saw the end and exited cleanly
            for p in workers[j]:
                rc = p.wait(30)
                assert rc == (-signal.SIGKILL if killed.get(j) and p is workers[j][1] else 0), (p.name, rc, p.log_tail())
            # the survivor leads every job now (its 1.5 s lease may lapse for a moment while 60
            # processes exit on a slow machine: it renews it on its next turn)
            assert _leader(r, j) == survivor, j

        # the jobs that lost a worker re-planned on their two survivors and finished with them
        for j, wid in killed.items():
            w = watches[j]
            assert w.workers()[wid]["state"] == "Failed", (j, w.workers())
            replans = [d for d in w.seen if int(d.ts_ms) >= killed_ms and wid in d.failed
                       and d.world_size == 2]
            assert replans, (j, [d.reason for d in w.seen])
            assert json.loads(r.hget(job_keys(j).state, "summary"))["world_size"] == 2

        # the dead replica's running jobs were taken over: a new epoch, decisions made by the survivor
        taken = [j for j in led_by_dead if j in running]
        assert taken, (dead_coord, leader)
        for j in taken:
            after = [d for d in watches[j].seen if int(d.ts_ms) >= killed_ms]
            assert after and all(int(d.epoch) > epochs[j] for d in after), (j, epochs[j], after)
        assert coords[survivor].popen.poll() is None, coords[survivor].log_tail()
        print(f"\n{JOBS} jobs x {WORKERS} workers: all joined in {started_s:.1f} s (worker RSS {rss:.0f} MB total), "
              f"{len(led_by_dead)} of {JOBS} jobs led by the killed {dead_coord}, {len(killed)} workers killed, "
              f"all completed {done_s:.1f} s after start")


def _drive(coord: Coordinator, until, what: str, timeout: float = 15, workers=()) -> None:
    """Run the coordinator's (and the workers') ``run_once`` in turn until ``until()`` holds."""

    def done() -> bool:
        if until():
            return True
        coord.run_once(block_ms=20)
        for w in workers:
            w.run_once()
        return False

    wait_until(done, timeout, what, interval=0)


def test_simulated_job_completes_by_the_next_rank0_after_leader_and_rank0_die(r, redis_url, job_id, request) -> None:
    """max_steps ends a simulated job: only rank 0 reports it, so when rank 0 dies the
    survivor (done stepping, but rank 1) waits, becomes rank 0 in the next generation and
    reports; the completion is applied by the replica that took over from a dead leader."""
    keys = job_keys(job_id)
    spec = JobSpec(name=job_id, entrypoint="simulate", min_workers=1, max_workers=2, global_batch_size=4,
                   heartbeat_interval=0.1, heartbeat_ttl=0.5, simulate_step_time=0, max_steps=5)
    create_job(r, spec)
    a = Coordinator(redis.Redis.from_url(redis_url), instance_id="a", lease_ttl=5)
    workers = [SimulatedWorker(Membership(redis.Redis.from_url(redis_url), job_id), spec, join_timeout=10) for _ in range(2)]
    request.addfinalizer(lambda: [w.hb.stop() for w in workers if w.hb is not None])
    joins = [threading.Thread(target=w.start) for w in workers]
    for t in joins:
        t.start()
    _drive(a, lambda: not any(t.is_alive() for t in joins), "both joins")
    table = lambda: ControlWatcher(r, job_id).table() if r.exists(keys.shard) else None  # noqa: E731
    _drive(a, lambda: table() is not None and table().world_size == 2, "generation 1 with both workers")
    rank0, rank1 = sorted(workers, key=lambda w: table().member(w.membership.worker_id).rank)
    while rank0.step < 3 or rank1.step < spec.max_steps:
        for w in (rank0, rank1):
            if w.step < (3 if w is rank0 else spec.max_steps):
                assert w.run_once() is None
    for _ in range(3):  # done stepping but not rank 0: it waits and reports nothing
        assert rank1.run_once() is None and rank1.step == spec.max_steps
    a.run_once(block_ms=20)
    assert r.hget(keys.state, "state") == b"running"

    # rank 0 dies (no more heartbeats, no more steps) and so does the leader
    rank0.hb.stop()
    r.delete(keys.lease)  # as if a's lease had lapsed
    b = Coordinator(redis.Redis.from_url(redis_url), instance_id="b", lease_ttl=5)
    try:
        _drive(b, lambda: r.hget(keys.state, "state") == b"completed", "completion reported by the new rank 0",
               workers=[rank1])
        assert int(r.get(keys.epoch)) == 2 and b.leads[job_id].epoch == 2
        assert table().generation == 2 and [m.worker_id for m in table().members] == [rank1.membership.worker_id]
        assert json.loads(r.hget(keys.state, "summary")) == {"step": 5, "generation": 2, "world_size": 1}
        assert rank1.run_once() == 0  # it sees the end and exits cleanly
    finally:
        b.release_all()
        a.release_all()
