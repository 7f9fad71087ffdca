"""The coordinator's pure decisions, driven with an explicit clock (no sleeping)."""

from __future__ import annotations

import json

import pytest

from shoal.coordinator.decide import SETTLE_MS, EventInput, Forget, Publish, RecordFailure, ReplyJoin, Tick, decide
from shoal.coordinator.states import CoordState
from shoal.events.records import WorkerRecord
from shoal.events.states import FailureCause, IllegalTransition, JobState, WorkerState
from shoal.events.exits import WorkerExit
from shoal.events.models import JoinRequest, LeaveRequest, Left, Ready, StopJob, WorkerExited
from shoal.core.jobspec import JobSpec

SPEC = JobSpec(name="j", entrypoint="simulate", min_workers=2, max_workers=3, global_batch_size=10, heartbeat_ttl=2.0, heartbeat_interval=0.5)
T0 = 1_000_000


def _ev(event, sid="1-0"):
    return EventInput(sid, event)


def join(state, now, spec=SPEC):
    d = decide(state, _ev(JoinRequest(job_id="j", host="h", pid=1)), now, spec)
    return d


def three_workers(spec=SPEC):
    s = CoordState()
    for i in range(3):
        s = join(s, T0 + i, spec).state
    return s


def tables(d):
    return [a.table for a in d.actions if isinstance(a, Publish)]


def test_three_joins_make_exactly_one_generation_and_a_fourth_is_rejected() -> None:
    s = CoordState()
    published = []
    for i in range(3):
        d = join(s, T0 + i)
        published += tables(d)
        s = d.state
    assert len(published) == 1  # settled: one generation, not three
    t = published[0]
    assert (t.generation, t.world_size) == (1, 3)
    assert sorted(i for m in t.members for s0, e, st in m.ranges for i in range(s0, e, st)) == list(range(10))
    d = join(s, T0 + 10)
    reply = [a for a in d.actions if isinstance(a, ReplyJoin)][0].reply
    assert not reply.accepted and "max_workers=3" in reply.reason
    assert len(d.state.workers) == 3
    # counted in the job's record, with who came and why it was refused (shoal status)
    assert d.state.status.rejected_joins == 1 and d.state.status.last_rejection == (
        "h pid 1: job already has 3 workers (max_workers=3)")


def test_a_worker_that_comes_after_the_job_ended_is_refused_and_counted() -> None:
    s = decide(three_workers(), _ev(StopJob(job_id="j")), T0 + 100, SPEC).state
    assert s.status.state == JobState.STOPPED
    for n in (1, 2):
        d = decide(s, _ev(JoinRequest(job_id="j", host="late", pid=9, node="n2"), f"{n + 1}-0"), T0 + 200, SPEC)
        [reply] = [a.reply for a in d.actions if isinstance(a, ReplyJoin)]
        assert not reply.accepted and reply.reason == "join rejected: job is stopped"
        s = d.state
        assert s.status.rejected_joins == n and s.status.last_rejection == "late pid 9 on node n2: job is stopped"
    assert s.status.state == JobState.STOPPED and len(s.workers) == 3


def test_joins_below_max_settle_on_a_tick() -> None:
    spec = SPEC.model_copy(update={"max_workers": 5})
    s = join(CoordState(), T0, spec).state
    s = join(s, T0 + 10, spec).state
    assert not tables(decide(s, Tick(), T0 + 10 + SETTLE_MS - 1, spec))
    d = decide(s, Tick(), T0 + 10 + SETTLE_MS, spec)
    assert [t.world_size for t in tables(d)] == [2]
    assert d.state.status.state == JobState.RUNNING


