"""Faults at chosen phases of a checkpoint and of the coordinator, checked on the end state.

Rank 0 writes checkpoints every 10 steps; a rule ``*@20:PHASE:ACTION`` kills it at one phase
of the step-20 save. Its node agent starts a replacement, which rejoins the survivor and
gets the state by broadcast. Whatever the phase: the job completes, every step and sample
is committed exactly once, and LATEST (in the store and in Redis) names a complete checkpoint
of the final step. A coordinator killed while a checkpoint event is pending leaves the event
to the standby, which moves LATEST.
"""

from __future__ import annotations

import re

import pytest
import torch

from shoal.core.faults import COORDINATOR_PHASES, WORKER_PHASES, BadFaultRule, FaultPlan, Rule, parse
from shoal.core.registry import create_job
from shoal.ops.localproc import LocalProcs
from shoal.storage.checkpoint import load_latest
from shoal.storage.latest import LatestPointer
from shoal.storage.uri import open_store
from tests.helpers import ControlWatcher, dump_logs, job_spec
from shoal.worker import ledger

STEPS = 40
DIGITS = 5000


#: the slow digits job, 1 to 2 workers, TTL 1.5 s (job_spec's)
SLOW_DIGITS_JOB = dict(entrypoint="tests.entrypoints:slow_digits", global_batch_size=64, max_steps=STEPS,
                       min_workers=1, max_workers=2)


def _checkpoints(uri: str) -> dict:
    """A checkpoint to ``uri`` every 10 steps, the last 2 kept."""
    return dict(checkpoint_uri=uri, checkpoint_interval=10, checkpoint_keep=2)


def _dump(procs, tmp_path) -> None:
    dump_logs(procs, tmp_path / "agent", 30)


def _check_end_state(r, job: str, ckpt: str, tmp_path) -> None:
    verdict = ledger.verify(ledger.read(tmp_path / "ledger"), DIGITS)
    assert verdict.ok, verdict.problem
    assert verdict.steps == STEPS
    state, manifest = load_latest(open_store(ckpt))  # verifies every file's sha256 first
    assert state.step == manifest.step == STEPS
    assert LatestPointer.from_json(r.get(f"shoal:{{{job}}}:latest")).step == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("phase,action", [("ckpt_write", "segv"), ("ckpt_before_latest", "kill"), ("ckpt_before_event", "kill")])
def test_rank0_dies_at_a_checkpoint_phase_and_the_job_still_ends_exactly_once(r, redis_url, tmp_path, phase, action) -> None:
    job = f"ph-{phase[5:12]}-{tmp_path.name[-4:]}"
    ckpt = f"file://{tmp_path / 'ckpt'}"
    # min_workers 2: training starts with both workers in, so a survivor holds step 20 when
    # rank 0 dies (on a loaded machine the second process may otherwise come after step 20,
    # resume from the checkpoint, and hit the same fault as rank 0 of its own)
    create_job(r, job_spec(job, SLOW_DIGITS_JOB, _checkpoints(ckpt), min_workers=2))
    watch = ControlWatcher(r, job)
    env = {"SHOAL_TEST_STEP_DELAY": "0.05", "SHOAL_LEDGER_DIR": str(tmp_path / "ledger"),
           "SHOAL_FAULTS": f"*@20:{phase}:{action}"}
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        agent = procs.start("agent", "agent", job, "--workers", "2", "--backoff", "0.1", "--max-restarts", "1",
                            "--run-dir", str(tmp_path / "agent"))
        try:
            failed = watch.wait_for(lambda d: " process ended with signal" in d.reason, 120)
            watch.wait_for(lambda d: d.job_state == "completed", 120)
            assert agent.wait(60) == 0
        except BaseException:
            _dump(procs, tmp_path)
            raise
    fired = [f for f in (tmp_path / "agent").glob("slot-*.log") if f"fault injected: {action} at " in f.read_text()]
    assert len(fired) == 1 and f"@20:{phase}" in fired[0].read_text()
    signal_no = {"segv": 11, "kill": 9}[action]
    assert f"signal {signal_no}" in failed.reason
    _check_end_state(r, job, ckpt, tmp_path)


