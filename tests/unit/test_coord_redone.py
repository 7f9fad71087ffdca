"""Committed steps redone (issue 13, acceptance 5): when every replica of the newest state is
lost and the job resumes from a checkpoint or from scratch, the coordinator says which steps
are committed again and counts them; a normal elastic switch and a dropped step count nothing.
Pure decisions, driven with an explicit clock (no sleeping)."""

from __future__ import annotations

import json

from shoal.coordinator.decide import SETTLE_MS, EventInput, Publish, Tick, decide, restore_point
from shoal.coordinator.persist import control_entry
from shoal.coordinator.redone import StepSeen
from shoal.events.streams import ControlEntry
from shoal.coordinator.loop import _steps_seen
from shoal.coordinator.states import CoordState
from shoal.events.records import JobStatus
from shoal.events.states import JobState, WorkerState
from shoal.core.jobspec import JobSpec
from shoal.events.models import (
    Checkpointed,
    Heartbeat,
    JobCompleted,
    JoinRequest,
    Ready,
    StepFailed,
    WorkerExited,
    decode_event,
)
from shoal.ops.status import format_status

SPEC = JobSpec(name="j", entrypoint="simulate", min_workers=1, max_workers=2, global_batch_size=10,
               heartbeat_ttl=2.0, heartbeat_interval=0.5)
T0 = 1_000_000


def _ev(event, sid="1-0"):
    return EventInput(sid, event)


def _tables(d):
    return [a.table for a in d.actions if isinstance(a, Publish)]


def _join(state, now):
    return decide(state, _ev(JoinRequest(job_id="j", host="h", pid=1)), now, SPEC).state


def _ready(state, wid, now, step):
    return decide(state, _ev(Ready(job_id="j", worker_id=wid, generation=state.status.generation, step=step)), now, SPEC)


def _two_active(now=T0):
    """w0 and w1 in generation 1 (max_workers reached: planned at once), both Active at step 0."""
    s = _join(_join(CoordState(), now), now + 1)
    assert s.status.generation == 1 and s.status.state == JobState.RUNNING
    s = _ready(s, "w0", now + 2, 0).state
    return _ready(s, "w1", now + 3, 0).state


def _heartbeats(state, now, **steps):
    """A tick whose progress sample saw each worker at (generation, step)."""
    return decide(state, Tick(steps={w: StepSeen(g, n) for w, (g, n) in steps.items()}), now, SPEC)


def _lose_everyone(state, now):
    """Both members SIGKILLed (their agent reports each), then two replacements join and form
    the next generation; returns it, not yet ready."""
    for i, wid in enumerate(("w0", "w1")):
        state = decide(state, _ev(WorkerExited(job_id="j", worker_id=wid, signal=9, will_restart=True)), now + i, SPEC).state
    assert all(r.state == WorkerState.FAILED for r in state.workers.values())
    state = _join(_join(state, now + 100), now + 101)
    assert state.status.state == JobState.RUNNING and state.workers["w2"].state == WorkerState.SYNCING
    return state


def test_all_replicas_lost_and_no_checkpoint_redone_steps_are_said_counted_and_in_the_summary() -> None:
    s = _two_active()
    d = _heartbeats(s, T0 + 1000, w0=(1, 19), w1=(1, 20))
    assert not d.changed  # a higher step is kept in the status, with no decision of its own
    s = d.state
    assert (s.status.high_step, s.status.high_step_generation) == (20, 1)
    s = _lose_everyone(s, T0 + 2000)
    gen = s.status.generation
    d = _ready(s, "w2", T0 + 3000, 0)  # the replacements start from scratch
    assert d.changed and d.state.workers["w2"].state == WorkerState.ACTIVE
    said = f"generation {gen} resumed at step 0 (from scratch): steps 1-20, committed before, are redone"
    assert said in d.reason
    assert said in d.state.status.reason  # what `shoal status` shows as the job's reason
    assert d.state.status.steps_redone == 20
    assert (d.state.status.high_step, d.state.status.high_step_generation) == (0, gen)
    # the other member of the same generation resumes at the same step: counted once
    d = _ready(d.state, "w3", T0 + 3001, 0)
    assert d.state.status.steps_redone == 20 and "redone" not in d.reason
    # the job goes on past the old high step and completes: not silently
    s = _heartbeats(d.state, T0 + 8000, w2=(gen, 40), w3=(gen, 40)).state
    d = decide(s, _ev(JobCompleted(job_id="j", worker_id="w2", step=60, summary={"step": 60, "digest": "ab"})), T0 + 9000, SPEC)
    assert d.state.status.state == JobState.COMPLETED
    assert d.reason == d.state.status.reason
    assert "completed at step 60 (reported by w2); 20 committed steps were redone" in d.reason
    assert d.state.status.summary == {"step": 60, "digest": "ab", "steps_redone": 20}
    # and it is stored: the state hash round-trips it
    again = JobStatus.from_hash({k.encode(): v.encode() for k, v in d.state.status.to_hash().items()})
    assert again == d.state.status and again.steps_redone == 20