def test_stale_heartbeat_fails_the_worker_and_replans_at_once() -> None:
    s = three_workers()
    ttl = 2000
    d = decide(s, Tick(last_seen={"w1": T0}), T0 + ttl, SPEC)  # exactly ttl: not yet
    assert not d.changed
    d = decide(s, Tick(last_seen={"w1": T0}), T0 + ttl + 1, SPEC)
    assert d.state.workers["w1"].state == WorkerState.FAILED
    assert Forget("w1") in d.actions
    (t,) = tables(d)
    assert t.generation == 2 and [m.worker_id for m in t.members] == ["w0", "w2"]
    assert "no heartbeat" in d.reason and d.state.status.first_failure.startswith("w1 failed (rank 1): no heartbeat")
    (rec,) = [a for a in d.actions if isinstance(a, RecordFailure)]
    assert (rec.worker_id, rec.rank, rec.exit_code, rec.traceback) == ("w1", 1, None, "")


def test_sigterm_drains_then_leaves_without_failure() -> None:
    s = three_workers()
    d = decide(s, _ev(LeaveRequest(job_id="j", worker_id="w2")), T0 + 5, SPEC)
    assert d.state.workers["w2"].state == WorkerState.DRAINING
    assert [m.worker_id for m in tables(d)[0].members] == ["w0", "w1"]
    d = decide(d.state, _ev(Left(job_id="j", worker_id="w2")), T0 + 6, SPEC)
    assert d.state.workers["w2"].state == WorkerState.LEFT
    assert not tables(d)  # membership of the plan did not change again
    assert all(w.state != WorkerState.FAILED for w in d.state.workers.values())


def test_below_min_workers_pauses_and_a_join_resumes() -> None:
    s = three_workers()
    s = decide(s, Tick(last_seen={"w0": T0}), T0 + 5000, SPEC).state
    d = decide(s, Tick(last_seen={"w1": T0}), T0 + 5001, SPEC)
    assert d.state.status.state == JobState.PAUSED
    (t,) = tables(d)
    assert t.paused and t.members == []
    d = join(d.state, T0 + 6000)
    d = decide(d.state, Tick(), T0 + 6000 + SETTLE_MS, SPEC)
    assert d.state.status.state == JobState.RUNNING
    assert [m.worker_id for m in tables(d)[0].members] == ["w2", "w3"]


def test_ready_moves_syncing_to_active_only_for_the_current_generation() -> None:
    s = three_workers()
    d = decide(s, _ev(Ready(job_id="j", worker_id="w0", generation=0)), T0 + 5, SPEC)
    assert not d.changed and "generation 0 ignored" in d.reason
    d = decide(s, _ev(Ready(job_id="j", worker_id="w0", generation=1)), T0 + 5, SPEC)
    assert d.state.workers["w0"].state == WorkerState.ACTIVE


def test_agent_reported_exit_fails_at_once_with_the_root_cause() -> None:
    s = three_workers()
    d = decide(s, _ev(WorkerExited(job_id="j", worker_id="w0", exit_code=3, traceback="Traceback...\nRuntimeError: boom")), T0 + 5, SPEC)
    assert d.state.workers["w0"].state == WorkerState.FAILED
    assert "exit code 3" in d.state.status.first_failure and "RuntimeError: boom" in d.state.status.first_failure
    assert tables(d)[0].world_size == 2


def test_unknown_worker_and_terminal_job_are_no_ops_with_reasons() -> None:
    s = three_workers()
    d = decide(s, _ev(Left(job_id="j", worker_id="w99")), T0, SPEC)
    assert not d.changed and "unknown worker" in d.reason
    d = decide(s, _ev(StopJob(job_id="j")), T0, SPEC)
    assert d.state.status.state == JobState.STOPPED
    d = join(d.state, T0 + 1)
    assert "job is stopped" in d.reason


def test_state_tables_refuse_illegal_moves() -> None:
    rec = WorkerRecord("w0", WorkerState.LEFT, joined_ms=0)
    with pytest.raises(IllegalTransition):
        rec.moved(WorkerState.ACTIVE, "x", 1)


