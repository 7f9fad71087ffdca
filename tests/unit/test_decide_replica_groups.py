"""Elastic HSDP in the coordinator's decisions (coordinator/decide.py, a simulated clock):
replica groups of ``shard_size`` workers form from joiners (one node's together), a partial
group waits, every member gets (replica, shard) with rank = replica x shard_size + shard, and a
failure or leave of any member takes its whole group out while the other groups stay."""

from __future__ import annotations

import pytest

from shoal.coordinator.decide import SETTLE_MS, EventInput, Forget, Publish, Tick, decide
from shoal.coordinator.states import CoordState
from shoal.core.jobspec import JobSpec
from shoal.events.models import JoinRequest, LeaveRequest, WorkerExited
from shoal.events.states import FailureCause, JobState, WorkerState

SPEC = JobSpec(name="j", entrypoint="simulate", shard_size=2, min_workers=2, max_workers=6, global_batch_size=12,
               heartbeat_ttl=2.0, heartbeat_interval=0.5)
T0 = 1_000_000


def _ev(event, sid: str) -> EventInput:
    return EventInput(sid, event)


def _join(s: CoordState, n: int, now: int, node: str = "n1") -> CoordState:
    return decide(s, _ev(JoinRequest(job_id="j", host=node, pid=100 + n, node=node), f"{n}-0"), now, SPEC).state


def _table(d):
    (t,) = [a.table for a in d.actions if isinstance(a, Publish)]
    return t


def _layout(t) -> list[tuple[str, str, int, int, int]]:
    return [(m.worker_id, m.group, m.replica, m.shard, m.rank) for m in t.members]


def test_the_spec_counts_workers_in_whole_replica_groups_and_a_batch_every_rank_splits_evenly() -> None:
    with pytest.raises(ValueError, match=r"max_workers \(5\) must be a multiple of shard_size \(2\)"):
        JobSpec(name="j", shard_size=2, min_workers=2, max_workers=5)
    with pytest.raises(ValueError, match=r"must divide by shard_size x replicas = 2 x 3"):
        JobSpec(name="j", shard_size=2, min_workers=2, max_workers=6, global_batch_size=64)
    with pytest.raises(ValueError, match="fp16"):
        JobSpec(name="j", shard_size=2, min_workers=2, max_workers=2, precision="fp16")
    assert SPEC.replicas == (1, 3)


def test_joiners_form_replica_groups_of_one_node_first_and_a_partial_group_waits() -> None:
    s = CoordState()
    for n, node in enumerate(["a", "b", "a", "b", "c"]):
        s = _join(s, n, T0 + n, node)
    d = decide(s, Tick(), T0 + 4 + SETTLE_MS, SPEC)
    t = _table(d)
    # w0, w2 on node a; w1, w3 on node b; w4 (node c) alone: it waits for a partner
    assert _layout(t) == [("w0", "r0", 0, 0, 0), ("w2", "r0", 0, 1, 1), ("w1", "r1", 1, 0, 2), ("w3", "r1", 1, 1, 3)]
    assert t.world_size == 4 and t.shard_size == 2
    assert d.state.workers["w4"].replica_group == "" and d.state.workers["w4"].state == WorkerState.SYNCING
    d = decide(d.state, _ev(JoinRequest(job_id="j", host="d", pid=105, node="d"), "5-0"), T0 + 1000, SPEC)
    t = _table(d)  # the sixth worker: max_workers reached, planned at once
    assert [m.worker_id for m in t.members] == ["w0", "w2", "w1", "w3", "w4", "w5"]
    assert {m.group for m in t.members[4:]} == {"r2"} and [m.replica for m in t.members] == [0, 0, 1, 1, 2, 2]


def test_a_failed_member_takes_its_whole_group_out_and_the_other_group_stays() -> None:
    s = CoordState()
    for n in range(4):
        s = _join(s, n, T0 + n)
    d = decide(s, Tick(), T0 + 3 + SETTLE_MS, SPEC)
    assert [m.group for m in _table(d).members] == ["r0", "r0", "r1", "r1"]
    d = decide(d.state, _ev(WorkerExited(job_id="j", worker_id="w2", signal=9), "9-0"), T0 + 2000, SPEC)
    t = _table(d)
    assert _layout(t) == [("w0", "r0", 0, 0, 0), ("w1", "r0", 0, 1, 1)]  # r0 kept its ranks and shards
    partner = d.state.workers["w3"]
    assert (partner.state, partner.cause) == (WorkerState.FAILED, FailureCause.REPLICA_GROUP)
    assert "w3 evicted with its replica group r1 (w2 gone)" in d.reason
    assert t.evicted == ["w2", "w3"] and Forget("w3") in d.actions  # peers abort collectives with both
    change = next(a.change for a in d.actions if isinstance(a, Publish))
    assert change.removed == ("w2", "w3") and [c.value for c in change.causes] == ["exited", "replica_group"]
    assert d.state.status.first_failure.startswith("w2 failed")  # the root cause, not the eviction


def test_a_leaving_member_takes_its_group_out_and_restarted_members_form_a_new_one() -> None:
    s = CoordState()
    for n in range(4):
        s = _join(s, n, T0 + n)
    s = decide(s, Tick(), T0 + 3 + SETTLE_MS, SPEC).state
    d = decide(s, _ev(LeaveRequest(job_id="j", worker_id="w0"), "9-0"), T0 + 2000, SPEC)
    assert [m.worker_id for m in _table(d).members] == ["w2", "w3"]
    assert d.state.workers["w0"].state == WorkerState.DRAINING and d.state.workers["w1"].cause == FailureCause.REPLICA_GROUP
    # the agent restarts w1's process and w0's slot: they join as new workers and form r2
    s = _join(_join(d.state, 10, T0 + 3000), 11, T0 + 3001)
    t = _table(decide(s, Tick(), T0 + 3001 + SETTLE_MS, SPEC))
    assert _layout(t) == [("w2", "r1", 0, 0, 0), ("w3", "r1", 0, 1, 1), ("w4", "r2", 1, 0, 2), ("w5", "r2", 1, 1, 3)]


def test_below_min_workers_in_whole_groups_the_job_pauses() -> None:
    spec = SPEC.model_copy(update={"min_workers": 4})
    s = CoordState()
    for n in range(4):
        s = decide(s, _ev(JoinRequest(job_id="j", host="h", pid=n), f"{n}-0"), T0 + n, spec).state
    s = decide(s, Tick(), T0 + 3 + SETTLE_MS, spec).state
    assert s.status.state == JobState.RUNNING
    d = decide(s, Tick(last_seen={"w1": T0}), T0 + 10_000, spec)  # w1's heartbeat stops
    t = _table(d)
    assert t.paused and d.state.status.state == JobState.PAUSED
    assert d.state.workers["w0"].cause == FailureCause.REPLICA_GROUP
