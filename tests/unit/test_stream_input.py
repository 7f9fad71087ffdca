"""The training worker's side of a streaming dataset (pure parts, no storage): every rank's
ranges partition each batch, a rank predownloads only samples of shards it reads itself, and
the figures come from the dataset's counters."""

import numpy as np

from shoal.coordinator.owners import plan_owners
from shoal.events.models import Member, ShardTable
from shoal.worker.data import DataOrder, validate_table
from shoal.worker.stream_input import StreamInput, is_streaming
from shoal.worker.stream_order import shard_of, shard_offsets

SHARDS = [20] * 12


class Planned:
    """Records what the worker hands to ``plan`` (the dataset's interface, nothing stored)."""

    shard_samples = SHARDS
    predownload = 100

    def __init__(self) -> None:
        self.plans: list[tuple[list[int], set[int]]] = []

    def __len__(self) -> int:
        return sum(SHARDS)

    def __getitem__(self, i):
        return i

    def read(self, ids, owned):
        return list(ids)

    def plan(self, ids, owned) -> None:
        self.plans.append((list(ids), set(owned)))

    def stats(self) -> dict:
        return {"bytes_downloaded": 1000, "remote_bytes": 24, "remote_reads": 3, "cache_hits": 9, "cache_misses": 1}


def _table(world: int, generation: int = 1) -> ShardTable:
    ids = [f"w{i}" for i in range(world)]
    owners, _ = plan_owners(None, ids, len(SHARDS))
    return ShardTable(job_id="j", generation=generation, world_size=world, strategy="contiguous", num_samples=32,
                      members=[Member(worker_id=w, rank=i, ranges=[]) for i, w in enumerate(ids)],
                      shard_owners=owners)


def test_every_ranks_ranges_partition_each_batch_and_plans_name_only_its_shards():
    assert is_streaming(Planned()) and not is_streaming([1, 2])
    order = DataOrder(sum(SHARDS), 3, 32, shard_samples=SHARDS, window=4)
    offsets = shard_offsets(SHARDS)
    inputs = []
    for rank in range(3):
        ds = Planned()
        si = StreamInput(ds, order)
        si.use_table(_table(3), f"w{rank}")
        inputs.append((ds, si))
    cursor = 0
    while cursor < 2 * order.num_samples:  # two epochs: the owners are rebalanced per epoch
        batch = order.batch(cursor)
        table = [list(si.ranges(batch)) for _, si in inputs]
        validate_table(table, batch.count)
        for rank, (ds, si) in enumerate(inputs):
            si.plan_ahead(cursor, None)
            ids, owned = ds.plans[-1]
            assert ids and set(shard_of(ids, offsets).tolist()) <= owned  # only samples it reads whole
            ahead = [si.reading(cursor + k * order.num_samples) for k in range(3)]  # the plan spans epochs
            assert owned <= ahead[0] | ahead[1] | ahead[2]
        cursor = batch.next_cursor
    readers = [si.reading(0) for _, si in inputs]
    assert sorted(s for r in readers for s in r) == list(range(len(SHARDS)))  # each shard read whole once


def test_first_step_leaves_out_the_ranks_behind_and_figures_come_from_the_counters():
    order = DataOrder(sum(SHARDS), 3, 32, shard_samples=SHARDS, window=4)
    si = StreamInput(Planned(), order)
    si.use_table(_table(2), "w1")
    batch = order.batch(64)
    assert si.ranges(batch, active=[1]) == ((0, 32, 1),)  # rank 0 receives state: rank 1 takes all
    si.note_step(batch, active=[1])
    assert si.balance_error == 32 and si.step_remote > 0
    fig = si.figures()
    assert fig == {"shards_owned": 6, "balance_error": 32, "bytes_downloaded": 1024, "cache_hit_rate": 0.9,
                   "remote_reads": 3}
    assert si.last_figures == fig
    si.use_table(_table(1, generation=2), "w1")  # a table without w1: it keeps its state
    assert si.generation == 1 and si.world == 2
    alone = StreamInput(Planned(), order)
    alone.use_table(_table(1, generation=2), "w0")
    assert alone.reading(0) == frozenset(range(len(SHARDS))) and np.all(alone.epoch_owner(1) == 0)