def test_stragglers_are_flagged_against_the_median() -> None:
    s = three_workers()
    for w in ("w0", "w1", "w2"):
        s = decide(s, _ev(Ready(job_id="j", worker_id=w, generation=1)), T0 + 5, SPEC).state
    d = decide(s, Tick(step_times={"w0": 0.1, "w1": 0.11, "w2": 0.5}), T0 + 10, SPEC)
    assert d.state.workers["w2"].straggler and not d.state.workers["w0"].straggler
    assert "w2 straggler" in d.reason
    d2 = decide(d.state, Tick(step_times={"w0": 0.1, "w1": 0.11, "w2": 0.5}), T0 + 20, SPEC)
    assert not d2.changed  # logged only when it changes
    # twice the median but only 4 ms slower: noise, not a straggler
    d3 = decide(s, Tick(step_times={"w0": 0.004, "w1": 0.004, "w2": 0.008}), T0 + 10, SPEC)
    assert not d3.state.workers["w2"].straggler


def test_agent_report_after_a_heartbeat_timeout_becomes_the_root_cause() -> None:
    s = three_workers()
    s = decide(s, Tick(last_seen={"w0": T0}), T0 + 5000, SPEC).state
    assert "no heartbeat" in s.status.first_failure
    d = decide(s, _ev(WorkerExited(job_id="j", worker_id="w0", exit_code=1, traceback="x\nValueError: bad")), T0 + 5001, SPEC)
    # the rank is the one w0 held when the heartbeat timeout failed it
    assert d.state.status.first_failure == "w0 failed (rank 0): process ended with exit code 1 (ValueError: bad)"
    assert d.state.status.first_failure_traceback == "x\nValueError: bad"
    assert d.state.workers["w0"].state == WorkerState.FAILED
    assert RecordFailure("w0", 0, d.state.status.first_failure, 1, None, "x\nValueError: bad") in d.actions


def test_first_failure_keeps_rank_exit_code_and_traceback_and_later_ones_do_not_replace_it() -> None:
    s = three_workers()
    tb = "Traceback (most recent call last):\n  File \"train.py\", line 3, in step\nRuntimeError: boom"
    d = decide(s, _ev(WorkerExited(job_id="j", worker_id="w2", exit_code=7, traceback=tb)), T0, SPEC)
    assert d.state.status.first_failure == "w2 failed (rank 2): process ended with exit code 7 (RuntimeError: boom)"
    assert d.state.status.first_failure_traceback == tb
    assert RecordFailure("w2", 2, d.state.status.first_failure, 7, None, tb) in d.actions
    # a later failure, by signal, is recorded in the history but is not the root cause
    d2 = decide(d.state, _ev(WorkerExited(job_id="j", worker_id="w0", signal=9)), T0 + 1, SPEC)
    assert d2.state.status.first_failure == d.state.status.first_failure
    assert d2.state.status.first_failure_traceback == tb
    assert RecordFailure("w0", 0, "w0 failed (rank 0): process ended with signal 9", None, 9, "") in d2.actions


def test_latest_pointer_only_moves_forward() -> None:
    from shoal.events.models import Checkpointed
    from shoal.storage.latest import LatestPointer

    s = three_workers()
    d = decide(s, _ev(Checkpointed(job_id="j", worker_id="w0", step=20, store="file:///c", generation=1)), T0, SPEC)
    (act,) = d.actions
    assert LatestPointer.from_json(act.pointer_json) == LatestPointer(step=20, store="file:///c", generation=1)
    d2 = decide(d.state, _ev(Checkpointed(job_id="j", worker_id="w0", step=10, store="file:///c")), T0, SPEC)
    assert not d2.changed and not d2.actions and "LATEST is at step 20" in d2.reason


