"""The training worker's pure decisions, driven with an explicit clock (no sleeping, no torch,
no Redis): each test feeds inputs as the loop would and checks the actions and the state."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.events.models import FormationError, Member, ShardTable
from shoal.worker.decide import (
    BARRIER_WAIT_S,
    DIGEST_EVERY,
    PHASE_MOVES,
    Aborted,
    Announce,
    Arrive,
    BarrierPolled,
    Beat,
    Committed,
    FetchNext,
    FetchTable,
    Finish,
    Form,
    Formed,
    FormFailed,
    IllegalMove,
    LeaveGroup,
    Limits,
    NextFetched,
    Phase,
    PollBarrier,
    RecordProgress,
    Rejoined,
    ReportFailure,
    SaveCheckpoint,
    SendLeave,
    SendLeft,
    TableFetched,
    TableWaited,
    Tick,
    TrainerState,
    TrainStep,
    TryRejoin,
    WaitTable,
    check_move,
    decide,
    reslices,
)

T0 = 1000.0
LIMITS = Limits(total_samples=640, max_steps=None, checkpoint_interval=5, wait_s=12.5, barrier_s=30.0)
BATCH = 64  # the shard space: positions of a global batch


def table(gen: int, *workers: str, paused: bool = False) -> ShardTable:
    w = len(workers)
    members = [Member(worker_id=wid, rank=r, ranges=[(r * BATCH // w, (r + 1) * BATCH // w, 1)]) for r, wid in enumerate(workers)]
    return ShardTable(job_id="j", generation=gen, world_size=w, strategy="contiguous", num_samples=BATCH,
                      members=[] if paused else members, paused=paused)


def fresh(wid: str = "w0", **fields) -> TrainerState:
    return TrainerState(LIMITS, worker_id=wid, **fields)


def types(d) -> list[type]:
    return [type(a) for a in d.actions]


def one(d, kind):
    (found,) = [a for a in d.actions if isinstance(a, kind)]
    return found


def training(gen: int = 1, *workers: str, wid: str = "w0", step: int = 0, cursor: int = 0, now: float = T0) -> TrainerState:
    """Drive a fresh worker through fetch, barrier and form into ``gen`` (members ``workers``)."""
    workers = workers or ("w0", "w1")
    s = decide(fresh(wid, step=step, cursor=cursor), Tick(latest=gen), now).state
    s = decide(s, TableFetched(table(gen, *workers)), now).state
    s = decide(s, BarrierPolled(arrived=len(workers), newest=gen), now).state
    d = decide(s, Formed(step=step, cursor=cursor), now)
    assert d.state.phase is Phase.TRAINING
    return d.state


# ---- joining a generation -------------------------------------------------------------------


def test_first_tick_fetches_the_table_and_a_table_with_this_worker_leads_to_its_barrier() -> None:
    d = decide(fresh(), Tick(latest=0), T0)
    assert d.actions == (FetchTable(),) and d.state.phase is Phase.IDLE
    d = decide(d.state, TableFetched(table(1, "w0", "w1")), T0)
    assert d.state.phase is Phase.FORMING and d.state.member.rank == 0 and d.state.seen == 1
    assert d.actions == (Arrive(1), PollBarrier(1)) and "rank 0" in d.reason
    assert d.state.deadline == T0 + LIMITS.barrier_s


def test_no_table_yet_waits_until_its_deadline_then_looks_again() -> None:
    s = decide(fresh(), Tick(), T0).state
    d = decide(s, TableFetched(None), T0)
    assert d.actions == (WaitTable(0),) and d.state.deadline == T0 + LIMITS.wait_s
    d = decide(d.state, TableWaited(), T0 + LIMITS.wait_s - 0.01)  # nothing yet: poll again
    assert d.actions == (WaitTable(0),)
    d = decide(d.state, TableWaited(), T0 + LIMITS.wait_s)  # the wait is over: back to the top
    assert d.actions == () and d.state.phase is Phase.IDLE and "looking again" in d.reason
    d = decide(d.state, Tick(latest=2), T0 + 20)
    assert d.actions == (FetchTable(),) and d.state.seen == 2


def test_a_wait_ends_early_on_a_new_table_a_job_end_or_an_eviction() -> None:
    s = decide(decide(fresh(), Tick(), T0).state, TableFetched(None), T0).state
    d = decide(s, TableWaited(table(4, "w0")), T0 + 1)
    assert d.actions == () and d.state.seen == 4 and "generation 4 published" in d.reason
    assert decide(s, TableWaited(job_ended=True), T0 + 1).actions == ()
    assert decide(s, TableWaited(evicted=True), T0 + 1).actions == ()


def test_a_table_without_this_worker_or_a_paused_one_is_waited_out() -> None:
    s = decide(fresh("w9"), Tick(), T0).state
    d = decide(s, TableFetched(table(3, "w0", "w1")), T0)
    assert d.actions == (WaitTable(3),) and "does not include this worker" in d.reason
    d = decide(s, TableFetched(table(4, "w9", paused=True)), T0)
    assert d.actions == (WaitTable(4),) and "paused" in d.reason


def test_the_barrier_forms_when_everyone_arrived_and_gives_up_at_its_deadline() -> None:
    s = decide(decide(fresh(), Tick(), T0).state, TableFetched(table(1, "w0", "w1")), T0).state
    d = decide(s, BarrierPolled(arrived=1, newest=1), T0 + 1)
    assert d.actions == (PollBarrier(1, wait=BARRIER_WAIT_S),)  # one blocking wait, not a busy poll
    # the last wait before the deadline ends at the deadline
    near = decide(s, BarrierPolled(arrived=1, newest=1), T0 + LIMITS.barrier_s - 0.25)
    assert near.actions == (PollBarrier(1, wait=0.25),)
    assert d.state.phase is Phase.FORMING and d.state.used == 0  # nothing spent yet
    d = decide(s, BarrierPolled(arrived=2, newest=1), T0 + 1)
    assert d.actions == (Form(s.table, 0),) and d.state.used == 1
    late = decide(s, BarrierPolled(arrived=1, newest=1), T0 + LIMITS.barrier_s)
    assert late.actions == () and late.state.phase is Phase.IDLE and late.state.used == 0
    assert "only 1 of 2 members" in late.reason and late.level == logging.INFO
    gone = decide(s, BarrierPolled(arrived=1, newest=1, evicted=True), T0 + 1)
    assert gone.actions == () and gone.state.phase is Phase.IDLE


def test_a_generation_from_a_checkpoint_loads_it_first_where_this_member_is_behind_it() -> None:
    """``restore_step``: no member holds the job's state, the generation starts from the
    checkpoint of that step. A member behind it (a joiner that loaded an older one when it
    started, or none) loads the newest first; one at or past it keeps its state (the catch-up
    takes the most advanced)."""
    from_ckpt = table(5, "w1").model_copy(update={"restore_step": 21})
    for step, restore in ((0, 21), (19, 21), (21, None), (23, None)):
        s = decide(decide(fresh("w1", step=step), Tick(), T0).state, TableFetched(from_ckpt), T0).state
        d = decide(s, BarrierPolled(arrived=1, newest=5), T0 + 1)
        assert d.actions == (Form(from_ckpt, 0, restore=restore),) and d.state.used == 5, step
        assert ("from the checkpoint of step 21" in d.reason) == (restore is not None)
    # then it trains from the step and cursor the formed group agreed on (the checkpoint's)
    d = decide(d.state, Formed(step=21, cursor=5864), T0 + 2)
    assert (d.state.step, d.state.cursor, d.state.phase) == (21, 5864, Phase.TRAINING)
    # the group failed after the checkpoint was loaded: its step and cursor are this member's now
    s = decide(decide(fresh("w1", step=19), Tick(), T0).state, TableFetched(from_ckpt), T0).state
    s = decide(s, BarrierPolled(arrived=1, newest=5), T0 + 1).state
    d = decide(s, FormFailed("peer gone", restored=(21, 5864)), T0 + 2)
    assert (d.state.step, d.state.cursor, d.state.phase) == (21, 5864, Phase.IDLE)
    assert one(d, ReportFailure).step == 21


def test_a_newer_table_during_the_barrier_abandons_it_for_the_newer_one() -> None:
    s = decide(decide(fresh(), Tick(), T0).state, TableFetched(table(1, "w0", "w1")), T0).state
    d = decide(s, BarrierPolled(arrived=1, newest=2), T0 + 0.5)
    assert d.actions == () and d.state.phase is Phase.IDLE
    assert (d.state.seen, d.state.switch_to, d.state.used) == (2, 2, 0)


def test_formed_announces_and_trains_with_the_caught_up_step_and_cursor() -> None:
    s = decide(decide(fresh(step=3, cursor=192), Tick(), T0).state, TableFetched(table(2, "w0", "w1")), T0).state
    s = decide(s, BarrierPolled(arrived=2, newest=2), T0).state
    d = decide(s, Formed(step=7, cursor=448, src=1, behind=(0,), took=0.25), T0)
    assert d.state.phase is Phase.TRAINING and (d.state.step, d.state.cursor, d.state.group) == (7, 448, 2)
    assert d.actions == (Announce(2, 0, 2, 7, 448, 0.25, 1, (0,)),)
    # rank 0 was behind: it takes no samples in the first step, rank 1 the whole batch
    d = decide(d.state, Tick(latest=2), T0)
    # (not the table's ranges: nobody balances this step within it - slices by speed)
    assert one(d, TrainStep) == TrainStep(7, 448, (), 2, 2, 2, planned=False)
    d = decide(d.state, Committed(cursor=512, max_generation=2), T0)
    then = one(decide(d.state, Tick(latest=2), T0), TrainStep)
    assert then.ranges == ((0, 32, 1),) and then.planned  # then the table's


def test_the_members_up_to_date_split_the_first_batch_while_the_joiner_receives() -> None:
    s = decide(decide(fresh("w1"), Tick(), T0).state, TableFetched(table(2, "w0", "w1", "w2")), T0).state
    s = decide(s, BarrierPolled(arrived=3, newest=2), T0).state
    s = decide(s, Formed(step=7, cursor=448, src=0, behind=(2,)), T0).state
    assert one(decide(s, Tick(latest=2), T0), TrainStep).ranges == ((32, 64, 1),)


def test_a_group_that_could_not_form_is_left_reported_and_never_tried_again() -> None:
    s = decide(decide(fresh(step=4), Tick(), T0).state, TableFetched(table(3, "w0", "w1")), T0).state
    s = decide(s, BarrierPolled(arrived=2, newest=3), T0).state
    d = decide(s, FormFailed("rendezvous of generation 3 timed out"), T0 + 30)
    assert d.actions == (LeaveGroup(background=False), ReportFailure(3, 4, "rendezvous of generation 3 timed out", rendezvous=True,
                                                                     kind=FormationError.TRANSIENT), WaitTable(3))
    assert d.level == logging.WARNING and d.reason == "generation 3 could not form: rendezvous of generation 3 timed out"
    assert d.state.phase is Phase.IDLE and d.state.used == 3
    s = decide(d.state, TableWaited(), T0 + 30 + LIMITS.wait_s).state  # nothing newer came
    s = decide(s, Tick(latest=3), T0 + 50).state
    d = decide(s, TableFetched(table(3, "w0", "w1")), T0 + 50)
    assert d.actions == (WaitTable(3),) and "already joined or tried" in d.reason


# ---- training -------------------------------------------------------------------------------


def test_a_committed_step_moves_the_cursor_and_rank0_records_checkpoints_and_beats() -> None:
    s = training(1, step=4, cursor=256)
    d = decide(s, Tick(latest=1), T0)
    assert d.actions == (TrainStep(4, 256, ((0, 32, 1),), 1, 1, 2),)
    d = decide(d.state, Committed(cursor=320, max_generation=1, loss=0.5, started=T0), T0 + 0.1)
    assert (d.state.step, d.state.cursor, d.state.phase) == (5, 320, Phase.TRAINING)
    assert d.actions == (RecordProgress(5, 0.5, 1, 2), SaveCheckpoint(5, 320, 1, 2, final=False), Beat(5, 1, 0.5, T0, digest=False))
    d = decide(d.state, Tick(latest=1), T0)
    d = decide(d.state, Committed(cursor=384, max_generation=1), T0)
    assert types(d) == [RecordProgress, Beat]  # step 6: not a checkpoint step


def test_rank1_neither_records_nor_checkpoints_and_the_digest_rides_every_nth_beat() -> None:
    s = training(1, "w0", "w1", wid="w1", step=DIGEST_EVERY - 1, cursor=0)
    d = decide(decide(s, Tick(latest=1), T0).state, Committed(cursor=64, max_generation=1), T0)
    assert types(d) == [Beat] and d.actions[0].digest


def test_a_newer_table_arriving_mid_step_switches_every_member_after_the_same_step() -> None:
    s = training(1)
    d = decide(s, Tick(latest=1), T0)  # the step starts in generation 1...
    assert one(d, TrainStep).generation == 1
    s = d.state
    # ... generation 2 is published while it runs: this member learns it from the next Tick
    # only, but another member saw it and the step's all-reduce agreed on it
    d = decide(s, Committed(cursor=64, max_generation=2), T0 + 0.1)
    assert d.state.switch_to == 2 and d.state.phase is Phase.TRAINING and "generation 2 agreed" in d.reason
    d = decide(d.state, Tick(latest=2), T0 + 0.2)
    assert d.actions == (LeaveGroup(background=True), FetchTable())
    assert d.state.phase is Phase.IDLE and d.state.group == 0 and d.state.step == 1
    d = decide(d.state, TableFetched(table(2, "w0", "w1", "w2")), T0 + 0.2)
    assert d.state.phase is Phase.FORMING and d.actions[0] == Arrive(2)


def resliced(gen: int, sizes: list[int], *workers: str, continues: int | None = None) -> ShardTable:
    """A re-slice (slices by speed) of generation ``gen - 1``: ``workers`` with ``sizes``."""
    members, start = [], 0
    for r, (wid, n) in enumerate(zip(workers, sizes)):
        members.append(Member(worker_id=wid, rank=r, ranges=[(start, start + n, 1)]))
        start += n
    return ShardTable(job_id="j", generation=gen, world_size=len(workers), strategy="contiguous",
                      num_samples=BATCH, members=members, continues=gen - 1 if continues is None else continues)


def by_speed(s: TrainerState) -> TrainerState:
    """``s`` of a job with slices by speed (its tables may be re-slices)."""
    return replace(s, limits=replace(s.limits, may_reslice=True))


def test_a_reslice_is_adopted_in_place_after_the_agreed_step_and_the_next_step_uses_its_ranges() -> None:
    s = by_speed(training(1, "w0", "w1", wid="w1"))
    s = decide(s, Tick(latest=1), T0).state
    d = decide(s, Committed(cursor=64, max_generation=2), T0)  # some member saw generation 2
    d = decide(d.state, Tick(latest=1), T0)  # this one had not: it must not train on the old ranges
    assert d.actions == (FetchNext(2),) and not any(isinstance(a, TrainStep) for a in d.actions)
    d = decide(d.state, NextFetched(resliced(2, [40, 24], "w0", "w1")), T0)
    assert d.state.phase is Phase.TRAINING and d.state.group == 2 and d.state.used == 2 and d.state.seen == 2
    assert d.actions == (Announce(2, 1, 2, 1, 64, 0.0, 1, ()),)  # no LeaveGroup, no barrier, no Form
    assert "in place" in d.reason
    step = one(decide(d.state, Tick(latest=2), T0), TrainStep)
    assert step == TrainStep(1, 64, ((40, 64, 1),), 2, 2, 2)  # the new ranges, from the next step on


@pytest.mark.parametrize("next_table", [
    None,  # not found (trimmed, or not confirmed by a replica)
    resliced(2, [40, 24], "w0", "w1", continues=0),  # a re-plan with a new group
    resliced(2, [40, 24], "w1", "w0"),  # other ranks
    resliced(2, [20, 20, 24], "w0", "w1", "w2"),  # other members
    resliced(3, [40, 24], "w0", "w1"),  # not the generation right after (continues 2)
])
def test_anything_but_a_reslice_of_the_group_leaves_it(next_table) -> None:
    s = decide(by_speed(training(1, "w0", "w1")), Tick(latest=1), T0).state
    s = decide(s, Committed(cursor=64, max_generation=2), T0).state
    s = decide(s, Tick(latest=2), T0).state
    d = decide(s, NextFetched(next_table), T0)
    assert d.actions == (LeaveGroup(background=True), FetchTable()) and d.state.phase is Phase.IDLE
    d = decide(d.state, TableFetched(table(2, "w0", "w1", "w2")), T0)  # and forms the newest as ever
    assert d.state.phase is Phase.FORMING and d.actions[0] == Arrive(2)


def test_without_slices_by_speed_an_agreed_switch_leaves_at_once_even_for_a_reslice() -> None:
    s = decide(training(1, "w0", "w1"), Tick(latest=2), T0).state
    s = decide(s, Committed(cursor=64, max_generation=2), T0).state
    assert decide(s, Tick(latest=2), T0).actions == (LeaveGroup(background=True), FetchTable())


def test_reslices_needs_the_same_members_ranks_and_the_generation_right_after() -> None:
    old = table(4, "w0", "w1", "w2")
    assert reslices(old, resliced(5, [30, 20, 14], "w0", "w1", "w2"))
    assert not reslices(old, resliced(5, [30, 20, 14], "w0", "w1", "w2", continues=3))
    assert not reslices(old, resliced(6, [30, 20, 14], "w0", "w1", "w2", continues=4))
    assert not reslices(old, resliced(5, [30, 34], "w0", "w1"))
    assert not reslices(old, resliced(5, [30, 20, 14], "w0", "w1", "w2").model_copy(update={"paused": True}))


def test_members_that_agreed_on_a_switch_all_adopt_the_same_reslice_at_the_same_step() -> None:
    """Two members, one of which saw the new table and one not: both learn the switch from the
    same committed step, both read the same generation, both train the next step on it."""
    new = resliced(2, [44, 20], "w0", "w1")
    steps = []
    for wid, latest in (("w0", 2), ("w1", 1)):
        s = decide(by_speed(training(1, "w0", "w1", wid=wid)), Tick(latest=latest), T0).state
        s = decide(s, Committed(cursor=64, max_generation=2), T0).state
        d = decide(s, Tick(latest=latest), T0)
        assert d.actions == (FetchNext(2),)
        s = decide(d.state, NextFetched(new), T0).state
        steps.append(one(decide(s, Tick(latest=2), T0), TrainStep))
    assert [st.step for st in steps] == [1, 1] and [st.base for st in steps] == [2, 2]
    assert [st.ranges for st in steps] == [((0, 44, 1),), ((44, 64, 1),)]


def test_a_newer_table_seen_before_a_step_is_carried_by_it_and_the_switch_waits_for_the_agreement() -> None:
    s = training(1)
    d = decide(s, Tick(latest=2), T0)
    assert one(d, TrainStep) == TrainStep(0, 0, ((0, 32, 1),), 2, 1, 2)  # tells the others, switches after
    assert d.state.phase is Phase.TRAINING and d.state.seen == 2


def test_a_switch_to_a_table_not_yet_readable_waits_for_it() -> None:
    s = decide(training(1), Tick(latest=1), T0).state
    s = decide(s, Committed(cursor=64, max_generation=2), T0).state
    s = decide(s, Tick(latest=1), T0).state
    d = decide(s, TableFetched(table(1, "w0", "w1")), T0)  # the key still holds generation 1
    assert d.actions == (WaitTable(1),)


def test_a_failed_step_keeps_the_cursor_leaves_at_once_reports_and_waits_for_a_newer_generation() -> None:
    s = training(2, step=9, cursor=576)
    s = decide(s, Tick(latest=2), T0).state
    d = decide(s, Aborted("step aborted, nothing applied: peer closed"), T0 + 1)
    assert d.actions == (LeaveGroup(background=False), ReportFailure(2, 9, "step aborted, nothing applied: peer closed"),
                         WaitTable(2))
    assert d.reason == "step 9 aborted in generation 2: step aborted, nothing applied: peer closed"
    assert d.level == logging.WARNING
    assert (d.state.phase, d.state.step, d.state.cursor, d.state.group) == (Phase.IDLE, 9, 576, 0)
    s = decide(d.state, TableWaited(table(3, "w0")), T0 + 2).state
    s = decide(s, Tick(latest=3), T0 + 2).state
    s = decide(s, TableFetched(table(3, "w0")), T0 + 2).state
    s = decide(s, BarrierPolled(arrived=1, newest=3), T0 + 2).state
    assert one(decide(decide(s, Formed(9, 576), T0 + 2).state, Tick(latest=3), T0 + 2), TrainStep).cursor == 576  # redone


def test_rank0_whose_last_step_aborted_as_the_stop_came_still_saves_the_final_checkpoint() -> None:
    """A peer that read "stopped" one tick earlier exits at the step boundary; rank 0, which
    began the next step, aborts it (nothing applied) and must still keep the progress: its
    weights are the group's last committed state (seen in a full run of the suite:
    tests/processes/test_stop_checkpoint.py waited for a checkpoint that never came)."""
    s = decide(training(1, step=19, cursor=1216), Tick(latest=1), T0).state
    s = decide(s, Aborted("step aborted, nothing applied: connection closed by peer"), T0 + 1).state
    assert s.phase is Phase.IDLE and s.aborted_rank0 == (1, 2)
    d = decide(s, Tick(latest=1, job_state="stopped"), T0 + 2)
    assert d.actions == (SaveCheckpoint(19, 1216, 1, 2, final=True),) and d.state.exit_code == 0
    # not rank 0: nothing to save
    w1 = decide(decide(training(1, wid="w1", step=19), Tick(latest=1), T0).state, Aborted("peer closed"), T0 + 1).state
    assert w1.aborted_rank0 is None and decide(w1, Tick(latest=1, job_state="stopped"), T0 + 2).actions == ()
    # a newer generation came after the abort (others trained on): its rank 0 saves, not this stale copy
    assert decide(s, Tick(latest=2, job_state="stopped"), T0 + 2).actions == ()
    # a new group clears it
    s = decide(s, TableWaited(table(2, "w0")), T0 + 2).state
    s = decide(s, Tick(latest=2), T0 + 2).state
    s = decide(s, TableFetched(table(2, "w0")), T0 + 2).state
    s = decide(s, BarrierPolled(arrived=1, newest=2), T0 + 2).state
    assert decide(s, Formed(19, 1216), T0 + 2).state.aborted_rank0 is None


def test_a_generation_already_used_is_never_joined_again() -> None:
    s = decide(training(2), Tick(latest=2), T0).state
    s = decide(s, Aborted("peer died"), T0).state
    s = decide(s, TableWaited(), T0 + LIMITS.wait_s).state  # the coordinator was slow: nothing newer yet
    s = decide(s, Tick(latest=2), T0 + 20).state
    d = decide(s, TableFetched(table(2, "w0", "w1")), T0 + 20)
    assert d.actions == (WaitTable(2),) and d.state.phase is Phase.IDLE
    assert "generation 2 was already joined or tried" in d.reason


# ---- eviction, stop, the end ---------------------------------------------------------------


def test_eviction_exits_with_1_unless_the_job_lost_its_record_and_took_the_worker_back() -> None:
    s = training(3)
    d = decide(s, Tick(evicted=True, latest=3), T0)
    assert d.actions == (TryRejoin(3),) and d.state == s
    out = decide(d.state, Rejoined(False), T0)
    assert out.state.phase is Phase.EXITED and out.state.exit_code == 1 and out.level == logging.ERROR
    assert out.reason == "evicted by the coordinator (declared failed); exiting"
    back = decide(d.state, Rejoined(True, "w7"), T0)
    assert back.actions == (LeaveGroup(background=False),)
    assert (back.state.phase, back.state.worker_id, back.state.switch_to, back.state.used) == (Phase.IDLE, "w7", 0, 3)
    assert decide(back.state, Tick(latest=3), T0).actions == (FetchTable(),)


def test_stop_drains_once_trains_on_and_leaves_when_a_table_excludes_the_worker() -> None:
    s = training(1, step=2)
    d = decide(s, Tick(stop=True, latest=1), T0)
    assert types(d) == [SendLeave, TrainStep] and d.state.draining and d.level == logging.INFO
    assert d.reason.startswith("draining after step 2")
    s = decide(d.state, Committed(cursor=192, max_generation=2), T0).state
    d = decide(s, Tick(stop=True, latest=2), T0)
    assert SendLeave not in types(d)  # asked once
    d = decide(d.state, TableFetched(table(2, "w1")), T0)
    assert d.actions == (SendLeft(),) and d.state.exit_code == 0 and d.state.phase is Phase.EXITED
    assert d.reason == "left after step 3 (generation 2 no longer includes us)"


def test_when_every_member_drained_rank0_checkpoints_before_it_leaves_the_paused_job() -> None:
    """``docker compose down`` drains every worker at once: the coordinator pauses the job (a
    table with no member). Rank 0's weights are the last committed step's, so it writes a
    checkpoint of it before it leaves: the job resumes there on the next ``up`` (the compose
    check's down-up redid the 23-33 steps since the last interval's checkpoint)."""
    s = decide(training(1, step=2, cursor=128), Tick(stop=True, latest=1), T0).state
    s = decide(s, Committed(cursor=192, max_generation=2), T0).state
    s = decide(s, Tick(stop=True, latest=2), T0).state
    assert s.drained_saver == (1, 2)
    d = decide(s, TableFetched(table(2, paused=True)), T0)
    assert d.actions == (SaveCheckpoint(3, 192, 1, 2, final=True), SendLeft()) and d.state.exit_code == 0
    assert "checkpoint of step 3 first" in d.reason
    # others train on without it (not paused): their rank 0 checkpoints, not this one
    assert decide(s, TableFetched(table(2, "w1")), T0).actions == (SendLeft(),)
    # not rank 0: nothing to save
    w1 = decide(training(1, wid="w1", step=2), Tick(stop=True, latest=1), T0).state
    w1 = decide(decide(w1, Committed(cursor=192, max_generation=2), T0).state, Tick(stop=True, latest=2), T0).state
    assert w1.drained_saver is None and decide(w1, TableFetched(table(2, paused=True)), T0).actions == (SendLeft(),)
    # not draining (a peer's leave paused the job): it waits for a newer table, state kept
    k = decide(decide(training(1, step=2), Committed(cursor=192, max_generation=2), T0).state, Tick(latest=2), T0).state
    assert types(decide(k, TableFetched(table(2, paused=True)), T0)) == [WaitTable]
    # its last step aborted (a peer left first): the same, from the aborted step's group
    a = decide(training(1, step=2, cursor=128), Tick(stop=True, latest=1), T0).state
    a = decide(a, Aborted("peer closed"), T0).state
    assert a.drained_saver == (1, 2)
    assert decide(a, TableFetched(table(2, paused=True)), T0).actions == (SaveCheckpoint(2, 128, 1, 2, final=True),
                                                                         SendLeft())
    # the second to drain was rank 1 of the last group that trained and rank 0 of the table
    # without the first (never formed: the pause came first): it holds the last committed state
    w1 = decide(training(1, wid="w1", step=2, cursor=128), Tick(latest=1), T0).state
    w1 = decide(w1, Committed(cursor=192, max_generation=2), T0).state
    w1 = decide(w1, Tick(latest=2), T0).state
    w1 = decide(w1, TableFetched(table(2, "w1")), T0).state  # rank 0 of generation 2: meeting its members
    w1 = decide(w1, Tick(stop=True, latest=2), T0).state
    w1 = decide(w1, BarrierPolled(arrived=0, newest=3), T0).state  # generation 3 (paused) came first
    assert w1.phase is Phase.IDLE and w1.drained_saver == (1, 2)
    assert decide(w1, TableFetched(table(3, paused=True)), T0).actions == (SaveCheckpoint(3, 192, 1, 2, final=True),
                                                                          SendLeft())
    # HSDP: the saving replica group's members would each write their shards; one alone cannot
    h = decide(training(1, step=2), Tick(stop=True, latest=1), T0).state
    h = replace(h, limits=replace(h.limits, saves_alone=False))
    h = decide(decide(h, Committed(cursor=192, max_generation=2), T0).state, Tick(stop=True, latest=2), T0).state
    assert h.drained_saver is None
    # slices by speed: the switch reads the next table first; the paused one is no re-slice
    b = decide(by_speed(training(1, step=2, cursor=128)), Tick(stop=True, latest=1), T0).state
    b = decide(decide(b, Committed(cursor=192, max_generation=2), T0).state, Tick(stop=True, latest=2), T0).state
    b = decide(b, NextFetched(table(2, paused=True)), T0).state
    assert b.drained_saver == (1, 2) and b.phase is Phase.IDLE


def test_a_stopped_job_makes_rank0_save_a_final_checkpoint_and_everyone_exit() -> None:
    s = training(1, step=3, cursor=192)
    d = decide(s, Tick(latest=1, job_state="stopped"), T0)
    assert d.actions == (SaveCheckpoint(3, 192, 1, 2, final=True),) and d.state.exit_code == 0
    assert decide(training(1, wid="w1"), Tick(job_state="stopped"), T0).actions == ()
    assert decide(s, Tick(job_state="completed"), T0).actions == ()  # completed or failed: nothing to keep
    idle = decide(fresh(), Tick(job_state="failed"), T0)
    assert idle.state.phase is Phase.EXITED and idle.state.exit_code == 0


def test_the_last_step_of_the_job_finishes_and_rank0_reports() -> None:
    s = training(1, step=9, cursor=576)
    s = decide(s, Tick(latest=1), T0).state
    d = decide(s, Committed(cursor=640, max_generation=1, loss=0.1), T0)
    assert d.state.phase is Phase.EXITED and d.state.exit_code == 0
    assert one(d, Finish) == Finish(10, 640, report=True, checkpoint=SaveCheckpoint(10, 640, 1, 2, final=True),
                                  generation=1)
    # step 10 is also a periodic checkpoint (interval 5): saved once, by Finish, not twice
    assert not [a for a in d.actions if isinstance(a, SaveCheckpoint)]
    limited = replace(training(1, wid="w1", step=1, cursor=64), limits=replace(LIMITS, max_steps=2))
    d = decide(decide(limited, Tick(latest=1), T0).state, Committed(cursor=128, max_generation=1), T0)
    assert one(d, Finish) == Finish(2, 128, report=False, checkpoint=None, generation=1)


def test_inputs_out_of_phase_are_no_ops_with_a_reason() -> None:
    s = fresh()
    d = decide(s, Committed(cursor=64, max_generation=1), T0)
    assert d.state == s and d.actions == () and "ignored while idle" in d.reason
    ended = decide(s, Tick(job_state="completed"), T0).state
    d = decide(ended, Tick(latest=5), T0)
    assert d.state == ended and d.actions == () and "exited" in d.reason


def test_the_phase_table_refuses_unlisted_moves() -> None:
    assert PHASE_MOVES[Phase.EXITED] == frozenset()
    check_move(Phase.IDLE, Phase.FORMING)
    for src, dst in [(Phase.IDLE, Phase.TRAINING), (Phase.TRAINING, Phase.FORMING), (Phase.EXITED, Phase.IDLE)]:
        with pytest.raises(IllegalMove):
            check_move(src, dst)


# ---- any sequence ---------------------------------------------------------------------------

_TABLES = st.builds(lambda g, ws, p: table(g, *ws, paused=p), st.integers(1, 6),
                    st.lists(st.sampled_from(["w0", "w1", "w2"]), min_size=1, max_size=3, unique=True), st.booleans())
_INPUTS = st.one_of(
    st.builds(Tick, evicted=st.booleans(), stop=st.booleans(), latest=st.integers(0, 6),
              job_state=st.sampled_from(["running", "running", "running", "paused", "stopped"])),
    st.builds(Rejoined, st.booleans(), st.just("w0")),
    st.builds(TableFetched, st.none() | _TABLES),
    st.builds(TableWaited, st.none() | _TABLES, st.booleans(), st.booleans()),
    st.builds(BarrierPolled, st.integers(0, 3), st.integers(0, 7), st.booleans()),
    st.builds(Formed, st.integers(0, 20), st.integers(0, 640), st.integers(0, 2), st.sampled_from([(), (1,), (0, 2)])),
    st.builds(FormFailed, st.just("boom")),
    st.builds(Committed, st.integers(0, 640), st.integers(0, 7)),
    st.builds(Aborted, st.just("peer died")),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_INPUTS, st.floats(0, 40)), max_size=40))
def test_any_input_sequence_keeps_the_invariants(seq) -> None:
    """Moves stay in the table; a generation is formed at most once; the cursor moves only on a
    commit or a catch-up; an exit is final."""
    s, now, formed = fresh(), T0, []
    for event, dt in seq:
        now += dt
        d = decide(s, event, now)  # raises IllegalMove on a move outside the table
        formed += [a.table.generation for a in d.actions if isinstance(a, Form)]
        if not isinstance(event, (Committed, Formed)):
            assert (d.state.step, d.state.cursor) == (s.step, s.cursor)
        if s.phase is Phase.EXITED:
            assert d.state == s and d.actions == ()
        assert d.state.used >= s.used
        s = d.state
    assert len(formed) == len(set(formed)) and formed == sorted(formed)


def test_a_worker_in_no_group_forms_a_reslice_like_any_table() -> None:
    s = decide(by_speed(fresh("w1")), Tick(latest=2), T0).state
    d = decide(s, TableFetched(resliced(2, [40, 24], "w0", "w1")), T0)
    assert d.state.phase is Phase.FORMING and d.actions[0] == Arrive(2)
