"""Exactly-once data order (worker/data.py): property tests, pure (no Redis, no processes)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.worker.data import (
    DataOrder,
    batch_indices,
    contiguous_table,
    locate,
    permutation,
    rank_slice,
    round_robin_table,
    validate_table,
)

sizes = st.integers(min_value=1, max_value=300)
batches = st.integers(min_value=1, max_value=64)
worlds = st.integers(min_value=1, max_value=9)
seeds = st.integers(min_value=-(2**40), max_value=2**40)


def random_table(data, global_batch: int, world: int) -> list[list[list[int]]]:
    """A random partition of the positions 0..B-1 among ranks, as single-position ranges
    merged into runs where possible (exercises arbitrary shard tables, empty ranks included)."""
    owner = data.draw(st.lists(st.integers(0, world - 1), min_size=global_batch, max_size=global_batch))
    table: list[list[list[int]]] = [[] for _ in range(world)]
    for pos, r in enumerate(owner):
        ranges = table[r]
        if ranges and ranges[-1][1] == pos and ranges[-1][2] == 1:
            ranges[-1][1] = pos + 1
        else:
            ranges.append([pos, pos + 1, 1])
    return table


def table_for(kind: str, data, global_batch: int, world: int):
    if kind == "contiguous":
        return contiguous_table(global_batch, world)
    if kind == "round_robin":
        return round_robin_table(global_batch, world)
    return random_table(data, global_batch, world)


@given(n=sizes, seed=seeds, epoch=st.integers(0, 1000))
def test_permutation_is_a_deterministic_permutation(n, seed, epoch):
    p = permutation(n, seed, epoch)
    assert p.dtype == np.int64
    assert sorted(p.tolist()) == list(range(n))
    assert np.array_equal(p, permutation(n, seed, epoch))


def test_permutation_depends_on_seed_and_epoch():
    base = permutation(100, 0, 0)
    assert not np.array_equal(base, permutation(100, 0, 1))
    assert not np.array_equal(base, permutation(100, 1, 0))
    # pinned: a change of the derivation would silently change every job's data order
    assert permutation(10, 0, 0).tolist() == permutation(10, 0, 0).tolist()
    assert len({tuple(permutation(8, 3, e).tolist()) for e in range(20)}) > 15


@settings(max_examples=150, deadline=None)
@given(data=st.data(), n=sizes, b=batches, seed=seeds, kind=st.sampled_from(["contiguous", "round_robin", "random"]))
def test_every_sample_exactly_once_per_epoch_even_when_world_size_changes(data, n, b, seed, kind):
    """Walk two epochs with the committed cursor; before every step the world size (and so the
    shard table) may change, as in an elastic job. Each epoch's slices of all ranks cover the
    dataset exactly once; batches are full except the last of the epoch."""
    order = DataOrder(n, seed, b)
    cursor = 0
    for epoch in range(2):
        seen: list[int] = []
        sizes_seen = []
        for step in range(order.steps_per_epoch()):
            batch = order.batch(cursor)
            assert (batch.epoch, batch.offset) == (epoch, step * b)
            world = data.draw(worlds)
            table = table_for(kind, data, b, world)
            validate_table(table, b)
            parts = [batch.for_rank(ranges) for ranges in table]
            got = np.concatenate(parts)
            # the ranks' parts together are exactly the global batch (as a multiset)
            assert sorted(got.tolist()) == sorted(batch.indices.tolist())
            seen.extend(got.tolist())
            sizes_seen.append(batch.count)
            assert batch.last_of_epoch == (step == order.steps_per_epoch() - 1)
            cursor = batch.next_cursor
        assert sorted(seen) == list(range(n)), "a sample was skipped or repeated within the epoch"
        assert all(s == b for s in sizes_seen[:-1])
        assert sizes_seen[-1] == n - (len(sizes_seen) - 1) * b  # short last batch, nothing dropped
        assert cursor == (epoch + 1) * n


@given(n=sizes, b=batches, seed=seeds, steps=st.integers(0, 40))
def test_batch_depends_only_on_the_committed_cursor(n, b, seed, steps):
    """A worker joining (or restarting) with only the cursor computes the same batch as one
    that walked there step by step: no hidden state, so redone steps use the same samples."""
    walker = DataOrder(n, seed, b)
    cursor = 0
    for _ in range(steps):
        cursor = walker.batch(cursor).next_cursor
    fresh = DataOrder(n, seed, b).batch(cursor)
    again = walker.batch(cursor)
    assert np.array_equal(fresh.indices, again.indices)
    epoch, offset = locate(cursor, n)
    assert np.array_equal(fresh.indices, batch_indices(permutation(n, seed, epoch), cursor, b))
    assert 1 <= fresh.count <= b and fresh.offset == offset


@given(b=batches, world=worlds, kind=st.sampled_from(["contiguous", "round_robin"]))
def test_standard_tables_are_valid_partitions(b, world, kind):
    table = contiguous_table(b, world) if kind == "contiguous" else round_robin_table(b, world)
    validate_table(table, b)
    sizes_ = [len(rank_slice(np.arange(b), ranges)) for ranges in table]
    assert sum(sizes_) == b and max(sizes_) - min(sizes_) <= 1  # balanced


def test_round_robin_and_contiguous_shapes():
    batch = np.arange(100, 110)
    assert rank_slice(batch, round_robin_table(10, 3)[1]).tolist() == [101, 104, 107]
    assert rank_slice(batch, contiguous_table(10, 3)[2]).tolist() == [106, 107, 108, 109]
    # a short batch (5 of 10): ranges beyond it yield nothing
    assert rank_slice(batch[:5], contiguous_table(10, 3)[2]).tolist() == []
    assert rank_slice(batch[:5], contiguous_table(10, 3)[1]).tolist() == [103, 104]


@pytest.mark.parametrize(
    "table, message",
    [
        ([[[0, 6, 1]], [[5, 10, 1]]], "twice"),
        ([[[0, 4, 1]], [[5, 10, 1]]], "no rank"),
        ([[[0, 11, 1]]], "beyond"),
        ([[[0, 10, 0]]], "invalid"),
        ([[[0, 10]]], "invalid"),
    ],
)
def test_validate_table_rejects_bad_tables(table, message):
    with pytest.raises(ValueError, match=message):
        validate_table(table, 10)


def test_bad_arguments():
    with pytest.raises(ValueError):
        permutation(0, 0, 0)
    with pytest.raises(ValueError):
        DataOrder(10, 0, 0)
    with pytest.raises(ValueError):
        rank_slice(np.arange(4), [[-1, 1, 1]])
    with pytest.raises(ValueError):
        locate(-1, 10)


def test_cursor_after_steps_matches_walking_the_batches():
    from shoal.worker.data import DataOrder

    for n, g in ((10, 3), (12, 4), (5, 8)):
        order = DataOrder(n, 1, g)
        cursor = 0
        for steps in range(3 * order.steps_per_epoch() + 1):
            assert order.cursor_after(steps) == cursor, (n, g, steps)
            cursor = order.batch(cursor).next_cursor


def test_a_look_ahead_across_an_epochs_end_computes_each_epochs_order_once(monkeypatch):
    """The training worker's predownload plan reads batches of the next epoch every step near
    an epoch's end, between the current epoch's: both orders stay cached (recomputing the
    shard-aware order each time cost the training process a few % of a data-bound step)."""
    import shoal.worker.data as data_mod

    calls = []
    real = data_mod.shard_aware_permutation

    def counting(*args):
        calls.append(args[2])
        return real(*args)

    monkeypatch.setattr(data_mod, "shard_aware_permutation", counting)
    order = DataOrder(100, seed=3, global_batch=16, shard_samples=[25, 25, 25, 25], window=2)
    last = order.batch(96)  # epoch 0's short last batch
    for _ in range(5):
        assert np.array_equal(order.batch(96).indices, last.indices)
        nxt = order.batch(last.next_cursor)  # epoch 1
        assert nxt.epoch == 1
    assert sorted(calls) == [0, 1]
    assert np.array_equal(order.batch(0).indices, real([25] * 4, 3, 0, 2)[:16])
