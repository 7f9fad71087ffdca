"""Streaming datasets: the shard-aware order, shard owners and the per-step assignment (pure)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.coordinator.owners import from_ranges, plan_owners, to_ranges
from shoal.worker.data import DataOrder, validate_table
from shoal.worker.stream_order import (
    _balanced,
    assign_step,
    epoch_windows,
    owner_ranks,
    shard_aware_permutation,
    shard_of,
    shard_offsets,
)

SHARDS = [50] * 30 + [17, 33]


def test_order_is_a_permutation_and_a_pure_function():
    perm = shard_aware_permutation(SHARDS, seed=3, epoch=1, window=4)
    assert sorted(perm.tolist()) == list(range(sum(SHARDS)))
    assert np.array_equal(perm, shard_aware_permutation(SHARDS, seed=3, epoch=1, window=4))
    assert not np.array_equal(perm, shard_aware_permutation(SHARDS, seed=3, epoch=2, window=4))
    assert not np.array_equal(perm, shard_aware_permutation(SHARDS, seed=4, epoch=1, window=4))


def test_every_round_of_a_window_takes_its_shards_in_one_cycle():
    """Inside a window, while all its shards have samples left, sample p and sample p + m
    (m: the window's shards) come from the same shard: any m consecutive samples hold one of
    each, so a batch's share of each shard (and of each rank's shards) is even wherever the
    batch starts - a fresh shard order per round left the partial rounds at a batch's two
    ends uneven, and the balancing read those samples remotely."""
    shards = [12] * 9 + [7] * 3
    offsets = shard_offsets(shards)
    for epoch in range(3):
        perm = shard_aware_permutation(shards, seed=5, epoch=epoch, window=4)
        from_shard = shard_of(perm, offsets)
        at = 0
        for win in epoch_windows(shards, 5, epoch, 4):
            m, full = len(win), min(shards[s] for s in win.tolist())
            rounds = from_shard[at : at + m * full].reshape(full, m)
            assert (rounds == rounds[0]).all() and sorted(rounds[0].tolist()) == sorted(win.tolist())
            at += sum(shards[s] for s in win.tolist())


def test_consecutive_batches_touch_few_shards():
    offsets = shard_offsets(SHARDS)
    order = DataOrder(sum(SHARDS), 7, 40, shard_samples=SHARDS, window=4)
    cursor, worst = 0, 0
    while cursor < order.num_samples:
        b = order.batch(cursor)
        worst = max(worst, len(set(shard_of(b.indices, offsets).tolist())))
        cursor = b.next_cursor
    assert worst <= 8  # one window, or two at a window's edge (a plain permutation: ~all 32)
    plain = DataOrder(sum(SHARDS), 7, 40).batch(0)
    assert len(set(shard_of(plain.indices, offsets).tolist())) > 15


def test_global_batches_do_not_depend_on_the_world_size():
    # the order has no world-size input at all; the split of any batch partitions it for any W
    order = DataOrder(sum(SHARDS), 1, 64, shard_samples=SHARDS, window=4)
    offsets = shard_offsets(SHARDS)
    for world in (1, 2, 3, 5):
        owners, _ = plan_owners(None, [f"w{i}" for i in range(world)], len(SHARDS))
        owner = owner_ranks(owners, len(SHARDS), {f"w{i}": i for i in range(world)})
        b = order.batch(64 * 3)
        a = assign_step(shard_of(b.indices, offsets), owner, world)
        validate_table([list(a.ranges(r)) for r in range(world)], b.count)
        got = np.concatenate([b.for_rank(a.ranges(r)) for r in range(world)])
        assert sorted(got.tolist()) == sorted(b.indices.tolist())


def test_map_style_order_is_unchanged():
    assert np.array_equal(DataOrder(100, 5, 10).perm(0), DataOrder(100, 5, 10, shard_samples=None).perm(0))


def test_bad_input():
    with pytest.raises(ValueError, match="window"):
        shard_aware_permutation([3], 0, 0, 0)
    with pytest.raises(ValueError, match="add up"):
        DataOrder(10, 0, 2, shard_samples=[3, 3])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=12), st.integers(1, 8), st.integers(0, 3), st.data())
def test_assignment_partitions_and_balances(shards, world, tolerance, data):
    shards = np.array(shards)
    owners, _ = plan_owners(None, [f"w{i}" for i in range(world)], 21)
    owner = owner_ranks(owners, 21, {f"w{i}": i for i in range(world)})
    held = data.draw(st.one_of(st.none(), st.lists(st.integers(-1, world - 1), min_size=21, max_size=21).map(np.array)))
    a = assign_step(shards, owner, world, tolerance=tolerance, held=held)
    validate_table([list(a.ranges(r)) for r in range(world)], len(shards))
    assert a.balance_error <= tolerance + 1
    for r in range(world):  # remote exactly where the reader does not own the shard
        assert all(a.remote[p] == (owner[shards[p]] != r) for p in a.positions[r])
    if held is not None:  # the same counts as without a preference: only which samples move differs
        b = assign_step(shards, owner, world, tolerance=tolerance)
        assert [len(p) for p in a.positions] == [len(p) for p in b.positions]
        assert a.remote_count() == b.remote_count()


def test_a_sample_that_must_move_goes_to_the_rank_holding_its_shard():
    """Balancing moves samples of the fullest rank; among them, one whose shard the receiver
    read whole in the epoch before (``held``) moves first - it is in the receiver's cache."""
    owner = np.array([0, 0, 0, 1])
    shards = np.array([0, 1, 2, 0, 1, 2, 3, 3])  # rank 0 owns 6 samples, rank 1 two
    plain = assign_step(shards, owner, 2)
    assert plain.positions[1].tolist() == [4, 5, 6, 7]  # the highest positions of rank 0
    held = np.array([-1, -1, -1, -1])
    held[0] = 1  # rank 1 read shard 0 whole before
    a = assign_step(shards, owner, 2, held=held)
    assert a.positions[1].tolist() == [0, 3, 6, 7]  # both samples of shard 0 move
    assert a.remote_count(1) == 2 and a.balance_error == 0
    held[0], held[2] = 1, 1
    a = assign_step(shards, owner, 2, held=held)
    assert a.positions[1].tolist() == [3, 5, 6, 7]  # the highest of the held ones first


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=40), st.integers(1, 4), st.integers(0, 2), st.data())
def test_the_even_case_shortcut_splits_exactly_as_the_balancing_does(shards, world, tolerance, data):
    """assign_step returns at once when every owner takes part and the counts are even: the
    split must be the one the general balancing computes (every rank computes the same)."""
    shards = np.array(shards, dtype=np.int64)
    owner = np.array(data.draw(st.lists(st.integers(-1, world - 1), min_size=10, max_size=10)), dtype=np.int64)
    active = data.draw(st.one_of(st.none(), st.sets(st.integers(0, world - 1), min_size=1).map(sorted)))
    a = assign_step(shards, owner, world, active, tolerance)
    ranks = list(range(world)) if active is None else active
    owned_by = owner[shards]
    live = np.isin(owned_by, ranks)
    b = _balanced(np.where(live, owned_by, -1), owned_by, world, ranks, tolerance)
    assert [p.tolist() for p in a.positions] == [p.tolist() for p in b.positions]
    assert a.remote.tolist() == b.remote.tolist()