def test_an_exit_report_after_a_later_heartbeat_timeout_is_recorded_not_promoted() -> None:
    s = three_workers()
    s = decide(s, _ev(WorkerExited(job_id="j", worker_id="w2", exit_code=3)), T0, SPEC).state
    first = s.status.first_failure
    s = decide(s, Tick(last_seen={"w1": T0}), T0 + 5000, SPEC).state  # w1 times out: rank 1 of [w0, w1]
    d = decide(s, _ev(WorkerExited(job_id="j", worker_id="w1", signal=11, traceback="Fatal Python error")), T0 + 5001, SPEC)
    assert d.state.status.first_failure == first  # w2's exit stays the root cause
    assert d.state.workers["w1"].reason == "w1 failed (rank 1): process ended with signal 11 (Fatal Python error)"
    assert RecordFailure("w1", 1, d.state.workers["w1"].reason, None, 11, "Fatal Python error") in d.actions


def test_a_generation_that_could_not_form_is_replaced_by_a_new_one_of_the_same_members() -> None:
    from shoal.events.models import StepFailed

    s = three_workers()
    gen = s.status.generation
    # the group could not form: its prefix is spent, so the same members get a new generation
    bad = StepFailed(job_id="j", worker_id="w1", generation=gen, step=5, error="rendezvous timed out", rendezvous=True)
    d = decide(s, _ev(bad), T0, SPEC)
    assert not tables(d)  # after a back-off, not at once
    assert f"generation {gen} could not form (w1: rendezvous timed out)" in d.reason
    assert "new generation in 0.5 s" in d.reason and d.state.status.reason == d.reason  # shown by status meanwhile
    # the other members' reports of the same failure count nothing more
    late = StepFailed(job_id="j", worker_id="w2", generation=gen, step=5, error="rendezvous timed out", rendezvous=True)
    d2 = decide(d.state, _ev(late), T0 + 1, SPEC)
    assert not tables(d2) and d2.state.status.formation.failures == 1
    assert not tables(decide(d2.state, Tick(), T0 + 499, SPEC))
    d3 = decide(d2.state, Tick(), T0 + 500, SPEC)
    (t,) = tables(d3)
    assert t.generation == gen + 1 and [m.worker_id for m in t.members] == ["w0", "w1", "w2"]


def test_two_workers_timing_out_in_one_tick_are_recorded_with_their_own_ranks() -> None:
    s = three_workers()  # generation 1: w0 rank 0, w1 rank 1, w2 rank 2
    d = decide(s, Tick(last_seen={"w0": T0, "w1": T0}), T0 + 5000, SPEC)
    recorded = {a.worker_id: a for a in d.actions if isinstance(a, RecordFailure)}
    assert {w: a.rank for w, a in recorded.items()} == {"w0": 0, "w1": 1}
    assert recorded["w0"].reason == "w0 failed (rank 0): no heartbeat for 5000 ms (ttl 2000 ms)"
    assert recorded["w1"].reason == "w1 failed (rank 1): no heartbeat for 5000 ms (ttl 2000 ms)"
    for wid, rank in (("w0", 0), ("w1", 1)):
        rec = d.state.workers[wid]
        assert (rec.state, rec.rank, rec.cause) == (WorkerState.FAILED, rank, FailureCause.HEARTBEAT_TIMEOUT)
        assert rec.reason == recorded[wid].reason
    assert d.state.status.first_failure == recorded["w0"].reason


def _rendezvous_failed(wid: str, generation: int, error: str):
    from shoal.events.models import StepFailed

    return _ev(StepFailed(job_id="j", worker_id=wid, generation=generation, step=0, error=error, rendezvous=True))