@pytest.mark.slow
def test_leader_killed_with_a_checkpoint_event_pending_the_standby_moves_latest(r, redis_url, tmp_path) -> None:
    job = "ph-coord-" + tmp_path.name[-4:]
    ckpt = f"file://{tmp_path / 'ckpt'}"
    create_job(r, job_spec(job, SLOW_DIGITS_JOB, _checkpoints(ckpt)))
    watch = ControlWatcher(r, job)
    env = {"SHOAL_TEST_STEP_DELAY": "0.05", "SHOAL_LEDGER_DIR": str(tmp_path / "ledger")}
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env | {"SHOAL_COORD_FAULTS": "checkpoint@2:before_apply:kill"}) as procs:
        leader = procs.coordinator("leader", "--lease-ttl", "1")
        procs.extra_env.pop("SHOAL_COORD_FAULTS")  # the standby started below has no fault
        try:
            procs.start("agent", "agent", job, "--workers", "2", "--run-dir", str(tmp_path / "agent"))
            watch.wait_for(lambda d: d.kind == "join", 60)  # the leader leads (it is alone)
            first = watch.wait_for(lambda d: d.latest_step == 10, 120)
            assert leader.wait(60) == -9  # killed itself holding the step-20 event, unapplied
            # the standby comes up only now: started earlier, it could have been handed the job
            # by the leader's lease balancing (the shared test Redis holds many jobs)
            standby = procs.coordinator("standby", "--lease-ttl", "1")
            moved = watch.wait_for(lambda d: d.latest_step == 20, 30)
            assert int(moved.epoch) > int(first.epoch)  # applied by the standby, after a takeover
            watch.wait_for(lambda d: d.job_state == "completed", 120)
        except BaseException:
            _dump(procs, tmp_path)
            raise
        assert standby.popen.poll() is None
    _check_end_state(r, job, ckpt, tmp_path)


def test_rules_parse_fire_once_and_refuse_bad_input(monkeypatch) -> None:
    plan = FaultPlan(parse("w1@3:mid_step:raise,*@5:ckpt_write:raise"))
    plan.at("w2", 3, "mid_step")  # another worker: nothing
    with pytest.raises(RuntimeError, match="w1@3:mid_step"):
        plan.at("w1", 3, "mid_step")
    plan.at("w1", 3, "mid_step")  # fired once already
    with pytest.raises(RuntimeError):
        plan.at("w9", 5, "ckpt_write")
    counted = FaultPlan(parse("checkpoint@2:before_apply:raise", COORDINATOR_PHASES))
    counted.count("checkpoint", "before_apply")
    counted.count("join", "before_apply")
    with pytest.raises(RuntimeError, match="checkpoint event #2"):
        counted.count("checkpoint", "before_apply")
    for bad in ("w1:mid_step:kill", "w1@x:mid_step:kill", "w1@1:sometime:kill", "w1@1:mid_step:explode", "w1@1:mid_step:exit=x"):
        with pytest.raises(BadFaultRule, match="bad fault rule"):
            parse(bad)
    assert set(WORKER_PHASES) >= {"mid_step", "ckpt_write", "ckpt_before_latest", "ckpt_before_event", "rendezvous"}
    assert parse("w1@0:rendezvous:sleep=0.5") == [Rule("w1", 0, "rendezvous", "sleep=0.5")]
    monkeypatch.setenv("SHOAL_COORD_FAULTS", "checkpoint@1:mid_step:kill")
    with pytest.raises(BadFaultRule):
        FaultPlan.for_coordinator()


