"""Slices sized by speed (issue 38, item 7): the coordinator sizes each member's slice of the
global batch by the rate its heartbeat's work counters show, re-plans at membership changes
and, between them, once every ``batch_split_every`` committed steps (the first look after
``slices.FIRST_LOOK`` steps on equal slices) when the predicted step shortens by more than
``slices.MIN_GAIN``, with a re-slice the members adopt in their running group. Pure decisions driven with an explicit clock (ticks at later
``now``s, no sleeping); the tables' ranges are the typed facts read here."""

from __future__ import annotations

import pytest

from shoal.coordinator import slices
from shoal.coordinator.decide import EventInput, Publish, Tick, decide
from shoal.coordinator.loop import _progress_ms, _work_seen
from shoal.coordinator.redone import StepSeen
from shoal.coordinator.shards import count
from shoal.coordinator.states import CoordState
from shoal.core.errors import ConfigError
from shoal.core.jobspec import JobSpec, parse_spec
from shoal.events.models import Heartbeat, JoinRequest, Ready, WorkerExited
from shoal.events.records import JobStatus, Split
from shoal.events.states import JobState
from shoal.worker.data import validate_table

BATCH = 60
SPEC = JobSpec(name="j", entrypoint="simulate", min_workers=1, max_workers=3, global_batch_size=BATCH,
               heartbeat_ttl=2.0, heartbeat_interval=0.5, batch_split="by_speed", batch_split_every=10)
T0 = 1_000_000


def _ev(event, sid="1-0"):
    return EventInput(sid, event)


def _tables(d):
    return [a.table for a in d.actions if isinstance(a, Publish)]


def _sizes(table) -> dict[str, int]:
    return {m.worker_id: count(m.ranges) for m in table.members}


def _three_active(spec=SPEC):
    s = CoordState()
    for i in range(3):
        d = decide(s, _ev(JoinRequest(job_id="j", host="h", pid=i)), T0 + i, spec)
        s = d.state
    (table,) = _tables(d)  # max_workers reached: planned at once
    for wid in ("w0", "w1", "w2"):
        s = decide(s, _ev(Ready(job_id="j", worker_id=wid, generation=s.status.generation, step=0)), T0 + 10, spec).state
    return s, table


#: _tick's work counters are given in tenths: scaled, every window of the tests holds at least
#: slices.WINDOW_STEPS of the worker's slices
SCALE = 10


def _tick(state, now, step, work, spec=SPEC):
    """A progress sample: every worker at ``step`` of the current generation, with its work
    counters ``(samples, seconds)`` (times :data:`SCALE`)."""
    g = state.status.generation
    return decide(state, Tick(steps={w: StepSeen(g, step) for w in work},
                              work={w: slices.Work(c[0] * SCALE, c[1] * SCALE) for w, c in work.items()}), now, spec)


def test_sizes_follow_rates_sum_to_the_batch_and_are_bounded() -> None:
    ids = ["w0", "w1", "w2"]
    assert slices.sizes_for(60, ids, {}) == [20, 20, 20]  # nothing measured: equal
    assert slices.sizes_for(60, ids, {"w0": 100, "w1": 100, "w2": 50}) == [24, 24, 12]
    assert slices.sizes_for(61, ids, {"w0": 100, "w1": 100, "w2": 50}) == [25, 24, 12]  # remainder: lower rank
    # a member that looked nearly stopped still counts for 1/8 of the fastest
    assert slices.sizes_for(68, ids, {"w0": 100, "w1": 100, "w2": 0.01}) == [32, 32, 4]
    # a member without a rate yet (a joiner) counts with the others' median
    assert slices.sizes_for(60, ids, {"w0": 100, "w1": 50}) == [27, 13, 20]  # w2 at 75/s
    # every member gets a sample while the batch allows
    assert slices.sizes_for(3, ids, {"w0": 1000, "w1": 1000, "w2": 1}) == [1, 1, 1]
    for n in range(1, 40):
        sizes = slices.sizes_for(n, ids, {"w0": 7, "w1": 3, "w2": 1})
        assert sum(sizes) == n
        validate_table(slices.ranges(sizes), n)  # every position exactly once