def test_a_job_whose_generations_never_form_fails_after_formation_timeout_naming_the_last_error() -> None:
    from shoal.events.records import JobStatus

    spec = SPEC.model_copy(update={"formation_timeout": 10.0})
    s = three_workers(spec)  # generation 1 planned at T0 + 2
    planned = s.status.formation.unformed_since_ms
    assert planned == T0 + 2 and s.status.state == JobState.RUNNING
    error = ("rendezvous of generation 1 (rank 0/3): could not connect to peer 127.0.0.1:4321 (Connection refused); "
             "advertised 127.0.0.1 on lo (--iface/SHOAL_IFACE); set --iface/SHOAL_IFACE to an interface the peers reach")
    d = decide(s, _rendezvous_failed("w0", 1, error), T0 + 3000, spec)
    d = decide(d.state, Tick(), T0 + 3500, spec)  # after the back-off
    (t,) = tables(d)  # a new generation of the same members; the clock keeps running from the first
    assert t.generation == 2 and d.state.status.formation.unformed_since_ms == planned
    assert d.state.status.formation.rendezvous_error == f"w0: {error}"
    assert JobStatus.from_hash(d.state.status.to_hash()) == d.state.status
    s = d.state
    assert not decide(s, Tick(), planned + 9_999, spec).changed  # not yet
    d = decide(s, Tick(), planned + 10_000, spec)
    assert d.state.status.state == JobState.FAILED and not tables(d)
    assert d.reason == d.state.status.reason
    assert d.reason.startswith("job failed: no generation formed in 10.0 s (formation_timeout 10 s, last generation 2)")
    assert d.reason.endswith(f"last rendezvous error: w0: {error}") and "\n" not in d.reason
    # a failure reported past the deadline fails the job too, rather than planning again
    d = decide(s, _rendezvous_failed("w1", 2, "rank 1/3: peers could not connect\n(timed out)"), planned + 12_000, spec)
    assert d.state.status.state == JobState.FAILED and not tables(d)
    assert d.reason.endswith("last rendezvous error: w1: rank 1/3: peers could not connect (timed out)")


def test_a_generation_that_forms_stops_the_formation_clock_and_the_next_plan_restarts_it() -> None:
    spec = SPEC.model_copy(update={"formation_timeout": 10.0})
    s = three_workers(spec)
    s = decide(s, _rendezvous_failed("w0", 1, "refused"), T0 + 3000, spec).state
    s = decide(s, Tick(), T0 + 3500, spec).state  # generation 2
    d = decide(s, _ev(Ready(job_id="j", worker_id="w1", generation=2)), T0 + 4000, spec)
    assert (d.state.status.formation.unformed_since_ms, d.state.status.formation.rendezvous_error) == (0, "")
    assert (d.state.status.formation.failures, d.state.status.formation.retry_ms) == (0, 0)
    s = d.state
    assert not decide(s, Tick(), T0 + 1_000_000, spec).changed  # formed: no deadline
    # a failure plans generation 3: its clock starts at that plan
    d = decide(s, _ev(WorkerExited(job_id="j", worker_id="w2", exit_code=1)), T0 + 50_000, spec)
    assert d.state.status.formation.unformed_since_ms == T0 + 50_000 and tables(d)[0].generation == 3
    assert not decide(d.state, Tick(), T0 + 59_999, spec).changed
    assert decide(d.state, Tick(), T0 + 60_000, spec).state.status.state == JobState.FAILED


def test_a_paused_job_is_not_on_the_formation_clock() -> None:
    spec = SPEC.model_copy(update={"formation_timeout": 10.0})
    s = three_workers(spec)
    for i, wid in enumerate(("w1", "w2")):
        s = decide(s, _ev(WorkerExited(job_id="j", worker_id=wid, exit_code=1), f"{2 + i}-0"), T0 + 100 + i, spec).state
    assert s.status.state == JobState.PAUSED and s.status.formation.unformed_since_ms == 0
    assert decide(s, Tick(), T0 + 1_000_000, spec).state.status.state == JobState.PAUSED


