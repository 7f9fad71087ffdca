"""Elastic HSDP through a coordinator stall (issue 34): the coordinator is SIGSTOPped, a member
of one replica group is killed (``kill -9``), frozen (SIGSTOP) or drained (SIGTERM) inside the
stall, and the coordinator comes back a second later. The surviving replica group's step fails
on its own before any table says why; the table that then evicts the lost group must abort only
that generation's cross-replica collectives, never the survivors' shard group (at 5e93599 it
aborted the shard group for good: every later step of the survivors was "aborted" by the old
eviction, 300 generations in 4 minutes, and the job never ended).

Checked: the job completes, every sample exactly once, the survivors keep their processes and
commit within 1 s of the coordinator's return (SIGSTOP: of the frozen member's eviction), every
replica ends bit-identical. ``SHOAL_STALL_REPEAT=N`` runs each fault N times (the issue's
acceptance is 10 of 10)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.events.records import WorkerRecord
from shoal.events.states import WorkerState
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger
from tests.helpers import ControlWatcher, dump_logs, wait_until

pytestmark = pytest.mark.slow

DIGITS = 5000
JOB = dict(entrypoint="shoal.examples.digits:build_double_paced", global_batch_size=48, shard_size=2, min_workers=2,
           heartbeat_interval=0.3, heartbeat_ttl=1.5, seed=1, epochs=10, max_workers=4)
STEPS = 90
STALL_S = 1.0
REPEAT = int(os.environ.get("SHOAL_STALL_REPEAT", "1"))


def _active(r, job: str, group: str | None = None) -> list[WorkerRecord]:
    recs = (WorkerRecord.from_json(v) for v in r.hgetall(job_keys(job).workers).values())
    return sorted((x for x in recs if x.state == WorkerState.ACTIVE and (group is None or x.replica_group == group)),
                  key=lambda x: x.shard)


def _high_step(r, job: str) -> int:
    return int(r.hget(job_keys(job).state, "high_step") or 0)


def _stalled_fault(r, redis_url, tmp_path, job: str, fault: str) -> dict:
    create_job(r, JobSpec(name=job, max_steps=STEPS, **JOB))
    watch = ControlWatcher(r, job)
    env = {"SHOAL_LEDGER_DIR": str(tmp_path / "ledger"), "SHOAL_EXPORT_DIR": str(tmp_path / "final"),
           "SHOAL_STEP_PACE": "0.05"}
    seen: dict = {}
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        coord = procs.coordinator("coord")
        procs.start("agent", "agent", job, "--workers", "4", "--backoff", "0.2", "--run-dir", str(tmp_path / "agent"))
        try:
            watch.wait_for(lambda d: d.world_size == 4, 90)
            wait_until(lambda: len(_active(r, job)) == 4 and _high_step(r, job) >= 20, 90, "step 20 with 4 members")
            victim_group, survivor_group = "r1", "r0"
            survivors = _active(r, job, survivor_group)
            victim = _active(r, job, victim_group)[1]
            seen["survivors"] = {x.worker_id: x.pid for x in survivors}
            seen["generation"] = int(r.hget(job_keys(job).state, "generation"))
            coord.signal(signal.SIGSTOP)
            try:
                stalled_at = time.time()
                sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "leave": signal.SIGTERM}[fault]
                os.kill(victim.pid, sig)
                time.sleep(STALL_S)  # the stall itself: nothing to await, the coordinator is stopped
            finally:
                coord.signal(signal.SIGCONT)
            seen["back"] = time.time()
            seen["stalled_at"] = stalled_at
            if fault == "stop":
                evicted = watch.wait_for(lambda d: victim.worker_id in d.failed, 30)
                seen["evicted"] = evicted.ts_ms / 1000
                os.kill(victim.pid, signal.SIGKILL)
            end = watch.wait_for(lambda d: d.job_state in ("completed", "failed"), 180)
            seen["end"] = end
            for p in procs.procs:
                if p.role == "agent":
                    p.wait(60)
            seen["generations"] = int(r.hget(job_keys(job).state, "generation"))
        except BaseException:
            dump_logs(procs, tmp_path / "agent")
            raise
    return seen


@pytest.mark.exclusive  # a bound on recovery: a second test on the 2 cores must not tip it
@pytest.mark.parametrize("fault", ["kill", "stop", "leave"])
def test_a_fault_inside_a_coordinator_stall_never_wedges_the_surviving_group(r, redis_url, tmp_path, job_id,
                                                                              fault) -> None:
    for attempt in range(REPEAT):
        run = tmp_path / f"run{attempt}"
        job = f"{job_id}-{attempt}"
        seen = _stalled_fault(r, redis_url, run, job, fault)
        assert seen["end"].job_state == "completed", seen["end"].reason
        entries = ledger.read(run / "ledger")
        verdict = ledger.verify(entries, DIGITS)
        assert verdict.ok, verdict.problem
        assert verdict.steps == STEPS
        by_worker: dict[str, set[int]] = {}
        for e in entries:
            by_worker.setdefault(e["worker"], set()).add(e["pid"])
        for wid, pid in seen["survivors"].items():  # kept their processes to the end
            assert by_worker[wid] == {pid}, (wid, by_worker[wid], pid)
            assert max(e["step"] for e in entries if e["worker"] == wid) == STEPS
        # the survivors' next commit after the fault: within 1 s of the coordinator's return
        # (a frozen member is only known to be gone once its TTL ran out: its eviction)
        since = seen["evicted"] if fault == "stop" else seen["back"]
        after = [e["t"] for e in entries if e["worker"] in seen["survivors"] and e["generation"] > seen["generation"]]
        assert after, "the survivors never committed in a later generation"
        recovery = min(after) - since
        print(f"{fault} #{attempt}: survivors' next commit {recovery:.2f} s after "
              f"{'the eviction' if fault == 'stop' else 'the coordinator returned'}; "
              f"{seen['generations']} generations in all")
        assert recovery <= 1.0, f"survivors committed {recovery:.2f} s after the coordinator was back"
        finals = [torch.load(p, weights_only=True) for p in sorted((run / "final").glob("final-*.pt"))]
        assert finals
        for f in finals:  # every replica bit-identical
            assert all(torch.equal(f[k], finals[0][k]) for k in finals[0])


def test_a_finished_group_completes_the_job_when_rank_0s_group_cannot_finish(r, redis_url, tmp_path, job_id) -> None:
    """Rank 0 (replica group r0, the savers) hangs after the job's last step (``finish``: its
    final evaluation never returns); the other group's members committed the same last step.
    They report the completion themselves once rank 0 has not within the completion wait, the
    job completes at max_steps, and no member that finished is declared failed."""
    from shoal.worker.training import completion_wait

    steps = 40
    spec = JobSpec(name=job_id, max_steps=steps, **JOB)
    create_job(r, spec)
    watch = ControlWatcher(r, job_id)
    env = {"SHOAL_LEDGER_DIR": str(tmp_path / "ledger"), "SHOAL_STEP_PACE": "0.02",
           "SHOAL_FAULTS": f"w0@{steps}:finish:sleep=600"}
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        procs.start("agent", "agent", job_id, "--workers", "4", "--run-dir", str(tmp_path / "agent"))
        try:
            watch.wait_for(lambda d: d.world_size == 4, 90)
            t0 = time.monotonic()
            end = watch.wait_for(lambda d: d.job_state in ("completed", "failed"), completion_wait(spec) + 120)
            took = time.monotonic() - t0
        except BaseException:
            dump_logs(procs, tmp_path / "agent")
            raise
    assert end.job_state == "completed", end.reason
    assert "reported by w0" not in end.reason  # rank 0 never reported: another member did
    print(f"completed {took:.1f} s after the generation formed: {end.reason}")
    records = [WorkerRecord.from_json(v) for v in r.hgetall(job_keys(job_id).workers).values()]
    assert not [x.worker_id for x in records if x.state == WorkerState.FAILED]
    assert not [d for d in watch.seen if d.failed]  # nobody was ever declared failed
    verdict = ledger.verify(ledger.read(tmp_path / "ledger"), DIGITS)
    assert verdict.ok, verdict.problem
    assert verdict.steps == steps