def test_rates_come_from_counter_differences_over_windows_of_two_steps_and_are_smoothed() -> None:
    assert slices.WINDOW_STEPS == 2
    # one worker, a global batch of 60: its slices are 60 until sized, a window 120 samples
    s = slices.observe(Split(), {"w0": slices.Work(100, 1.0)}, 60)
    assert s.rates == {} and s.seen == {}  # less than two steps since the process started: the window grows on
    s = slices.observe(s, {"w0": slices.Work(300, 2.5)}, 60)
    assert s.rates == {"w0": 120.0} and s.seen == {"w0": [300, 2.5]}  # 300 samples in 2.5 s
    s = slices.observe(s, {"w0": slices.Work(300, 2.5)}, 60)
    assert s.rates == {"w0": 120.0}  # no new step: nothing folded in
    s = slices.observe(s, {"w0": slices.Work(400, 3.5)}, 60)
    assert s.rates == {"w0": 120.0} and s.seen == {"w0": [300, 2.5]}  # one step's swing is not folded alone
    s = slices.observe(s, {"w0": slices.Work(700, 4.5)}, 60)  # 400 samples in 2 s
    assert s.rates == {"w0": 160.0}  # half the old, half the new
    s = slices.observe(s, {"w0": slices.Work(10, 0.1)}, 60)  # counters went back: another process
    assert s.rates == {"w0": 160.0} and s.seen == {"w0": [10, 0.1]}
    assert slices.forget(s, ["w1"]).rates == {}
    # a sized worker's window is two of its own slices
    assert slices.observe(Split(sizes={"w0": 10}), {"w0": slices.Work(20, 0.5)}, 60).rates == {"w0": 40.0}
    assert slices.observe(Split(sizes={"w0": 10}), {"w0": slices.Work(19, 0.5)}, 60).rates == {}


def test_a_slow_member_gets_a_smaller_slice_in_place_after_the_first_steps_then_looks_every_steps() -> None:
    s, first = _three_active()
    assert _sizes(first) == {"w0": 20, "w1": 20, "w2": 20}
    assert "no rates measured yet, equal slices" in first.reason and first.continues == 0
    # w2 does half the samples per second of own work; 1 step in: no look yet
    d = _tick(s, T0 + 1000, 1, {"w0": (20, 0.2), "w1": (20, 0.2), "w2": (20, 0.4)})
    assert not _tables(d) and not d.changed
    assert d.state.status.split.rates == {"w0": 100.0, "w1": 100.0, "w2": 50.0}
    # FIRST_LOOK steps after a plan on equal slices (not batch_split_every): a re-slice, the
    # same members at the same ranks in the running generation's group
    d = _tick(d.state, T0 + 2000, slices.FIRST_LOOK, {"w0": (40, 0.4), "w1": (40, 0.4), "w2": (40, 0.8)})
    (table,) = _tables(d)
    assert table.generation == first.generation + 1 and table.continues == first.generation
    assert [(m.worker_id, m.rank) for m in table.members] == [("w0", 0), ("w1", 1), ("w2", 2)]
    assert _sizes(table) == {"w0": 24, "w1": 24, "w2": 12}
    validate_table([m.ranges for m in table.members], BATCH)
    assert "slices by speed re-planned at step 2: predicted step 400 ms -> 240 ms" in d.reason
    assert f"in generation {first.generation}'s group" in d.reason
    assert d.state.status.split.sizes == {"w0": 24, "w1": 24, "w2": 12}
    # the members switch in place and say so; the same rates a look later: kept, no switch for nothing
    s = d.state
    for wid in ("w0", "w1", "w2"):
        s = decide(s, _ev(Ready(job_id="j", worker_id=wid, generation=table.generation, step=2)), T0 + 2100,
                   SPEC).state
    d = _tick(s, T0 + 3000, 7, {"w0": (160, 1.6), "w1": (160, 1.6), "w2": (100, 2.0)})
    assert not _tables(d)
    d = _tick(d.state, T0 + 4000, 12, {"w0": (280, 2.8), "w1": (280, 2.8), "w2": (160, 3.2)})
    assert not _tables(d) and d.state.status.split.step == 12  # looked, kept: the next look at 22
    # w2 became as fast as the others (120 samples/s each): followed at the next look, step 22
    d = _tick(d.state, T0 + 5000, 17, {"w0": (400, 3.8), "w1": (400, 3.8), "w2": (220, 3.7)})
    assert not _tables(d)
    d = _tick(d.state, T0 + 6000, 22, {"w0": (520, 4.8), "w1": (520, 4.8), "w2": (280, 4.2)})
    (again,) = _tables(d)
    sizes = _sizes(again)
    assert sizes["w2"] > 12 and sum(sizes.values()) == BATCH, sizes
    assert again.continues == table.generation
    assert "slices by speed re-planned at step 22" in d.reason