def test_resuming_from_a_checkpoint_redoes_the_steps_after_it_and_a_second_loss_adds_up() -> None:
    s = _two_active()
    d = decide(s, _ev(Checkpointed(job_id="j", worker_id="w0", step=10, store="file:///c", generation=1)), T0 + 500, SPEC)
    assert d.state.status.high_step == 10 and d.state.status.latest_step == 10
    # its control entry names the step as a typed field (readers never parse the reason)
    entry = control_entry(d, kind="checkpoint", source_id="1-0", now_ms=T0 + 500, epoch=1)
    assert entry.latest_step == 10 and ControlEntry.from_fields(entry.to_fields()).latest_step == 10
    s = _heartbeats(d.state, T0 + 1000, w0=(1, 25), w1=(1, 25)).state
    s = _lose_everyone(s, T0 + 2000)
    gen = s.status.generation
    d = _ready(s, "w2", T0 + 3000, 10)
    assert f"generation {gen} resumed at step 10 (from the checkpoint of step 10): steps 11-25" in d.reason
    assert d.state.status.steps_redone == 15
    s = _ready(d.state, "w3", T0 + 3001, 10).state
    # the late checkpoint event of a lost generation does not raise the new line's high step
    d = decide(s, _ev(Checkpointed(job_id="j", worker_id="w0", step=20, store="file:///c", generation=1)), T0 + 3100, SPEC)
    assert d.state.status.high_step == 10 and d.state.status.latest_step == 20
    assert control_entry(d, kind="checkpoint", source_id="2-0", now_ms=T0 + 3100, epoch=1).latest_step == 20
    assert control_entry(_ready(s, "w9", T0 + 3200, 10), kind="ready", source_id="3-0", now_ms=0, epoch=1).latest_step is None
    # lost again at 18: steps 11-18 are committed a third time, from the checkpoint of step 10
    s = _heartbeats(d.state, T0 + 4000, w2=(gen, 18), w3=(gen, 18)).state
    for i, wid in enumerate(("w2", "w3")):
        s = decide(s, _ev(WorkerExited(job_id="j", worker_id=wid, signal=9)), T0 + 5000 + i, SPEC).state
    s = _join(_join(s, T0 + 5100), T0 + 5101)
    d = _ready(s, "w4", T0 + 6000, 10)
    assert "steps 11-18, committed before, are redone" in d.reason and "(from a checkpoint)" in d.reason
    assert d.state.status.steps_redone == 15 + 8


def _one_active_and_a_joiner(checkpoint: int | None):
    """w0 Active in generation 1 (at step 25 by its heartbeat, with a checkpoint of ``checkpoint``),
    then w1 joins: generation 2 of both, w1 Syncing (its catch-up from w0 under way)."""
    s = _join(CoordState(), T0)
    s = decide(s, Tick(), T0 + SETTLE_MS, SPEC).state
    s = _ready(s, "w0", T0 + SETTLE_MS + 1, 0).state
    if checkpoint is not None:
        s = decide(s, _ev(Checkpointed(job_id="j", worker_id="w0", step=checkpoint, store="file:///c", generation=1)),
                   T0 + 500, SPEC).state
    s = _heartbeats(s, T0 + 1000, w0=(1, 25)).state
    d = decide(s, _ev(JoinRequest(job_id="j", host="h", pid=2)), T0 + 2000, SPEC)  # max_workers: planned at once
    (t,) = _tables(d)
    assert t.world_size == 2 and t.restore_step is None  # w0 holds the job's state: w1 catches up from it
    assert d.state.workers["w1"].state == WorkerState.SYNCING
    return d.state


