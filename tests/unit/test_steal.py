"""Slices evened out within a step (:mod:`shoal.worker.steal`): the chunks of a step's blocks,
the default chunk, and the order a member trains what it claims (the claims themselves, with
a real Redis: ``tests/control/test_store.py``)."""

from __future__ import annotations

import pytest

from shoal.worker.steal import MIN_CHUNK, PARTS_PER_MEMBER, StepShares, default_chunk, parts


def test_blocks_are_cut_in_chunks_from_the_front_the_last_one_short() -> None:
    shares = StepShares(blocks=((1, 2, 3, 4, 5), (6, 7), ()), rank=0, chunk=2, key="steal/1/0")
    assert shares.chunks == [3, 1, 0]
    assert [shares.part(0, i) for i in range(3)] == [[1, 2], [3, 4], [5]]
    assert shares.part(1, 0) == [6, 7]
    with pytest.raises(ValueError, match="chunk"):
        StepShares(blocks=((1,),), rank=0, chunk=0, key="k")
    with pytest.raises(ValueError, match="rank 1"):
        StepShares(blocks=((1,),), rank=1, chunk=1, key="k")


def test_a_member_trains_the_chunks_it_claims_in_the_order_claimed() -> None:
    shares = StepShares(blocks=((10, 11, 12), (20, 21, 22, 23)), rank=0, chunk=2, key="steal/4/9")
    answers = iter([(0, 0), (0, 1), (1, 1), None])
    asked = []

    def claim(key, block, chunks):
        asked.append((key, block, list(chunks)))
        return next(answers)

    assert list(parts(shares, claim)) == [(0, [10, 11]), (0, [12]), (1, [22, 23])]
    assert asked == [("steal/4/9", 0, [2, 2])] * 4


def test_the_default_chunk_is_a_sixteenth_of_a_slice_at_the_largest_world_never_tiny() -> None:
    assert default_chunk(14_400, 3) == 14_400 // (3 * PARTS_PER_MEMBER)
    assert default_chunk(48, 3) == MIN_CHUNK
    assert default_chunk(1_000, 0) == -(-1_000 // PARTS_PER_MEMBER)