@pytest.mark.slow
def test_a_member_slow_to_rendezvous_is_waited_for_and_nobody_restarts(r, redis_url, tmp_path) -> None:
    """w1 reaches generation 1's barrier, then stalls (alive, heartbeating) for 3 s before it
    publishes its address. The others wait for it (each store wait and connect is bounded by
    ``CONNECT_TIMEOUT_S``, 5 s, or ends when the coordinator evicts a member): generation 1
    forms, and both train on in it. (A member slower than that gets a new generation of the
    same members: the second hour-long soak's first bug was that the members retried the
    spent generation instead and every one exited; the decision is unit-tested.)"""
    job = "ph-rdzv-" + tmp_path.name[-4:]
    create_job(r, job_spec(job, SLOW_DIGITS_JOB, min_workers=2))
    watch = ControlWatcher(r, job)
    env = {"SHOAL_TEST_STEP_DELAY": "0.02", "SHOAL_LEDGER_DIR": str(tmp_path / "ledger"),
           "SHOAL_EXPORT_DIR": str(tmp_path / "final"), "SHOAL_FAULTS": "w1@0:rendezvous:sleep=3"}
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        agent = procs.start("agent", "agent", job, "--workers", "2", "--max-restarts", "0",
                            "--run-dir", str(tmp_path / "agent"))
        try:
            watch.wait_for(lambda d: "w1 active in generation 1" in d.reason, 90)
            watch.wait_for(lambda d: d.job_state == "completed", 120)
            assert agent.wait(60) == 0
        except BaseException:
            _dump(procs, tmp_path)
            raise
    assert not [d.reason for d in watch.seen if "could not form" in d.reason or (d.planned and d.generation == 2)]
    assert not [d.reason for d in watch.seen if d.failed]
    slots = "".join(f.read_text() for f in (tmp_path / "agent").glob("slot-*.log"))
    assert slots.count("fault injected: sleep=3 at w1@0:rendezvous") == 1
    verdict = ledger.verify(ledger.read(tmp_path / "ledger"), DIGITS)
    assert verdict.ok, verdict.problem
    assert verdict.steps == STEPS
    finals = [torch.load(p, weights_only=True) for p in sorted((tmp_path / "final").glob("final-*.pt"))]
    assert len(finals) == 2 and all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


@pytest.mark.slow
def test_a_lone_worker_frozen_past_its_ttl_commits_nothing_once_declared_failed(r, redis_url, tmp_path) -> None:
    """w0 trains alone (no collective can fence it) and freezes mid-step for twice its TTL.
    The coordinator declares it failed meanwhile. When it wakes it is past every check of
    its loop, one step from applying an update: the commit fence must refuse that step, so
    no step is committed by a worker the coordinator no longer counts. Then it rejoins, with
    its state, as a new member, and finishes the job."""
    job = "ph-fence-" + tmp_path.name[-4:]
    create_job(r, job_spec(job, SLOW_DIGITS_JOB, max_workers=1))
    watch = ControlWatcher(r, job)
    env = {"SHOAL_TEST_STEP_DELAY": "0.02", "SHOAL_LEDGER_DIR": str(tmp_path / "ledger"),
           "SHOAL_FAULTS": "w0@20:mid_step:stop=3"}
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        worker = procs.worker(job, "w0")
        try:
            failed = watch.wait_for(lambda d: d.reason.startswith("w0 failed (rank 0): no heartbeat"), 90)
            watch.wait_for(lambda d: d.job_state == "completed", 90)
            assert worker.wait(60) == 0  # woke evicted, rejoined, finished
        except BaseException:
            _dump(procs, tmp_path)
            raise
        log = worker.log_tail(200)
    assert "fault injected: stop=3 at w0@20:mid_step" in log
    mine = [e for e in ledger.read(tmp_path / "ledger") if e["worker"] == "w0"]
    assert max(e["step"] for e in mine) == 20  # everything before the freeze, nothing after
    assert all(e["t"] * 1000 < int(failed.ts_ms) for e in mine)
    # refused by the commit fence, or aborted first: by its watcher reading the table that
    # evicted it, or by its heartbeat finding it is no longer a member (whichever thread wins)
    assert ("evicted by the coordinator (declared failed): this step is not applied" in log
            or re.search(r"all_reduce[^:]*: aborted \(generation 2 evicted w0\)", log)
            or re.search(r"all_reduce[^:]*: aborted \(this worker is no longer a member", log)), log
    assert "declared failed by the coordinator while alive" in log and "joined job " + job + " as w1" in log
    entries = ledger.read(tmp_path / "ledger")
    assert {e["pid"] for e in entries} == {mine[0]["pid"]}  # one process throughout
    verdict = ledger.verify(entries, 5000)
    assert verdict.ok, verdict.problem