def test_assignment_prefers_owners_and_skips_inactive_ranks():
    owner = np.array([0, 0, 1, 1])
    shards = np.array([0, 2, 1, 3, 0, 2])
    a = assign_step(shards, owner, 2)
    assert a.remote_count() == 0 and a.balance_error == 0
    a = assign_step(shards, owner, 2, active=[1])  # rank 0 receives state: takes nothing
    assert len(a.positions[0]) == 0 and len(a.positions[1]) == 6 and a.remote_count() == 3


def _load(plan):
    return {w: len(from_ranges(r)) for w, r in plan.items()}


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 60), st.lists(st.sets(st.integers(0, 7), min_size=1), min_size=1, max_size=6))
def test_owners_are_complete_balanced_and_sticky(num_shards, memberships):
    previous = None
    for members in memberships:
        ids = [f"w{i}" for i in sorted(members)]
        plan, _ = plan_owners(previous, ids, num_shards)
        every = sorted(s for r in plan.values() for s in from_ranges(r))
        assert every == list(range(num_shards))  # one owner each
        loads = _load(plan).values()
        assert max(loads) - min(loads) <= 1
        if previous:
            stayed = [w for w in ids if w in previous]
            joined = [w for w in ids if w not in previous]
            left = [w for w in previous if w not in plan]
            for w in stayed:
                before, after = set(from_ranges(previous[w])), set(from_ranges(plan[w]))
                if joined and not left:  # a stayer only loses shards (to joiners), gains none
                    assert after <= before
                if not joined:  # only leavers' shards move: a stayer loses nothing
                    assert before <= after
        previous = plan


def test_owner_ranges_are_compact():
    assert to_ranges([5, 1, 2, 3, 7]) == [(1, 4), (5, 6), (7, 8)]
    plan, why = plan_owners(None, ["w0", "w1"], 4)
    assert plan == {"w0": [(0, 1), (2, 3)], "w1": [(1, 2), (3, 4)]} and "4 shards" in why


def test_stratified_window_keeps_remote_reads_rare():
    """Owners rebalanced per window + the stratified shuffle: over an epoch with 3 ranks, few
    samples are read remotely (a uniform shuffle inside windows of static owners: ~17 %)."""
    from shoal.worker.stream_order import epoch_windows, window_owners

    shards = [61] * 81 + [59]
    for world in (2, 3, 4):
        owners, _ = plan_owners(None, [f"w{i}" for i in range(world)], len(shards))
        owner = owner_ranks(owners, len(shards), {f"w{i}": i for i in range(world)})
        order = DataOrder(sum(shards), 1, 64, shard_samples=shards, window=16)
        offsets = shard_offsets(shards)
        eff = window_owners(shards, epoch_windows(shards, 1, 0, 16), owner, world)
        assert sorted(set(eff.tolist())) == list(range(world))
        cursor, remote = 0, 0
        while cursor < order.num_samples:
            b = order.batch(cursor)
            a = assign_step(shard_of(b.indices, offsets), eff, world)
            assert a.balance_error <= 1
            remote += a.remote_count()
            cursor = b.next_cursor
        assert remote / order.num_samples < 0.05, (world, remote)


def test_window_owners_move_only_what_balances():
    from shoal.worker.stream_order import window_owners

    owner = np.array([0, 0, 0, 0, 1, 1])
    eff = window_owners([10] * 6, [np.array([0, 1, 2, 3, 4, 5])], owner, 2)
    assert (eff == 0).sum() == 3 and (eff == 1).sum() == 3 and eff[4] == 1 and eff[5] == 1
    eff = window_owners([10] * 4, [np.array([0, 1]), np.array([2, 3])], np.array([-1, -1, 0, 1]), 2)
    assert eff.tolist() == [0, 1, 0, 1]
