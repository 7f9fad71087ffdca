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


def test_workers_that_do_not_fill_a_group_on_their_node_wait_for_node_mates_before_crossing_nodes() -> None:
    """Issue 34: the first workers to join came from two nodes, and formed a group across them
    although each node had two workers a second later."""
    from shoal.coordinator.replicas import NODE_SETTLE_MS

    s = _join(_join(CoordState(), 0, T0, "a"), 1, T0 + 5, "b")  # one from each node first
    d = decide(s, Tick(), T0 + 5 + SETTLE_MS, SPEC)
    assert not [a for a in d.actions if isinstance(a, Publish)]  # they wait for node-mates
    assert d.state.status.regroup_at_ms == T0 + 5 + NODE_SETTLE_MS
    s = _join(_join(d.state, 2, T0 + 900, "a"), 3, T0 + 1000, "b")  # the node-mates come
    t = _table(decide(s, Tick(), T0 + 1000 + SETTLE_MS, SPEC))
    assert [(m.worker_id, m.group) for m in t.members] == [("w0", "r0"), ("w2", "r0"), ("w1", "r1"), ("w3", "r1")]
    # nobody comes: past the window they form a group across nodes
    s = _join(_join(CoordState(), 0, T0, "a"), 1, T0 + 5, "b")
    assert not [a for a in decide(s, Tick(), T0 + 5 + NODE_SETTLE_MS - 1, SPEC).actions if isinstance(a, Publish)]
    d = decide(s, Tick(), T0 + 5 + NODE_SETTLE_MS, SPEC)
    assert [(m.worker_id, m.group) for m in _table(d).members] == [("w0", "r0"), ("w1", "r0")]
    assert "across nodes a, b" in d.reason and d.state.status.regroup_at_ms == 0


def test_a_cross_node_group_is_regrouped_once_its_nodes_have_node_mates_and_another_group_holds_the_state() -> None:
    from shoal.coordinator.replicas import NODE_SETTLE_MS
    from shoal.events.models import Ready

    s = CoordState()
    for n, node in enumerate(["a", "a", "c", "b"]):  # r0: w0, w1 on a; w2 (c) and w3 (b) wait, then cross
        s = _join(s, n, T0 + n, node)
    d = decide(s, Tick(), T0 + 3 + NODE_SETTLE_MS, SPEC)
    t = _table(d)
    assert [(m.worker_id, m.group) for m in t.members] == [("w0", "r0"), ("w1", "r0"), ("w2", "r1"), ("w3", "r1")]
    s = d.state
    for w in ("w0", "w1", "w2", "w3"):  # the generation formed: r0 holds the state
        s = decide(s, _ev(Ready(job_id="j", worker_id=w, generation=t.generation, step=0), f"r{w}-0"), T0 + 3000, SPEC).state
    # a node-mate for each member of the cross-node group: c and b each get one (the sixth
    # worker reaches max_workers: planned at once)
    s = _join(s, 4, T0 + 4000, "c")
    d = decide(s, _ev(JoinRequest(job_id="j", host="b", pid=105, node="b"), "5-0"), T0 + 4001, SPEC)
    t = _table(d)
    assert [m.worker_id for m in t.members] == ["w0", "w1"]  # r1 dissolved; w4, w5 wait for its members
    for w in ("w2", "w3"):
        assert (d.state.workers[w].state, d.state.workers[w].cause) == (WorkerState.FAILED, FailureCause.REGROUPED)
        assert Forget(w) in d.actions
    assert t.evicted == []  # an orderly switch: nobody aborts collectives with them
    change = next(a.change for a in d.actions if isinstance(a, Publish))
    assert change.removed == ("w2", "w3") and [c.value for c in change.causes] == ["regrouped", "regrouped"]
    assert not d.state.status.first_failure  # not a failure
    # their agents start them again: each joins on its own node and meets its node-mate
    s = _join(d.state, 6, T0 + 8000, "c")
    t = _table(decide(s, _ev(JoinRequest(job_id="j", host="b", pid=107, node="b"), "7-0"), T0 + 8001, SPEC))
    groups: dict[str, set[str]] = {}
    for m in t.members:
        groups.setdefault(m.group, set()).add(m.worker_id)
    assert sorted(map(sorted, groups.values())) == [["w0", "w1"], ["w4", "w6"], ["w5", "w7"]]
