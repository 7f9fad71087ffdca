"""A group that cannot form: the back-off between generations of the same members, the
configuration errors that fail the job with their fix, and members that must agree on their
backend (coordinator/decide.py, on a simulated clock)."""

from __future__ import annotations

import pytest

from shoal.coordinator.decide import EventInput, Publish, Tick, decide
from shoal.coordinator.formation import CONFIG_STRIKES, FORMATION_BACKOFF_MAX_MS, FORMATION_BACKOFF_MS, formation_backoff_ms
from shoal.coordinator.states import CoordState
from shoal.events.records import JobStatus
from shoal.events.states import JobState
from shoal.core.jobspec import JobSpec
from shoal.events.models import FormationError, JoinRequest, Ready, StepFailed, WorkerExited

SPEC = JobSpec(name="j", entrypoint="simulate", min_workers=2, max_workers=3, global_batch_size=12,
               heartbeat_ttl=2.0, heartbeat_interval=0.5, formation_timeout=3600)
T0 = 1_000_000
NO_IFACE = "rendezvous of generation {g} (rank 0/3): interface 'nosuch0' (--iface/SHOAL_IFACE) has no IPv4 address"


def _ev(event, sid: str = "1-0") -> EventInput:
    return EventInput(sid, event)


def _members(spec: JobSpec = SPEC, **placement) -> CoordState:
    s = CoordState()
    for i in range(3):
        req = JoinRequest(job_id="j", host="h", pid=100 + i, node="n1", **placement)
        s = decide(s, _ev(req, f"{i}-1"), T0 + i, spec).state
    assert s.status.state == JobState.RUNNING and s.status.generation == 1
    return s


def _failed(s: CoordState, wid: str, now: int, kind: FormationError = FormationError.TRANSIENT,
            error: str = "peers could not connect (timed out)"):
    g = s.status.generation
    ev = StepFailed(job_id="j", worker_id=wid, generation=g, step=0, error=error.format(g=g), rendezvous=True,
                    formation_error=kind.value)
    return decide(s, _ev(ev, f"{now}-0"), now, SPEC)


def _tables(d) -> list:
    return [a.table for a in d.actions if isinstance(a, Publish)]


def test_the_back_off_doubles_from_half_a_second_up_to_ten() -> None:
    assert [formation_backoff_ms(n) for n in range(1, 8)] == [500, 1000, 2000, 4000, 8000, 10_000, 10_000]
    assert formation_backoff_ms(1) == FORMATION_BACKOFF_MS and formation_backoff_ms(100) == FORMATION_BACKOFF_MAX_MS


def test_a_group_that_never_forms_costs_at_most_ten_generations_a_minute() -> None:
    """Every generation fails the moment it is planned (the worst case: no time spent
    forming); the coordinator is ticked every 100 ms for 5 minutes."""
    s = _members()
    planned = [T0]  # generation 1
    now = T0
    while now < T0 + 300_000:
        now += 100
        if s.status.formation.failed_generation != s.status.generation:
            s = _failed(s, "w0", now).state
        d = decide(s, Tick(), now, SPEC)
        s = d.state
        planned += [now] * len(_tables(d))
    assert s.status.state == JobState.RUNNING  # transient failures never fail the job (formation_timeout does)
    worst = max(sum(1 for t in planned if start <= t < start + 60_000) for start in planned)
    print(f"{len(planned)} generations in 5 minutes, at most {worst} in any minute")
    assert worst <= 10 and len(planned) >= 30


def test_three_generations_in_a_row_with_the_same_configuration_error_fail_the_job_naming_the_fix() -> None:
    s = _members()
    kind = FormationError.NO_INTERFACE_ADDRESS
    now = T0 + 1000
    for strike in range(1, CONFIG_STRIKES):
        d = _failed(s, "w0", now, kind, NO_IFACE)
        assert f"configuration error no_interface_address ({strike} of {CONFIG_STRIKES} in a row fail the job)" in d.reason
        d = _failed(d.state, "w1", now + 1, kind, NO_IFACE)  # the other member's report: counted once
        assert d.state.status.formation.strikes == strike
        now += formation_backoff_ms(strike)
        d = decide(d.state, Tick(), now, SPEC)
        assert len(_tables(d)) == 1
        s = d.state
    d = _failed(s, "w1", now + 5, kind, NO_IFACE)
    assert d.state.status.state == JobState.FAILED and not _tables(d)
    reason = d.state.status.reason
    assert reason == d.reason and "\n" not in reason
    assert reason.startswith(f"job failed: generation 3 could not form, {CONFIG_STRIKES} generations in a row")
    assert "interface 'nosuch0'" in reason and "(no_interface_address)" in reason
    assert "fix: name an interface that has an IPv4 address here with --iface" in reason
    assert JobStatus.from_hash(d.state.status.to_hash()) == d.state.status


def test_a_transient_failure_between_configuration_errors_neither_counts_nor_resets_and_another_error_restarts() -> None:
    s = _members()
    kind = FormationError.CUDA_OUT_OF_MEMORY
    now = T0 + 1000
    sequence = [kind, FormationError.TRANSIENT, kind, FormationError.NO_DEVICE, kind, kind]
    strikes = []
    for k in sequence:
        d = _failed(s, "w2", now, k, "CUDA out of memory" if k == kind else "boom")
        assert d.state.status.state == JobState.RUNNING, (k, d.reason)
        strikes.append(d.state.status.formation.strikes)
        now += FORMATION_BACKOFF_MAX_MS
        s = decide(d.state, Tick(), now, SPEC).state
    assert strikes == [1, 1, 2, 1, 1, 2]
    d = _failed(s, "w2", now, kind, "CUDA out of memory")
    assert d.state.status.state == JobState.FAILED and "fix: free GPU memory" in d.reason