def test_a_failed_step_gives_the_same_members_a_new_generation_once_the_settle_window_ends() -> None:
    """A slow peer (alive, heartbeating) made its peers' collective time out: the step is
    dropped everywhere, so the same members need a fresh generation to redo it (issue 13)."""
    from shoal.events.models import StepFailed

    s = three_workers()
    gen = s.status.generation
    d = decide(s, _ev(StepFailed(job_id="j", worker_id="w0", generation=gen, step=5, error="Timed out\nwaiting")), T0, SPEC)
    assert d.changed and not tables(d) and d.state.status.step_failed_ms == T0
    assert "step 5 of generation 1 failed on w0 (Timed out waiting)" in d.reason
    # the other members' reports of the same step plan nothing more (the progress watchdog
    # only counts who reported it)
    d = decide(d.state, _ev(StepFailed(job_id="j", worker_id="w2", generation=gen, step=5, error="x")), T0 + 10, SPEC)
    assert not d.actions and "already due" in d.reason and d.state.status.step_failed_ms == T0
    assert d.state.status.stall.reporters == {"w0": 1, "w2": 1} and d.state.status.stall.step == 5
    assert not tables(decide(d.state, Tick(), T0 + SETTLE_MS - 1, SPEC))
    d = decide(d.state, Tick(), T0 + SETTLE_MS, SPEC)
    (t,) = tables(d)
    assert t.generation == gen + 1 and [m.worker_id for m in t.members] == ["w0", "w1", "w2"]
    assert "step 5 of generation 1 failed on w0" in d.reason and "same members" in d.reason
    assert d.state.status.step_failed_ms == 0 and not d.state.status.step_failure
    assert all(r.state != WorkerState.FAILED for r in d.state.workers.values())
    # the slow member's own late report, for the old generation, is ignored
    late = decide(d.state, _ev(StepFailed(job_id="j", worker_id="w1", generation=gen, step=5, error="x")), T0 + 4000, SPEC)
    assert not late.changed and not tables(late)
    # a report from a worker that is not a member is ignored too
    s2 = CoordState()
    s2 = join(s2, T0).state
    assert not decide(s2, _ev(StepFailed(job_id="j", worker_id="w0", generation=0, step=0, error="x")), T0, SPEC).changed


def test_a_peer_that_died_is_left_out_of_the_generation_after_the_failed_step() -> None:
    """A peer that died fails its peers' collective at once, and its agent reports the exit
    moments later: one new generation without it, not one with it first."""
    from shoal.events.models import StepFailed

    s = three_workers()
    gen = s.status.generation
    d = decide(s, _ev(StepFailed(job_id="j", worker_id="w0", generation=gen, step=5, error="peer closed")), T0, SPEC)
    d = decide(d.state, _ev(WorkerExited(job_id="j", worker_id="w2", signal=9)), T0 + 20, SPEC)
    (t,) = tables(d)
    assert t.generation == gen + 1 and [m.worker_id for m in t.members] == ["w0", "w1"]
    assert not tables(decide(d.state, Tick(), T0 + SETTLE_MS + 20, SPEC))


def test_a_step_busy_past_the_step_timeout_evicts_its_worker_naming_it_and_the_table_lists_it() -> None:
    spec = SPEC.model_copy(update={"step_timeout": 3.0})
    s = three_workers(spec)  # generation 1: w0, w1, w2
    # busy 2.9 s: within the step timeout, nothing happens (a slow peer is waited for)
    d = decide(s, Tick(busy_since={"w1": T0}), T0 + 2900, spec)
    assert not d.actions and d.state.workers["w1"].state != WorkerState.FAILED
    d = decide(s, Tick(busy_since={"w1": T0}), T0 + 3500, spec)
    rec = d.state.workers["w1"]
    assert (rec.state, rec.cause, rec.rank) == (WorkerState.FAILED, FailureCause.STEP_TIMEOUT, 1)
    assert rec.reason == ("w1 failed (rank 1): step timeout: its step has been busy for 3.5 s "
                          "(step_timeout 3 s) while its heartbeat is alive")
    assert Forget("w1") in d.actions
    [table] = tables(d)
    assert [m.worker_id for m in table.members] == ["w0", "w2"]
    assert table.evicted == ["w1"]  # the survivors abort their collectives with it


