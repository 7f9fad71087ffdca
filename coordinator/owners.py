"""Shard owners of a streaming dataset: which worker caches (and reads locally) which shards.

A pure function of the previous owners, the planned members and the number of shards
(:func:`plan_owners`), so the coordinator - which never reads storage - plans them with each
generation from the ``num_shards`` its workers reported when joining. Sticky: a member keeps
its shards while it stays; a leaver's shards go, one by one, to the least-loaded survivors; a
joiner takes shards from the most-loaded members until every member owns ``num_shards / W``
rounded down or up. Nobody else's shards move, so a membership change invalidates only the
caches it must.

The wire form (``ShardTable.shard_owners``) is worker id -> half-open ``[start, stop]``
ranges of shard numbers (:func:`to_ranges`): compact and readable with ``redis-cli``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def to_ranges(shards: Sequence[int]) -> list[tuple[int, int]]:
    """Shard numbers as sorted, merged half-open ``(start, stop)`` ranges."""
    out: list[tuple[int, int]] = []
    for s in sorted(set(int(x) for x in shards)):
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], s + 1)
        else:
            out.append((s, s + 1))
    return out


def from_ranges(ranges: Sequence[Sequence[int]]) -> list[int]:
    """The shard numbers ``ranges`` name, ascending."""
    return sorted({s for start, stop in ranges for s in range(int(start), int(stop))})


def plan_owners(previous: Mapping[str, Sequence[Sequence[int]]] | None, members: Sequence[str],
                num_shards: int) -> tuple[dict[str, list[tuple[int, int]]], str]:
    """Owners for ``members`` (in rank order) of shards ``0..num_shards-1``, and a reason.

    ``previous``: the last plan (wire form; None or empty for the first). Every shard gets
    exactly one owner; each member owns ``num_shards // W`` or one more. A member of
    ``previous`` that is still a member keeps its shards unless it holds more than its share
    (a joiner's share is taken from the most-loaded, highest shard numbers first). ValueError
    on a negative ``num_shards``; no members -> no owners."""
    if num_shards < 0:
        raise ValueError(f"negative number of shards {num_shards}")
    if not members:
        return {}, "no members"
    owned: dict[str, list[int]] = {m: [] for m in members}
    taken: set[int] = set()
    for wid, ranges in (previous or {}).items():
        if wid in owned:
            for s in from_ranges(ranges):
                if s < num_shards and s not in taken:
                    owned[wid].append(s)
                    taken.add(s)
    order = {m: i for i, m in enumerate(members)}

    def least() -> str:
        return min(members, key=lambda m: (len(owned[m]), order[m]))

    def most() -> str:
        return max(members, key=lambda m: (len(owned[m]), -order[m]))

    orphans = [s for s in range(num_shards) if s not in taken]
    for s in orphans:  # a leaver's (or every, the first time) shard to the least-loaded
        owned[least()].append(s)
    moved = 0
    while len(owned[most()]) - len(owned[least()]) > 1:
        src, dst = most(), least()
        owned[src].sort()
        owned[dst].append(owned[src].pop())
        moved += 1
    plan = {m: to_ranges(owned[m]) for m in members}
    reason = f"{num_shards} shards over {len(members)} members: {len(orphans)} without owner assigned, {moved} moved"
    return plan, reason