def test_a_joiner_whose_only_source_is_lost_mid_transfer_gets_a_generation_from_the_latest_checkpoint() -> None:
    """Issue 38: the only member holding the job's state dies while the joiner receives it. The
    generation of the joiner alone starts from LATEST, said in the reason and as typed fields
    (the table's ``restore_step``, the control entry's ``restored_from``); the joiner's ready
    at that step then counts the steps after it as redone."""
    s = _one_active_and_a_joiner(checkpoint=20)
    d = decide(s, _ev(WorkerExited(job_id="j", worker_id="w0", signal=9)), T0 + 3000, SPEC)
    (t,) = _tables(d)
    gen = t.generation
    assert t.world_size == 1 and t.restore_step == 20
    (change,) = [a.change for a in d.actions if isinstance(a, Publish)]
    assert change.restored_from == 20 and change.fields()["restored_from"] == 20 and change.removed == ("w0",)
    assert (f"no member holds the job's state (every member that held it was lost): generation {gen} starts from "
            "the checkpoint of step 20") in d.reason
    d = _ready(d.state, "w1", T0 + 4000, 20)
    assert f"generation {gen} resumed at step 20 (from the checkpoint of step 20): steps 21-25" in d.reason
    assert d.state.status.steps_redone == 5


def test_no_generation_from_a_checkpoint_while_a_member_holds_the_state_or_there_is_none() -> None:
    # no checkpoint: the joiner's own state (from scratch), as before
    s = _one_active_and_a_joiner(checkpoint=None)
    (t,) = _tables(decide(s, _ev(WorkerExited(job_id="j", worker_id="w0", signal=9)), T0 + 3000, SPEC))
    assert t.restore_step is None
    # an Active member among the generation's: it carries the state on
    s = _one_active_and_a_joiner(checkpoint=20)
    assert restore_point(s, ["w0", "w1"]) is None and restore_point(s, ["w1"]) == 20
    # a job's first generation: nobody Active, nothing committed yet
    s = _join(_join(CoordState(), T0), T0 + 1)
    assert s.status.generation == 1 and restore_point(s, ["w0", "w1"]) is None


def test_a_normal_elastic_switch_never_counts_steps_redone() -> None:
    """A survivor keeps its state; a joiner catches up from it and reports the same step, even
    when the survivor's first step in the new generation was sampled before that ready."""
    s = _two_active()
    s = _heartbeats(s, T0 + 1000, w0=(1, 30), w1=(1, 30)).state
    s = decide(s, _ev(WorkerExited(job_id="j", worker_id="w1", signal=9)), T0 + 1100, SPEC).state
    assert s.status.generation == 2  # w0 alone, from its own state
    s = _join(s, T0 + 1200)
    gen = s.status.generation
    assert gen == 3 and s.workers["w2"].state == WorkerState.SYNCING
    # the survivor already committed step 31 in generation 3 when the joiner's ready arrives
    s = _heartbeats(s, T0 + 1300, w0=(gen, 31)).state
    d = _ready(s, "w2", T0 + 1400, 30)
    assert d.state.workers["w2"].state == WorkerState.ACTIVE
    assert d.state.status.steps_redone == 0 and "redone" not in d.reason
    assert d.state.status.high_step == 31


