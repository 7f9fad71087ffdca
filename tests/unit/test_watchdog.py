"""The progress watchdog's decisions (``coordinator/watchdog.py`` through ``decide``), with an
explicit clock: generations of the same members that keep failing one step are counted, a
membership change is not, the members that gave the step up themselves are restarted (cause
``stuck``) once the spell passes its bounds, then the job fails naming the step, the members
and the error; a commit beyond the step ends the spell."""

from __future__ import annotations

from shoal.coordinator import watchdog
from shoal.coordinator.decide import SETTLE_MS, Tick, decide
from shoal.coordinator.redone import StepSeen
from shoal.events.models import StepFailed, WorkerExited
from shoal.events.states import FailureCause, JobState, WorkerState
from tests.unit.test_decide import SPEC, T0, _ev, join, tables, three_workers


def _round(s, now: int, step: int = 7, culprit: str = "w1", others=("w0", "w2")):
    """One generation of the churn: the culprit gives ``step`` up itself, its peers fail with
    it; the same members get a new generation once the settle window passed."""
    gen = s.status.generation
    d = decide(s, _ev(StepFailed(job_id="j", worker_id=culprit, generation=gen, step=step, error="aborted (old)",
                                 local=True)), now, SPEC)
    for i, w in enumerate(others):
        d = decide(d.state, _ev(StepFailed(job_id="j", worker_id=w, generation=gen, step=step,
                                           error="connection closed by peer")), now + 1 + i, SPEC)
    return decide(d.state, Tick(), now + SETTLE_MS, SPEC)


def test_the_same_members_failing_one_step_are_counted_and_the_culprit_restarted_past_the_bounds() -> None:
    s = three_workers()
    now = T0 + 1000
    for n in range(1, watchdog.STALL_GENERATIONS):
        d = _round(s, now)
        (t,) = tables(d)  # the same members, again
        assert [m.worker_id for m in t.members] == ["w0", "w1", "w2"]
        assert d.state.status.stall.generations == n and d.state.status.stall.step == 7
        s, now = d.state, now + 500
    # K generations, but within the time bound: the same members once more
    d = _round(s, now)
    assert d.state.status.stall.generations == watchdog.STALL_GENERATIONS
    assert now + SETTLE_MS - d.state.status.stall.since_ms < watchdog.STALL_FLOOR_MS
    assert [m.worker_id for m in tables(d)[0].members] == ["w0", "w1", "w2"]
    s = d.state
    # past the bound: only the member that gave the step up itself is restarted
    d = _round(s, T0 + 1000 + watchdog.STALL_FLOOR_MS)
    assert d.state.workers["w1"].state == WorkerState.FAILED and d.state.workers["w1"].cause == FailureCause.STUCK
    assert all(d.state.workers[w].state == WorkerState.ACTIVE or d.state.workers[w].state == WorkerState.SYNCING
               for w in ("w0", "w2"))
    (t,) = tables(d)
    assert [m.worker_id for m in t.members] == ["w0", "w2"] and "w1" in t.evicted
    assert "no progress: step 7 failed in" in d.reason and "restarting w1 (stuck)" in d.reason
    assert d.state.status.stall.restarts == 1 and d.state.status.stall.generations == 0


def test_restarts_that_do_not_help_fail_the_job_naming_the_step_the_members_and_the_error() -> None:
    s = three_workers()
    now = T0 + 1000
    while not any(r.cause == FailureCause.STUCK for r in s.workers.values()):
        s, now = _round(s, now).state, now + 1000
    # the restarted member comes back (a new worker) and the step keeps failing
    s = join(s, now).state
    s = decide(s, Tick(), now + SETTLE_MS, SPEC).state
    assert [w for w, r in s.workers.items() if r.state in (WorkerState.SYNCING, WorkerState.ACTIVE)] == ["w0", "w2", "w3"]
    d = None
    for _ in range(watchdog.STALL_GENERATIONS + 2):
        now += 1000
        d = _round(s, now, culprit="w3", others=("w0", "w2"))
        s = d.state
        if s.status.state == JobState.FAILED:
            break
    assert s.status.state == JobState.FAILED
    assert d.reason.startswith("job failed: no progress: step 7 failed in")
    assert "given up by w3 4x itself" in d.reason and "cause: aborted (old)" in d.reason and "did not help" in d.reason


def test_a_commit_beyond_the_step_ends_the_spell_and_a_membership_change_is_not_counted() -> None:
    s = three_workers()
    s = _round(s, T0 + 1000).state
    assert s.status.stall.generations == 1
    # a crash in the next generation re-plans with other members: not counted
    gen = s.status.generation
    d = decide(s, _ev(StepFailed(job_id="j", worker_id="w0", generation=gen, step=7, error="x")), T0 + 2000, SPEC)
    d = decide(d.state, _ev(WorkerExited(job_id="j", worker_id="w2", exit_code=1)), T0 + 2001, SPEC)
    assert d.state.status.stall.generations == 1 and [m.worker_id for m in tables(d)[0].members] == ["w0", "w1"]
    # the job commits step 8: the spell is over
    d = decide(d.state, Tick(steps={"w0": StepSeen(d.state.status.generation, 8)}), T0 + 3000, SPEC)
    assert d.state.status.stall.step == -1 and d.state.status.high_step == 8 and d.state.status.high_step_ms == T0 + 3000
    # a failure at a step below the spell's belongs to it (a resume from a checkpoint below it)
    st = watchdog.step_failed(watchdog.step_failed(d.state.status.stall, 9, "w0", "e", 1), 4, "w1", "e", 2)
    assert st.step == 9 and st.reporters == {"w0": 1, "w1": 1}
