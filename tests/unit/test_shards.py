"""Shard planning properties: disjoint, complete, balanced; hash strategy moves little."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.coordinator.shards import STRATEGIES, count, expand, plan_ranges


def _ids(k: int) -> list[str]:
    return [f"w{i}" for i in range(k)]


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 5000), world=st.integers(1, 64), strategy=st.sampled_from(STRATEGIES))
def test_ranges_are_disjoint_and_cover_every_sample(n: int, world: int, strategy: str) -> None:
    plan = plan_ranges(strategy, n, _ids(world))
    assert len(plan) == world
    seen = [i for ranges in plan for i in expand(ranges)]
    assert sorted(seen) == list(range(n))  # each index exactly once
    assert sum(count(r) for r in plan) == n


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 5000), world=st.integers(1, 64))
def test_contiguous_gives_the_remainder_to_the_first_ranks(n: int, world: int) -> None:
    sizes = [count(r) for r in plan_ranges("contiguous", n, _ids(world))]
    base, rem = divmod(n, world)
    assert sizes == [base + 1] * rem + [base] * (world - rem)


def test_round_robin_is_strided() -> None:
    plan = plan_ranges("round_robin", 10, _ids(3))
    assert [expand(r) for r in plan] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1024, 20000), world=st.integers(2, 16))
def test_hash_strategy_moves_only_the_leaving_workers_samples(n: int, world: int) -> None:
    ids = _ids(world)
    before = {i: w for w, r in zip(ids, plan_ranges("hash", n, ids)) for i in expand(r)}
    gone = ids[world // 2]
    rest = [w for w in ids if w != gone]
    after = {i: w for w, r in zip(rest, plan_ranges("hash", n, rest)) for i in expand(r)}
    moved = {i for i in range(n) if before[i] != after[i]}
    assert moved == {i for i in range(n) if before[i] == gone}


def test_unknown_strategy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown shard strategy 'zigzag'"):
        plan_ranges("zigzag", 10, _ids(2))