def test_the_plan_of_each_step_is_computed_once_and_handed_on_only_when_its_shards_change(monkeypatch) -> None:
    """plan_ahead runs after every step and looks up to ``predownload`` samples ahead: each
    step's part (its ids' shards) is computed once, not again by every later plan that still
    sees it, and the dataset hears of a plan only when the shards ahead changed."""
    import shoal.worker.stream_input as stream_input

    located: list[int] = []

    def counting(ids, offsets):
        located.append(len(ids))
        return shard_of(ids, offsets)

    monkeypatch.setattr(stream_input, "shard_of", counting)
    order = DataOrder(sum(SHARDS), 3, 32, shard_samples=SHARDS, window=4)
    ds = Planned()
    si = StreamInput(ds, order)
    si.use_table(_table(2), "w0")
    steps, cursor, shards_ahead = 0, 0, []
    while cursor < 2 * order.num_samples:
        si.plan_ahead(cursor, None)
        shards_ahead.append(frozenset(shard_of(ds.plans[-1][0], shard_offsets(SHARDS)).tolist()))
        cursor = order.batch(cursor).next_cursor
        steps += 1
    lookahead = -(-ds.predownload // 16) + 1  # steps of 16 samples a rank reads in one plan, and one more
    assert sum(located) <= 2 * 32 * (steps + lookahead)  # each step located once (the split and the plan)
    changes = sum(1 for a, b in zip(shards_ahead, shards_ahead[1:]) if a != b)
    assert len(ds.plans) == changes + 1 < steps  # handed on at the start and at each change only


def test_a_plan_carried_from_step_to_step_is_the_plan_computed_afresh() -> None:
    """plan_ahead keeps the steps of its last horizon and adds the new ones: whenever it hands
    a plan on, it is the plan a fresh worker computes at that cursor - through epoch ends, an
    end cursor that cuts the horizon short, and a jump (a catch-up) to a cursor not in it."""
    order = DataOrder(sum(SHARDS), 3, 32, shard_samples=SHARDS, window=4)
    ds = Planned()
    si = StreamInput(ds, order)
    si.use_table(_table(2), "w1")
    cursors = []
    cursor = 0
    while cursor < 3 * order.num_samples:
        cursors.append(cursor)
        cursor = order.batch(cursor).next_cursor
    visits = cursors[:40] + cursors[60:]  # a jump forward
    end = cursors[-5]
    for c in visits:
        before = len(ds.plans)
        si.plan_ahead(c, end)
        fresh_ds = Planned()
        fresh = StreamInput(fresh_ds, order)
        fresh.use_table(_table(2), "w1")
        fresh.plan_ahead(c, end)
        if len(ds.plans) > before:
            assert ds.plans[-1] == fresh_ds.plans[-1], c
        else:  # not handed on: the shards ahead did not change
            assert set(shard_of(fresh_ds.plans[-1][0], shard_offsets(SHARDS)).tolist()) == \
                set(shard_of(ds.plans[-1][0], shard_offsets(SHARDS)).tolist())
    assert len(ds.plans) > 3


def test_a_steps_split_read_off_the_epochs_readers_is_assign_steps_split() -> None:
    """StreamInput.split slices the epoch's readers by position and takes the plain-int
    shortcut when nothing needs balancing: every field must be what assign_step computes from
    the batch's ids (moves preferring the epoch before's readers), for every rank, with all
    ranks and with some left out, across epochs."""
    from shoal.worker.stream_order import assign_step

    offsets = shard_offsets(SHARDS)
    order = DataOrder(sum(SHARDS), 3, 28, shard_samples=SHARDS, window=6)  # 28: partial rounds too
    for world in (1, 2, 3):
        inputs = []
        for rank in range(world):
            si = StreamInput(Planned(), order)
            si.use_table(_table(world), f"w{rank}")
            inputs.append(si)
        fast = slow = 0
        cursor = 0
        while cursor < 2 * order.num_samples:
            batch = order.batch(cursor)
            for active in (None, [world - 1]):
                held = inputs[0].epoch_owner(batch.epoch - 1) if batch.epoch else None  # the epoch before's readers
                a = assign_step(shard_of(batch.indices, offsets), inputs[0].epoch_owner(batch.epoch), world, active,
                                held=held)
                for rank, si in enumerate(inputs):
                    got = si.split(batch, active)
                    local = [p for p in a.positions[rank].tolist() if not a.remote[p]]
                    assert got.ranges == a.ranges(rank)
                    assert (got.balance_error, got.remote) == (a.balance_error, a.remote_count(rank))
                    assert got.ids.tolist() == batch.indices[local].tolist()
                    assert got.shards == frozenset(shard_of(batch.indices[local], offsets).tolist())
                    assert got.next_cursor == batch.next_cursor
                if a.remote_count() == 0 and active is None:
                    fast += 1
                elif a.remote_count():
                    slow += 1
            cursor = batch.next_cursor
        assert fast and (world == 1 or slow)  # both paths ran