def test_a_table_lists_as_evicted_only_the_workers_failed_by_that_decision() -> None:
    s = three_workers()
    d = decide(s, Tick(last_seen={"w2": T0}), T0 + 5000, SPEC)
    [table] = tables(d)
    assert table.evicted == ["w2"]
    # a drain is not an eviction: the leaver keeps stepping until it sees the new generation
    d2 = decide(d.state, _ev(LeaveRequest(job_id="j", worker_id="w1")), T0 + 6000, SPEC)
    [table2] = tables(d2)
    assert table2.evicted == []


def test_a_worker_that_dies_before_joining_is_a_failure_and_its_agent_giving_up_fails_the_job() -> None:
    from shoal.coordinator.states import CoordState as _S
    from shoal.events.models import WorkerStartFailed

    tb = "Traceback (most recent call last):\n  File \"x.py\", line 3\nshoal.core.errors.ConfigError: S3 settings missing: S3_ENDPOINT"
    s = _S()
    first = WorkerStartFailed(job_id="j", node="n1", slot=0, pid=42, exit_code=2, traceback=tb, will_restart=True)
    d = decide(s, _ev(first), T0, SPEC)
    why = ("the worker process on node n1 (slot 0, pid 42) failed before joining: process ended with exit code 2 "
           "(shoal.core.errors.ConfigError: S3 settings missing: S3_ENDPOINT); restarting it (restart 1)")
    assert d.reason == why
    assert d.state.status.first_failure == why and d.state.status.first_failure_traceback == tb
    [rec] = [a for a in d.actions if isinstance(a, RecordFailure)]
    assert (rec.worker_id, rec.rank, rec.exit_code, rec.traceback) == ("n1/slot0", -1, 2, tb)
    assert d.state.status.state == JobState.PENDING
    last = WorkerStartFailed(job_id="j", node="n1", slot=0, pid=43, exit_code=2, traceback=tb, gave_up=True, restarts=3)
    d2 = decide(d.state, _ev(last, "2-0"), T0 + 1000, SPEC)
    assert d2.state.status.state == JobState.FAILED
    assert d2.state.status.reason.startswith("job failed: n1/slot0's slot gave up after 3 restarts")
    assert d2.state.status.reason.endswith("first failure: " + why)  # the root cause, not the last attempt


def test_streaming_tables_carry_sticky_shard_owners_from_the_joins_shard_count() -> None:
    from shoal.coordinator.owners import from_ranges
    from shoal.events.records import JobStatus

    s = CoordState()
    for i in range(3):
        s = decide(s, _ev(JoinRequest(job_id="j", host="h", pid=1, num_shards=10), f"{i + 1}-0"), T0 + i, SPEC).state
    first = decide(CoordState(), _ev(JoinRequest(job_id="j", host="h", pid=1)), T0, SPEC)
    assert first.state.status.num_shards == 0  # a map-style dataset: no owners
    assert s.status.num_shards == 10
    owners = json_owners = s.status.shard_owners
    assert sorted(x for r in owners.values() for x in from_ranges(r)) == list(range(10))
    # the state survives its Redis hash (a coordinator taking the job over plans from it)
    assert JobStatus.from_hash(s.status.to_hash()) == s.status
    d = decide(s, _ev(LeaveRequest(job_id="j", worker_id="w2"), "9-0"), T0 + 5, SPEC)
    table = tables(d)[0]
    assert set(table.shard_owners) == {"w0", "w1"}
    for w in ("w0", "w1"):  # survivors keep theirs and share the leaver's
        assert set(from_ranges(json_owners[w])) <= set(from_ranges(table.shard_owners[w]))
    assert sorted(len(from_ranges(r)) for r in table.shard_owners.values()) == [5, 5]
    assert "10 shards over 2 members" in table.reason


def _change(d):
    (publish,) = [a for a in d.actions if isinstance(a, Publish)]
    c = publish.change
    return (c.world_size, c.paused, c.joined, c.removed, tuple(x.value for x in c.causes))


