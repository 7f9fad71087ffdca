"""Spreading job leases across coordinator replicas (pure; the loop does the Redis side).

Leases alone are first come, first served: the replica that starts first, or refreshes
first after an outage, ends up leading every job, and a standby started later leads
nothing. So each replica publishes its load (how many jobs it leads) in the
``shoal:coordinators`` registry every lease refresh, and a replica leading more than its
fair share hands the excess over: it names the least loaded live replica in the job's
``handoff`` key (a short PX) and releases the lease; the lease script then lets only the
named replica take it until the hint expires, after which anyone may (the named replica
may have died). A replica is only counted, as a share-holder or an heir, once its entry has
moved on since the previous look: a dead replica's entry still looks recent for a while,
and a job handed to it would wait for the hint to expire.

Taking a free lease is never held back for balance: a job without a leader is taken at
once by whoever sees it first, and balance is restored afterwards. Handing over a job costs
its events one lease refresh period of waiting (they stay in the stream, nothing is lost)
and never touches its workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: A registry entry older than this many lease TTLs belongs to a replica taken for dead.
STALE_LEASES = 3


@dataclass(frozen=True)
class Replica:
    """One registry entry: the replica's lease token, when it was last seen (Redis ms) and
    how many jobs it leads."""

    token: str
    seen_ms: int
    leads: int


def encode_entry(seen_ms: int, leads: int) -> str:
    return f"{seen_ms}:{leads}"


def parse_registry(raw: dict, now_ms: int, lease_ms: int) -> tuple[list[Replica], list[str]]:
    """The live replicas of a registry HGETALL, and the tokens of stale or unreadable entries
    (to delete). An entry is stale when not refreshed for ``STALE_LEASES`` lease TTLs."""
    live, stale = [], []
    for k, v in raw.items():
        token = k.decode() if isinstance(k, bytes) else str(k)
        try:
            seen, leads = (int(x) for x in (v.decode() if isinstance(v, bytes) else str(v)).split(":"))
        except ValueError:
            stale.append(token)
            continue
        if now_ms - seen > STALE_LEASES * lease_ms or leads < 0:
            stale.append(token)
        else:
            live.append(Replica(token, seen, leads))
    return live, stale


@dataclass(frozen=True)
class Handoffs:
    """What a replica should hand over: ``(job_id, target token)`` pairs, and why."""

    moves: tuple[tuple[str, str], ...]
    reason: str


def plan_handoffs(me: str, sheddable: list[str], live: list[Replica]) -> Handoffs:
    """Which of this replica's jobs to hand to which replicas.

    ``sheddable`` lists the jobs this replica leads, most willingly given first (the loop
    puts finished jobs first). ``live`` must include this replica's own, current entry.
    The fair share is ``ceil(total leads / live replicas)``; this replica hands over jobs
    while it leads more than that and the least loaded replica (projected, counting the
    moves already planned) would still lead fewer than this one after the move. Only the
    most loaded replicas ever move jobs, so two replicas never trade a job back and forth
    on one consistent view."""
    loads = {r.token: r.leads for r in live}
    if me not in loads or len(loads) < 2:
        return Handoffs((), "no other live replica")
    total = sum(loads.values())
    share = math.ceil(total / len(loads))
    if loads[me] <= share:
        return Handoffs((), f"leads {loads[me]} of {total} jobs; fair share {share} across {len(loads)} replicas")
    moves = []
    for job in sheddable:
        if loads[me] <= share:
            break
        target = min((t for t in loads if t != me), key=lambda t: (loads[t], t))
        if loads[target] + 1 >= loads[me]:
            break
        moves.append((job, target))
        loads[me] -= 1
        loads[target] += 1
    if not moves:
        return Handoffs((), f"leads {loads[me]} of {total} jobs; no replica would be less loaded after a move")
    return Handoffs(tuple(moves), f"leads {loads[me] + len(moves)} of {total} jobs, over the fair share of {share} "
                                  f"across {len(loads)} replicas: handing over {len(moves)}")
