"""Elastic HSDP's replica groups: who forms a group with whom, and when a group goes whole or is
regrouped. A pure policy of the coordinator's plan (``coordinator.decide.replan`` calls
:func:`plan_groups` before every plan of a job with ``shard_size`` > 1).

The rules, in order:

1. **A group that lost a member goes whole.** A member failed, left or is draining: its other
   live members are failed with cause ``replica_group`` (they exit, their agents start them
   again, and they join new groups; their peers abort collectives with them).
2. **Groups stay on one node when they can.** Workers without a group are grouped node by node
   first (``shard_size`` of one node together, by id): FSDP all-gathers every layer over the
   shard group, and a group spread over two nodes sends that over the network and is lost with
   either node.
3. **Leftovers wait for node-mates a moment.** A node's workers that do not fill a group wait
   :data:`NODE_SETTLE_MS` from the newest leftover's join for node-mates (the agents of one
   node start their workers together, and they join within a second or two of each other)
   before they form a group across nodes - unless no more workers can join (``max_workers``
   planned).
4. **A cross-node group is regrouped once its members' nodes can each host a whole group.** When
   every node a cross-node group spans has enough waiting workers to fill a group with that
   group's members there, and another whole group holds the job's state, the group is dissolved:
   its members are failed with cause ``regrouped`` (not a failure: nothing is recorded, nobody
   aborts with them; their processes are started again and join on their own nodes). Cost:
   one heal of the new groups from the others. Meanwhile (at most :data:`REGROUP_WAIT_MS`) the
   waiting workers form no cross-node group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shoal.events.records import WorkerRecord
from shoal.events.states import PLANNED, FailureCause, WorkerState

#: How long workers that do not fill a group on their node wait for node-mates (ms from the
#: newest such worker's join) before they form a group across nodes.
NODE_SETTLE_MS = 2000
#: How long, at most, a regroup waits for its dissolved members to come back (started again
#: by their agents) before waiting workers form cross-node groups after all.
REGROUP_WAIT_MS = 30_000


def id_order(worker_id: str) -> tuple[int, str]:
    digits = "".join(ch for ch in worker_id if ch.isdigit())
    return (int(digits) if digits else 0, worker_id)


def node_of(rec: WorkerRecord) -> str:
    return rec.node or rec.host


@dataclass(frozen=True)
class Grouping:
    """What :func:`plan_groups` decided: the new worker records, the next group number, the
    workers failed with a group that lost a member (``evicted``) and those of dissolved
    cross-node groups (``regrouped``) - both to be forgotten -, when waiting workers are
    planned again (``regroup_at_ms``, 0: none wait), until when a regroup is under way, and a
    note per change for the plan's reason."""

    workers: dict[str, WorkerRecord]
    next_replica: int
    evicted: tuple[str, ...] = ()
    regrouped: tuple[str, ...] = ()
    regroup_at_ms: int = 0
    regroup_until_ms: int = 0
    notes: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.evicted or self.regrouped or self.notes)