def test_a_configuration_error_reported_after_a_transient_one_of_the_same_generation_still_counts() -> None:
    s = _members()
    d = _failed(s, "w1", T0 + 1000)  # w1 timed out waiting for the broken member
    d = _failed(d.state, "w0", T0 + 1001, FormationError.NO_INTERFACE_ADDRESS, NO_IFACE)
    assert (d.state.status.formation.failures, d.state.status.formation.strikes) == (1, 1)


def test_new_members_start_the_count_over_and_a_formed_generation_clears_it() -> None:
    s = _members()
    kind = FormationError.NO_DEVICE
    now = T0 + 1000
    for _ in range(CONFIG_STRIKES - 1):
        s = _failed(s, "w0", now, kind, "invalid device ordinal").state
        now += FORMATION_BACKOFF_MAX_MS
        s = decide(s, Tick(), now, SPEC).state
    d = decide(s, _ev(WorkerExited(job_id="j", worker_id="w2", exit_code=1), "9-0"), now, SPEC)  # re-planned at once
    assert len(_tables(d)) == 1
    d = _failed(d.state, "w0", now + 1, kind, "invalid device ordinal")
    assert d.state.status.state == JobState.RUNNING and d.state.status.formation.strikes == 1
    assert d.state.status.formation.failures == 1 and "new generation in 0.5 s" in d.reason
    s = decide(d.state, Tick(), now + 501, SPEC).state
    s = decide(s, _ev(Ready(job_id="j", worker_id="w0", generation=s.status.generation), "10-0"), now + 600, SPEC).state
    st = s.status
    assert (st.formation.failures, st.formation.strikes, st.formation.config_error, st.formation.retry_ms) == (0, 0, "", 0)


def test_nccl_invalid_usage_names_the_shared_gpu_in_the_fix() -> None:
    s = _members(backend="nccl", device="cuda:0", gpu="0", placement="chosen")
    now = T0 + 1000
    error = "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3690, invalid usage, NCCL version 2.28.9"
    for _ in range(CONFIG_STRIKES):
        d = _failed(s, "w1", now, FormationError.NCCL_INVALID_USAGE, error)
        now += FORMATION_BACKOFF_MAX_MS
        s = decide(d.state, Tick(), now, SPEC).state
    assert d.state.status.state == JobState.FAILED
    assert d.reason.endswith("fix: 3 NCCL workers share GPU 0 on n1: one worker per GPU (--workers gpu) or backend: gloo")


def test_a_joiner_whose_backend_differs_from_the_members_is_refused_with_one_line() -> None:
    spec = SPEC.model_copy(update={"max_workers": 4})
    s = CoordState()
    for i in range(2):
        s = decide(s, _ev(JoinRequest(job_id="j", host="a", pid=i, backend="nccl", gpu=str(i)), f"{i}-1"), T0 + i, spec).state
    assert s.workers["w0"].backend == "nccl" and s.workers["w1"].gpu == "1"
    d = decide(s, _ev(JoinRequest(job_id="j", host="b", pid=7, node="n2", backend="gloo"), "3-1"), T0 + 5, spec)
    (reply,) = [a.reply for a in d.actions if hasattr(a, "reply")]
    assert not reply.accepted and "\n" not in reply.reason
    assert reply.reason.startswith("join rejected: its backend gloo differs from the job's members' nccl (w0, w1)")
    assert d.state.status.rejected_joins == 1 and "w2" not in d.state.workers
    # a joiner that reports no backend (a simulated worker, an older sender) is not compared
    d = decide(s, _ev(JoinRequest(job_id="j", host="c", pid=8), "4-1"), T0 + 6, spec)
    assert "w2" in d.state.workers


@pytest.mark.parametrize("value,expected", [("", FormationError.TRANSIENT), ("nccl_invalid_usage",
                         FormationError.NCCL_INVALID_USAGE), ("from_the_future", FormationError.TRANSIENT)])
def test_a_reader_takes_an_unknown_or_missing_classification_as_transient(value, expected) -> None:
    assert FormationError.parse(value) is expected
    assert expected.configuration is (expected is not FormationError.TRANSIENT)


def test_a_switch_that_only_removes_members_forms_when_the_survivors_say_ready() -> None:
    """Members active before a generation that only drops another stay active; their ready
    must still stop the formation clock, or the job fails formation_timeout later although
    it trains (found by the 16,384-worker bench: nobody joined after the kills)."""
    spec = SPEC.model_copy(update={"formation_timeout": 60})
    s = _members(spec)
    g = s.status.generation
    for i, wid in enumerate(("w0", "w1", "w2")):
        s = decide(s, _ev(Ready(job_id="j", worker_id=wid, generation=g, step=0), f"{10 + i}-0"), T0 + 10 + i, spec).state
    assert s.status.formation.unformed_since_ms == 0
    exited = WorkerExited(job_id="j", worker_id="w2", exit_code=-9, signal=9)
    d = decide(s, _ev(exited, "20-0"), T0 + 1000, spec)
    assert d.state.status.generation == g + 1 and d.state.status.formation.unformed_since_ms == T0 + 1000
    s = d.state
    for i, wid in enumerate(("w0", "w1")):  # still active: a removal-only switch
        assert s.workers[wid].state.value == "Active"
        s = decide(s, _ev(Ready(job_id="j", worker_id=wid, generation=g + 1, step=5), f"{30 + i}-0"),
                   T0 + 1100 + i, spec).state
    assert s.status.formation.unformed_since_ms == 0
    later = decide(s, Tick(), T0 + 1000 + 61_000, spec)
    assert later.state.status.state == JobState.RUNNING, later.reason