def test_a_balanced_job_is_looked_at_once_early_then_every_steps() -> None:
    s, first = _three_active()
    work = {w: (40, 0.4) for w in ("w0", "w1", "w2")}
    d = _tick(s, T0 + 1000, slices.FIRST_LOOK, work)
    assert not _tables(d) and d.state.status.split.step == slices.FIRST_LOOK
    assert d.state.status.split.sizes == {"w0": 20, "w1": 20, "w2": 20}  # looked at: every steps from now
    d = _tick(d.state, T0 + 2000, slices.FIRST_LOOK + 2, {w: (80, 0.8 if w != "w2" else 1.6) for w in work})
    assert not _tables(d)  # w2 slowed down, but the next look is at step 12


def test_a_gain_under_min_gain_is_not_worth_a_switch() -> None:
    ids = ["w0", "w1", "w2"]
    split = Split(rates={"w0": 100.0, "w1": 100.0, "w2": 92.0}, sizes={"w0": 20, "w1": 20, "w2": 20},
                  generation=3, step=0)
    look = slices.look(split, ids, 60, 3, 10, 10)
    assert not look.replan and "less than 5% shorter" in look.reason
    split = Split(rates={"w0": 100.0, "w1": 100.0, "w2": 85.0}, sizes={"w0": 20, "w1": 20, "w2": 20},
                  generation=3, step=0)
    assert slices.look(split, ids, 60, 3, 10, 10).replan


def test_a_membership_change_re_plans_by_the_rates_known_and_forgets_the_departed() -> None:
    s, _ = _three_active()
    s = _tick(s, T0 + 1000, 3, {"w0": (100, 1.0), "w1": (100, 1.0), "w2": (100, 4.0)}).state
    d = decide(s, _ev(WorkerExited(job_id="j", worker_id="w1", signal=9)), T0 + 1100, SPEC)
    (table,) = _tables(d)
    assert _sizes(table) == {"w0": 48, "w2": 12}
    assert "slices by speed: w0 48 (100/s), w2 12 (25/s)" in d.reason
    assert set(d.state.status.split.rates) == {"w0", "w2"}


def test_no_look_while_a_generation_forms_or_before_its_own_steps() -> None:
    s, first = _three_active()
    # a step reported by an older generation (high_step_generation behind): no look
    stale = Tick(steps={"w0": StepSeen(first.generation - 1, 50)},
                 work={w: slices.Work(1000, 10.0 if w != "w2" else 20.0) for w in ("w0", "w1", "w2")})
    assert not _tables(decide(s, stale, T0 + 1000, SPEC))
    # equal slices by default: never a look
    equal = SPEC.model_copy(update={"batch_split": "equal"})
    s2, _ = _three_active(equal)
    d = _tick(s2, T0 + 1000, 50, {"w0": (100, 1.0), "w1": (100, 1.0), "w2": (100, 2.0)}, spec=equal)
    assert not _tables(d) and d.state.status.split == Split()


def test_heartbeat_counters_reach_the_tick_and_by_speed_jobs_are_sampled_every_second() -> None:
    beats = [Heartbeat(worker_id="w0", step=3, work_samples=90, work_seconds=1.5).model_dump_json(),
             Heartbeat(worker_id="w1", step=3).model_dump_json(), None, b"not json"]
    assert _work_seen(beats) == {"w0": slices.Work(90, 1.5)}
    assert _progress_ms(SPEC, 5000) == 1000
    assert _progress_ms(SPEC.model_copy(update={"batch_split": "equal"}), 5000) == 5000
    # the split survives the state hash (a coordinator that takes the job over goes on)
    split = Split(rates={"w0": 1.5}, seen={"w0": [3, 2.0]}, sizes={"w0": 4}, generation=2, step=7)
    assert JobStatus.from_hash(JobStatus(split=split).to_hash()).split == split
    assert JobStatus.from_hash({"state": "running"}).split == Split()


@pytest.mark.parametrize("fields, said", [
    ({"batch_split": "fastest"}, "batch_split: Input should be 'equal' or 'by_speed'"),
    ({"batch_split": "by_speed", "shard_size": 2, "min_workers": 2, "max_workers": 2, "global_batch_size": 4},
     "batch_split by_speed applies to data parallelism (shard_size 1)"),
    ({"batch_split": "by_speed", "shard_strategy": "round_robin"}, "use shard_strategy contiguous, not round_robin"),
    ({"batch_split_every": 0}, "batch_split_every: Input should be greater than or equal to 1"),
])
def test_bad_values_are_refused_in_one_line(fields, said) -> None:
    with pytest.raises(ConfigError) as err:
        parse_spec({"name": "j", **fields})
    assert said in str(err.value) and "\n" not in str(err.value)
    assert JobSpec(name="j").batch_split == "equal"
    assert JobState.RUNNING  # imported for the reader: the state a look needs