def plan_groups(workers: dict[str, WorkerRecord], shard_size: int, next_replica: int, now_ms: int, *,
                room: bool, regroup_until_ms: int = 0) -> Grouping:
    """The replica groups before a plan (the rules of the module docstring). ``room``: more
    workers may still join (fewer than ``max_workers`` planned); ``regroup_until_ms``: the
    regroup under way, if any."""
    s = shard_size
    workers = dict(workers)
    notes: list[str] = []
    evicted: list[str] = []
    groups = _groups(workers)
    for gid in sorted(groups, key=id_order):  # rule 1
        members = groups[gid]
        gone = [r.worker_id for r in members if r.state not in PLANNED]
        if not gone:
            continue
        for rec in members:
            if rec.state in PLANNED:
                why = f"{rec.worker_id} evicted with its replica group {gid} ({', '.join(sorted(gone, key=id_order))} gone)"
                workers[rec.worker_id] = rec.failed(FailureCause.REPLICA_GROUP, -1, why, now_ms)
                evicted.append(rec.worker_id)
                notes.append(why)
    free = sorted((r for r in workers.values() if r.state in PLANNED and not r.replica_group),
                  key=lambda r: (node_of(r), id_order(r.worker_id)))
    by_node: dict[str, list[WorkerRecord]] = {}
    for rec in free:
        by_node.setdefault(node_of(rec), []).append(rec)
    chunks: list[list[WorkerRecord]] = []
    rest: list[WorkerRecord] = []
    for node in sorted(by_node):  # rule 2
        recs = by_node[node]
        whole = len(recs) - len(recs) % s
        chunks += [recs[i:i + s] for i in range(0, whole, s)]
        rest += recs[whole:]
    regrouped, until = _regroup(workers, rest, s, now_ms)  # rule 4
    for wid in regrouped:
        notes.append(f"{wid} regrouped: its replica group {workers[wid].replica_group} spans nodes, and its node has "
                     "node-mates waiting")
        workers[wid] = workers[wid].failed(FailureCause.REGROUPED, -1, f"{wid} regrouped by node", now_ms)
    until = until or (regroup_until_ms if regroup_until_ms > now_ms else 0)
    regroup_at = 0
    if rest:  # rule 3
        settle_end = max(r.joined_ms for r in rest) + NODE_SETTLE_MS
        if until:
            regroup_at = until
        elif room and now_ms < settle_end:
            regroup_at = settle_end
        else:
            rest.sort(key=lambda r: id_order(r.worker_id))
            whole = len(rest) - len(rest) % s
            chunks += [rest[i:i + s] for i in range(0, whole, s)]
    for chunk in chunks:
        gid = f"r{next_replica}"
        next_replica += 1
        for shard, rec in enumerate(sorted(chunk, key=lambda r: id_order(r.worker_id))):
            workers[rec.worker_id] = replace(rec, replica_group=gid, shard=shard)
        where = sorted({node_of(r) for r in chunk})
        notes.append(f"replica group {gid}: {', '.join(sorted((r.worker_id for r in chunk), key=id_order))}"
                     + (f" (across nodes {', '.join(where)})" if len(where) > 1 else ""))
    return Grouping(workers, next_replica, tuple(evicted), tuple(regrouped), regroup_at, until, tuple(notes))


def _groups(workers: dict[str, WorkerRecord]) -> dict[str, list[WorkerRecord]]:
    groups: dict[str, list[WorkerRecord]] = {}
    for rec in workers.values():
        if rec.replica_group:
            groups.setdefault(rec.replica_group, []).append(rec)
    return groups


def _regroup(workers: dict[str, WorkerRecord], waiting: list[WorkerRecord], s: int,
             now_ms: int) -> tuple[list[str], int]:
    """Rule 4: the members of the cross-node groups to dissolve (oldest group first), and until
    when their return is awaited (0: none dissolved)."""
    if not waiting:
        return [], 0
    spare: dict[str, int] = {}
    for rec in waiting:
        spare[node_of(rec)] = spare.get(node_of(rec), 0) + 1
    whole = {gid: members for gid, members in _groups(workers).items()
             if all(r.state in PLANNED for r in members) and len(members) == s}
    keepers = {gid for gid, members in whole.items() if len({node_of(r) for r in members}) == 1
               and any(r.state == WorkerState.ACTIVE for r in members)}
    out: list[str] = []
    for gid in sorted(whole, key=id_order):
        members = whole[gid]
        nodes: dict[str, int] = {}
        for rec in members:
            nodes[node_of(rec)] = nodes.get(node_of(rec), 0) + 1
        if len(nodes) < 2 or not keepers:
            continue
        if all(spare.get(node, 0) + n >= s for node, n in nodes.items()):
            out += sorted((r.worker_id for r in members), key=id_order)
            for node, n in nodes.items():  # these waiting workers are spoken for
                spare[node] = spare.get(node, 0) + n - s
    return out, (now_ms + REGROUP_WAIT_MS if out else 0)