def test_a_dropped_step_was_never_committed_and_is_not_counted() -> None:
    s = _two_active()
    s = _heartbeats(s, T0 + 1000, w0=(1, 20), w1=(1, 20)).state
    # step 21 fails everywhere (a slow peer): the same members get generation 2 and redo it
    s = decide(s, _ev(StepFailed(job_id="j", worker_id="w0", generation=1, step=20, error="timed out")), T0 + 1100, SPEC).state
    d = decide(s, Tick(), T0 + 1100 + SETTLE_MS, SPEC)
    assert [t.generation for t in _tables(d)] == [2]
    s = d.state
    for wid in ("w0", "w1"):  # survivors: their ready is ignored (they are Active)
        s = _ready(s, wid, T0 + 1500, 20).state
    # one of them dies mid-step; its replacement catches up from the other at step 20
    s = decide(s, _ev(WorkerExited(job_id="j", worker_id="w1", signal=9)), T0 + 2000, SPEC).state
    s = _join(s, T0 + 2100)
    d = _ready(s, "w2", T0 + 2200, 20)
    assert d.state.status.steps_redone == 0 and "redone" not in d.reason
    d = decide(d.state, _ev(JobCompleted(job_id="j", worker_id="w0", step=60, summary={"step": 60})), T0 + 9000, SPEC)
    assert d.reason == "completed at step 60 (reported by w0)"
    assert d.state.status.summary == {"step": 60}  # no steps_redone key when none


def test_a_ready_without_a_step_infers_nothing_and_old_records_parse() -> None:
    s = _two_active()
    s = _heartbeats(s, T0 + 1000, w0=(1, 20), w1=(1, 20)).state
    s = _lose_everyone(s, T0 + 2000)
    # a sender that predates the field: the event parses, and nothing is counted
    raw = {b"data": json.dumps({"kind": "ready", "job_id": "j", "worker_id": "w2", "generation": s.status.generation}).encode()}
    old = decode_event(raw, expected_job="j")
    assert isinstance(old, Ready) and old.step is None
    d = decide(s, _ev(old), T0 + 3000, SPEC)
    assert d.state.workers["w2"].state == WorkerState.ACTIVE and d.state.status.steps_redone == 0
    # a state hash written before the fields existed
    st = JobStatus.from_hash({b"state": b"running", b"generation": b"3"})
    assert (st.high_step, st.high_step_generation, st.steps_redone) == (0, 0, 0)


def test_the_loop_samples_committed_steps_from_heartbeats_through_their_model() -> None:
    hb = Heartbeat(worker_id="w0", step=12, generation=3, step_time=0.1).model_dump_json()
    at_zero = Heartbeat(worker_id="w1", step=0, generation=3).model_dump_json()
    assert _steps_seen([hb, at_zero, None, b"{not json"]) == {"w0": StepSeen(3, 12)}
    assert _steps_seen(None) == {}


def test_status_shows_steps_redone_only_when_there_are_some() -> None:
    base = {"job_id": "j", "state": "completed", "generation": 4, "world_size": 2, "reason": "done",
            "first_failure": "", "first_failure_traceback": "", "failures": 0, "dead_letters": 0,
            "leader": "c", "epoch": 1, "workers": [], "steps_redone": 0,
            "progress": {"step": 5, "total_steps": None, "epoch": None, "percent": None, "steps_per_s": None,
                         "eta_s": None}}
    assert "steps redone" not in format_status(base)
    assert "steps redone: 20 (committed, then lost with every replica" in format_status({**base, "steps_redone": 20})


def test_one_step_redone_is_said_in_the_singular() -> None:
    s = _two_active()
    s = decide(s, _ev(Checkpointed(job_id="j", worker_id="w0", step=10, store="file:///c", generation=1)), T0 + 500, SPEC).state
    s = _lose_everyone(_heartbeats(s, T0 + 1000, w0=(1, 11)).state, T0 + 2000)
    d = _ready(s, "w2", T0 + 3000, 10)
    assert "(from the checkpoint of step 10): step 11, committed before, is redone (every replica that held it was lost)" in d.reason
    d = decide(d.state, _ev(JobCompleted(job_id="j", worker_id="w2", step=60)), T0 + 9000, SPEC)
    assert d.reason.endswith("; 1 committed step was redone (every replica that held it was lost)")