def test_each_new_generation_says_who_joined_and_who_was_removed_and_why() -> None:
    """The typed membership change every reader uses (the report, the dashboard, tests): never
    parsed from the reason."""
    spec = SPEC.model_copy(update={"max_workers": 4, "min_workers": 2})
    s = CoordState()
    for i in range(3):
        s = join(s, T0 + i, spec).state
    d = decide(s, Tick(), T0 + 2 + SETTLE_MS, spec)
    assert _change(d) == (3, False, ("w0", "w1", "w2"), (), ())
    d = decide(d.state, _ev(WorkerExited(job_id="j", worker_id="w1", signal=9), "2-0"), T0 + 1000, spec)
    assert _change(d) == (2, False, (), ("w1",), ("exited",))
    d = decide(d.state, _ev(LeaveRequest(job_id="j", worker_id="w2"), "3-0"), T0 + 2000, spec)
    assert _change(d) == (0, True, (), ("w2",), ("left",))  # below min_workers: paused, no members
    # w2's own exit after it drained changes nothing more; a joiner resumes the job
    s = decide(d.state, _ev(Left(job_id="j", worker_id="w2"), "4-0"), T0 + 2100, spec).state
    s = join(s, T0 + 3000, spec).state
    d = decide(s, Tick(last_seen={"w0": T0 + 2900}), T0 + 3000 + SETTLE_MS, spec)
    assert _change(d) == (2, False, ("w3",), (), ())  # w0 was a member all along: not a joiner
    d = decide(d.state, Tick(last_seen={"w0": T0}), T0 + 9000, spec)  # w0's heartbeat stops
    assert _change(d) == (0, True, (), ("w0",), ("heartbeat_timeout",))


def test_a_worker_stopped_during_an_outage_left_and_is_no_failure() -> None:
    """Exit code 77 (``shoal.worker.lifeline``): asked to stop (SIGTERM) while Redis was gone,
    it could not send its leave. It is re-planned away like a worker that left: not failed, not
    the job's first failure."""
    s = decide(three_workers(), _ev(Ready(job_id="j", worker_id="w0", generation=1)), T0 + 1, SPEC).state
    assert s.workers["w0"].state == WorkerState.ACTIVE  # and w1, w2 Syncing: both ways to Left
    d = decide(s, _ev(WorkerExited(job_id="j", worker_id="w0", exit_code=WorkerExit.STOPPED_IN_OUTAGE)), T0 + 5, SPEC)
    assert d.state.workers["w0"].state == WorkerState.LEFT and tables(d)[0].world_size == 2
    d = decide(d.state, _ev(WorkerExited(job_id="j", worker_id="w2", exit_code=WorkerExit.STOPPED_IN_OUTAGE)), T0 + 5, SPEC)
    assert d.state.workers["w2"].state == WorkerState.LEFT and tables(d)[0].paused  # 1 < min_workers
    assert not d.state.status.first_failure
    d = decide(d.state, _ev(WorkerExited(job_id="j", worker_id="w1", exit_code=76)), T0 + 6, SPEC)  # an orphan's end is one
    assert d.state.workers["w1"].state == WorkerState.FAILED and "exit code 76" in d.state.status.first_failure


def test_a_worker_stopped_during_an_outage_is_no_first_failure_after_its_heartbeat_expired() -> None:
    """The race the other way: the heartbeat TTL failed it before its agent's report of exit
    77 arrived. The report takes the job's first failure back."""
    s = three_workers()
    d = decide(s, Tick(last_seen={"w0": T0}), T0 + 60_000, SPEC)
    assert d.state.workers["w0"].state == WorkerState.FAILED and d.state.status.first_failure_worker == "w0"
    d = decide(d.state, _ev(WorkerExited(job_id="j", worker_id="w0", exit_code=WorkerExit.STOPPED_IN_OUTAGE)), T0 + 60_001, SPEC)
    assert not d.state.status.first_failure and not d.state.status.first_failure_worker
    assert "asked to stop during a Redis outage" in d.state.workers["w0"].reason
