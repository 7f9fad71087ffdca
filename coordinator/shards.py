"""Shard planning: split the index space ``0..n-1`` among ranks, disjoint and complete.

Ranges are ``(start, stop, step)`` triples, half-open like ``range``. Strategies:

- ``contiguous`` (default): rank r gets one block; the remainder ``n % w`` goes one extra
  sample each to the first ranks.
- ``round_robin``: rank r gets ``r, r+w, r+2w, ...`` (one strided range).
- ``hash``: the space is cut into at most 1024 equal blocks and each block goes to the
  worker with the highest ``sha256(worker_id, block)`` (rendezvous hashing), so a
  membership change moves only the blocks of the worker that came or went. A worker can
  get nothing when blocks are few.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

Range = tuple[int, int, int]

MAX_HASH_BLOCKS = 1024


def _contiguous(n: int, world: int) -> list[list[Range]]:
    base, rem = divmod(n, world)
    out, start = [], 0
    for rank in range(world):
        size = base + (1 if rank < rem else 0)
        out.append([(start, start + size, 1)] if size else [])
        start += size
    return out


def _round_robin(n: int, world: int) -> list[list[Range]]:
    return [[(rank, n, world)] if rank < n else [] for rank in range(world)]


def _score(worker_id: str, block: int) -> bytes:
    return hashlib.sha256(f"{worker_id}/{block}".encode()).digest()


def _hash(n: int, worker_ids: Sequence[str]) -> list[list[Range]]:
    blocks = min(n, MAX_HASH_BLOCKS)
    size, rem = divmod(n, blocks)
    out: list[list[Range]] = [[] for _ in worker_ids]
    start = 0
    for b in range(blocks):
        stop = start + size + (1 if b < rem else 0)
        owner = max(range(len(worker_ids)), key=lambda i: _score(worker_ids[i], b))
        ranges = out[owner]
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], stop, 1)
        else:
            ranges.append((start, stop, 1))
        start = stop
    return out


STRATEGIES = ("contiguous", "round_robin", "hash")


def plan_ranges(strategy: str, n: int, worker_ids: Sequence[str]) -> list[list[Range]]:
    """Ranges per rank (rank = position in ``worker_ids``). Raises ValueError on bad input."""
    if n < 0:
        raise ValueError(f"negative shard space {n}")
    if not worker_ids:
        return []
    if strategy == "contiguous":
        return _contiguous(n, len(worker_ids))
    if strategy == "round_robin":
        return _round_robin(n, len(worker_ids))
    if strategy == "hash":
        return _hash(n, worker_ids) if n else [[] for _ in worker_ids]
    raise ValueError(f"unknown shard strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


def expand(ranges: Sequence[Sequence[int]]) -> list[int]:
    """Every index the ranges name, in order."""
    out: list[int] = []
    for start, stop, step in ranges:
        out.extend(range(start, stop, step))
    return out


def count(ranges: Sequence[Sequence[int]]) -> int:
    return sum(len(range(s, e, st)) for s, e, st in ranges)
