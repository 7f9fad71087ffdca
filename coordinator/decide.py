"""The coordinator's decisions: a pure function of (state, input, now, spec).

``decide`` never touches Redis or the clock. It returns a :class:`Decision`: the new state,
the side effects to perform (actions) and a one-line human-readable reason. The loop in
:mod:`shoal.coordinator.loop` reads state from Redis, calls ``decide`` and writes the result
through the fenced path. Tests drive it by ageing heartbeats (passing a later ``now``)
instead of sleeping.

Planning rules:
- removals (failure, leave) re-plan at once, so survivors move on quickly;
- joins are batched: a join marks the plan dirty, and the next tick plans once the joins
  have been quiet for ``SETTLE_MS`` or ``max_workers`` is reached, so three workers starting
  together make one generation, not three;
- below ``min_workers`` a running job is paused (a paused table with no members is published
  so workers stop training); it resumes with a fresh generation when enough are back;
- a generation that could not form, configuration errors that fail the job after
  ``CONFIG_STRIKES`` generations and ``formation_timeout``: the formation policy,
  :mod:`shoal.coordinator.formation`;
- a failed step gets the same members a new generation ``SETTLE_MS`` later; members that keep
  failing one step are restarted, then the job fails: the progress watchdog,
  :mod:`shoal.coordinator.watchdog`;
- elastic HSDP's replica groups (a group that lost a member goes whole, groups of one node):
  :mod:`shoal.coordinator.replicas`.

Redone steps (committed steps committed again because every replica that held them was lost)
are counted by :mod:`shoal.coordinator.redone` from the ``ready`` steps, sampled heartbeats
and checkpoints this module hands it.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field, replace

from shoal.coordinator import formation, redone, slices, watchdog
from shoal.coordinator.owners import plan_owners
from shoal.coordinator.replicas import plan_groups
from shoal.coordinator.shards import plan_ranges
from shoal.coordinator.states import CoordState
from shoal.events.exits import WorkerExit
from shoal.coordinator.redone import StepSeen
from shoal.events.records import Evaluation, WorkerRecord
from shoal.events.states import (
    LIVE,
    PLANNED,
    TERMINAL_JOB_STATES,
    FailureCause,
    JobState,
    RemovalCause,
    WorkerState,
)
from shoal.events.models import (
    Checkpointed,
    EvalReported,
    EventBase,
    JobCompleted,
    JoinReply,
    JoinRequest,
    LatestPointer,
    LeaveRequest,
    Left,
    Member,
    Ready,
    ShardTable,
    StepFailed,
    StopJob,
    WorkerExited,
    WorkerStartFailed,
)
from shoal.core.jobspec import JobSpec

#: Joins are planned once they have been quiet this long; a failed step's members get their
#: new generation this long after the report (a peer that died is reported meanwhile).
SETTLE_MS = 300
#: A straggler's step is ``straggler_factor`` x the median AND this many seconds longer.
STRAGGLER_FLOOR_S = 0.05


# ---- inputs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EventInput:
    stream_id: str
    event: EventBase


@dataclass(frozen=True)
class Tick:
    """A periodic scan. ``last_seen`` maps worker id -> Redis server ms of its last heartbeat
    for workers that look stale (the loop pre-filters with ZRANGEBYSCORE); ``step_times`` is
    the recent step time of active workers when the loop sampled progress (may be empty)."""

    last_seen: dict[str, int] = field(default_factory=dict)
    step_times: dict[str, float] = field(default_factory=dict)
    #: worker id -> the committed step its sampled heartbeat reports, with the generation it
    #: was committed in (sampled with ``step_times``; may be empty)
    steps: dict[str, StepSeen] = field(default_factory=dict)
    #: worker id -> Redis server ms at which its current step began its own work (the
    #: ``busy`` set), for workers busy longer than the step timeout (pre-filtered like
    #: ``last_seen``)
    busy_since: dict[str, int] = field(default_factory=dict)
    #: worker id -> its heartbeat's work counters (sampled with ``step_times``; may be empty):
    #: the facts slices by speed are sized from (``coordinator.slices``)
    work: dict[str, slices.Work] = field(default_factory=dict)


# ---- actions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplyJoin:
    event_id: str
    reply: JoinReply


@dataclass(frozen=True)
class Change:
    """What a new generation changed, for the control entry's typed fields (readers use
    these, never the reason): its world size (0 when paused), the workers that are members for
    the first time, the members of earlier generations it leaves out and why (one cause each)."""

    world_size: int
    paused: bool = False
    joined: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    causes: tuple[RemovalCause, ...] = ()
    #: the checkpoint step the generation starts from when no member holds the job's state
    #: (:func:`restore_point`); None otherwise
    restored_from: int | None = None

    def fields(self) -> dict:
        """The :class:`~shoal.events.streams.ControlEntry` fields it fills."""
        return {"world_size": self.world_size, "paused": self.paused, "joined": self.joined,
                "removed": self.removed, "causes": tuple(c.value for c in self.causes),
                "restored_from": self.restored_from}


@dataclass(frozen=True)
class Publish:
    table: ShardTable
    change: Change | None = None


@dataclass(frozen=True)
class Watch:
    """Start watching ``worker_id``'s liveness from ``now_ms`` (ZADD last_seen)."""

    worker_id: str
    now_ms: int


@dataclass(frozen=True)
class Forget:
    """Stop watching ``worker_id`` (ZREM last_seen, DEL heartbeat key)."""

    worker_id: str


@dataclass(frozen=True)
class SetLatest:
    """Point the job's Redis LATEST at a complete checkpoint (only ever forwards: the write
    is refused in Redis when the pointer already names a higher ``step``)."""

    pointer_json: str
    step: int = 0


@dataclass(frozen=True)
class RecordFailure:
    """Append one worker failure to the job's ``failures`` stream (the history behind
    ``first_failure``): who, its rank in the generation it died in (-1: none), how it ended."""

    worker_id: str
    rank: int
    reason: str
    exit_code: int | None = None
    signal: int | None = None
    traceback: str = ""


Action = ReplyJoin | Publish | Watch | Forget | SetLatest | RecordFailure


@dataclass(frozen=True)
class Decision:
    state: CoordState
    actions: tuple[Action, ...] = ()
    reason: str = ""
    #: False when the input changed nothing (the loop then only records ``applied``).
    changed: bool = True


def _unchanged(state: CoordState, reason: str) -> Decision:
    return Decision(state=state, reason=reason, changed=False)


# ---- helpers --------------------------------------------------------------------------------


def _id_order(worker_id: str) -> tuple[int, str]:
    digits = "".join(ch for ch in worker_id if ch.isdigit())
    return (int(digits) if digits else 0, worker_id)


def planned_ids(state: CoordState) -> list[str]:
    return sorted((w.worker_id for w in state.in_state(PLANNED)), key=_id_order)


def member_ids(state: CoordState, spec: JobSpec) -> list[str]:
    """The planned workers that the next generation would have, in rank order. Data
    parallelism: every planned worker, by id. Elastic HSDP: the members of the complete
    replica groups (every member planned), oldest group first, each group shard by shard
    (rank = replica x shard_size + shard); a partial group waits."""
    if spec.shard_size == 1:
        return planned_ids(state)
    groups: dict[str, list[WorkerRecord]] = {}
    for rec in state.workers.values():
        if rec.replica_group and rec.state in PLANNED:
            groups.setdefault(rec.replica_group, []).append(rec)
    ids: list[str] = []
    for gid in sorted(groups, key=_id_order):
        members = groups[gid]
        if len(members) == spec.shard_size:
            ids += [r.worker_id for r in sorted(members, key=lambda r: r.shard)]
    return ids


def _replica_groups(state: CoordState, spec: JobSpec, now_ms: int) -> tuple[CoordState, list[Action], str]:
    """Elastic HSDP's groups before a plan (``coordinator.replicas``: a group that lost a
    member goes whole, groups of one node first, leftovers wait a moment for node-mates, a
    cross-node group is regrouped by node when it can be). Returns the state, the Forget
    actions of the evicted and regrouped and a note for the reason ("" : nothing changed)."""
    status = state.status
    room = len(state.in_state(PLANNED)) < spec.max_workers
    g = plan_groups(state.workers, spec.shard_size, status.next_replica, now_ms, room=room,
                    regroup_until_ms=status.regroup_until_ms)
    status = replace(status, next_replica=g.next_replica, regroup_at_ms=g.regroup_at_ms,
                     regroup_until_ms=g.regroup_until_ms)
    if not g.changed:
        return replace(state, status=status), [], ""
    actions: list[Action] = [Forget(w) for w in g.evicted + g.regrouped]
    return replace(state, status=status, workers=g.workers), actions, "; ".join(g.notes)


def restore_point(state: CoordState, ids: list[str]) -> int | None:
    """The checkpoint step a generation of ``ids`` starts from, or None when its members carry
    the job's state on.

    The job's state lives in its Active workers (each reported ``ready`` for a generation and
    trains on from there); a worker that joined and never became Active holds only what it
    loaded when its process started (a checkpoint as it was then, or the seed's model). A
    generation with no Active member, once the job has committed steps and written a
    checkpoint, has lost every replica of that state - typically a joiner whose catch-up
    source was killed mid-transfer, with no other member left: it starts from the job's
    LATEST checkpoint (``JobStatus.latest_step``), and the steps committed after it are redone
    (:mod:`shoal.coordinator.redone` counts them from the members' ``ready``). None without a
    checkpoint (the members' own state: from scratch) or before any step was committed (a new
    job, or one started again after a Redis wipe: its workers load the store's LATEST when
    they start)."""
    status = state.status
    if not ids or status.latest_step <= 0 or status.high_step <= 0:
        return None
    if any(state.workers[w].state == WorkerState.ACTIVE for w in ids):
        return None
    return status.latest_step


def _plan_digest(ids: list[str], paused: bool) -> str:
    return hashlib.sha256(("P" if paused else "R") .encode() + ",".join(ids).encode()).hexdigest()[:16]


def replan(state: CoordState, spec: JobSpec, now_ms: int, epoch: int, why: str,
           force: bool = False, reslice: bool = False) -> tuple[CoordState, list[Action], str]:
    """Publish a new generation if the planned membership changed (or ``force``: the current
    generation could not form, so the same members need a fresh one); pause/resume the job.
    ``reslice`` (slices by speed, with ``force``): the same members with new slices, in the
    running generation's group (``ShardTable.continues``) - only when the membership is
    indeed the published one."""
    if state.status.state in TERMINAL_JOB_STATES:
        return state, [], why
    grouped: list[Action] = []
    if spec.shard_size > 1:
        state, grouped, note = _replica_groups(state, spec, now_ms)
        why = f"{why}; {note}" if note else why
    status = state.status
    ids = member_ids(state, spec)
    enough = len(ids) >= spec.min_workers
    if not enough and status.state == JobState.PENDING:
        waiting = f"{why}; waiting for min_workers={spec.min_workers} (have {len(ids)})"
        return replace(state, status=replace(status, pending_join_ms=0)), grouped, waiting
    paused = not enough
    digest = _plan_digest([] if paused else ids, paused)
    if digest == status.plan_digest and not force:
        return replace(state, status=replace(status, pending_join_ms=0)), grouped, why
    continues = status.generation if reslice and digest == status.plan_digest and not paused else 0
    generation = status.generation + 1
    restore = None if paused else restore_point(state, ids)
    state, change = _membership_change(state, [] if paused else ids, generation, paused)
    change = replace(change, restored_from=restore)
    members = []
    sliced = ""
    if not paused:
        s = spec.shard_size
        if by_speed(spec, status):
            split, sizes, said = slices.plan(status.split, ids, spec.shard_space, generation, status.high_step)
            status = replace(status, split=split)
            sliced = f"; {said}"
            planned = slices.ranges(sizes)
        else:
            planned = plan_ranges(spec.shard_strategy.value, spec.shard_space, ids)
        for rank, (wid, ranges) in enumerate(zip(ids, planned)):
            hsdp = {"group": state.workers[wid].replica_group, "replica": rank // s, "shard": rank % s} if s > 1 else {}
            members.append(Member(worker_id=wid, rank=rank, ranges=ranges, **hsdp))
    # the members dropped by a failure decided now: peers still in a group with them abort
    evicted = sorted((w for w, r in state.workers.items() if r.state == WorkerState.FAILED and r.changed_ms == now_ms
                      and r.cause != FailureCause.REGROUPED), key=_id_order)  # a regroup is an orderly switch
    if paused:
        reason = f"{why}; paused: {len(ids)} < min_workers={spec.min_workers}"
    else:
        kept = f", in generation {continues}'s group" if continues else ""
        reason = f"{why}; generation {generation}: world size {len(ids)} ({', '.join(ids)}){kept}{sliced}"
    if restore is not None:
        reason += (f"; no member holds the job's state (every member that held it was lost): generation "
                   f"{generation} starts from the checkpoint of step {restore}, the members behind it load it")
    owners = None
    if status.num_shards and not paused:
        owners, owned_why = plan_owners(status.shard_owners, ids, status.num_shards)
        reason = f"{reason}; {owned_why}"
        status = replace(status, shard_owners=owners)
    table = ShardTable(
        job_id=spec.name,
        generation=generation,
        world_size=len(members),
        strategy=spec.shard_strategy.value,
        num_samples=spec.shard_space,
        members=members,
        paused=paused,
        reason=reason,
        epoch=epoch,
        planned_at_ms=now_ms,
        evicted=evicted,
        shard_owners=owners,
        shard_size=spec.shard_size,
        restore_step=restore,
        continues=continues,
    )
    # the formation clock runs from the first generation planned since one last formed
    new_status = replace(status, generation=generation, plan_digest=digest, pending_join_ms=0, reason=reason,
                         formation=formation.planned(status, now_ms, paused), step_failed_ms=0, step_failure="")
    new_status = new_status.moved(JobState.PAUSED if paused else JobState.RUNNING, now_ms)
    return replace(state, status=new_status), [*grouped, Publish(table, change)], reason


def by_speed(spec: JobSpec, status) -> bool:
    """Whether the job's slices are sized by speed: ``batch_split: by_speed`` and a map-style
    dataset (a streaming dataset's split by shard owner replaces the table's ranges)."""
    return spec.batch_split == "by_speed" and spec.shard_size == 1 and not status.num_shards


def _removal_cause(rec: WorkerRecord) -> RemovalCause:
    if rec.state != WorkerState.FAILED:
        return RemovalCause.LEFT  # drained or left
    return RemovalCause.parse(rec.cause.value)


def _membership_change(state: CoordState, members: list[str], generation: int,
                       paused: bool) -> tuple[CoordState, Change]:
    """Who ``generation`` (its ``members``) adds and drops, recorded in the workers' records
    (``planned_in``, ``dropped_in``) so each change is counted once; O(W) like the plan."""
    workers = state.workers
    changed: dict[str, WorkerRecord] = {}
    joined = []
    for wid in members:
        rec = workers[wid]
        if not rec.planned_in:
            joined.append(wid)
            changed[wid] = replace(rec, planned_in=generation)
    gone = sorted((w for w, r in workers.items() if r.planned_in and not r.dropped_in and r.state not in PLANNED),
                  key=_id_order)
    for wid in gone:
        changed[wid] = replace(workers[wid], dropped_in=generation)
    change = Change(world_size=len(members), paused=paused, joined=tuple(joined), removed=tuple(gone),
                    causes=tuple(_removal_cause(workers[w]) for w in gone))
    if changed:
        state = replace(state, workers={**workers, **changed})
    return state, change


def _move(state: CoordState, wid: str, dst: WorkerState, reason: str, now_ms: int) -> CoordState:
    rec = state.workers[wid].moved(dst, reason, now_ms)
    return replace(state, workers={**state.workers, wid: rec})


def published_ranks(state: CoordState, spec: JobSpec) -> dict[str, int]:
    """Worker id -> rank in the published generation, for the workers that have one. Empty
    when the planned membership already differs from the published one (a join not yet
    planned, a failure not yet re-planned) or the job is paused: the ranks are then unknown.
    Take them before failing anyone: a failure changes the planned membership."""
    ids = member_ids(state, spec)
    if ids and _plan_digest(ids, False) == state.status.plan_digest:
        return {wid: rank for rank, wid in enumerate(ids)}
    return {}


def _failed(wid: str, rank: int) -> str:
    """How every failure reason starts, for people: ``w1 failed (rank 1):`` or ``w1 failed:``
    (readers take who failed from the control entry's typed fields, never from this)."""
    return f"{wid} failed (rank {rank}):" if rank >= 0 else f"{wid} failed:"


def _fail(state: CoordState, wid: str, cause: FailureCause, rank: int, reason: str, now_ms: int,
          exited: WorkerExited | None = None) -> tuple[CoordState, list[Action]]:
    """Mark ``wid`` failed for ``cause`` holding ``rank``. The first failure of the job (its
    root cause) is kept with the full traceback the agent reported; every failure goes to
    the ``failures`` stream."""
    rec = state.workers[wid].failed(cause, rank, reason, now_ms)
    state = replace(state, workers={**state.workers, wid: rec})
    if not state.status.first_failure:
        tb = exited.traceback if exited else ""
        status = replace(state.status, first_failure=reason, first_failure_worker=wid, first_failure_traceback=tb)
        state = replace(state, status=status)
    return state, [Forget(wid), _record(wid, rank, reason, exited)]


def _record(wid: str, rank: int, reason: str, exited: WorkerExited | None) -> RecordFailure:
    if exited is None:
        return RecordFailure(wid, rank, reason)
    return RecordFailure(wid, rank, reason, exited.exit_code, exited.signal, exited.traceback)


# ---- the decision function --------------------------------------------------------------------


def decide(state: CoordState, inp: EventInput | Tick, now_ms: int, spec: JobSpec, epoch: int = 0) -> Decision:
    """New state, actions and reason for one input. Never raises on well-formed input; an
    event that names an unknown worker or a stale generation is a no-op with a reason.
    Dispatches by the input's type: :data:`_HANDLERS` for a job's events, :data:`_WORKER_HANDLERS`
    for events of a worker on record (an unknown worker's are ignored), :func:`_on_tick`."""
    if isinstance(inp, Tick):
        return _on_tick(state, inp, now_ms, spec, epoch)
    ev = inp.event
    handler = _HANDLERS.get(type(ev))
    if handler is not None:
        return handler(state, ev, now_ms, spec, epoch)
    on_worker = _WORKER_HANDLERS.get(type(ev))
    if on_worker is None:  # pragma: no cover - a new event kind without a handler
        return _unchanged(state, f"event kind {ev.kind!r} has no handler")
    rec = state.workers.get(ev.worker_id or "")
    if rec is None:
        return _unchanged(state, f"{ev.kind} from unknown worker {ev.worker_id or ''!r} ignored")
    return on_worker(state, ev, rec, now_ms, spec, epoch)


# ---- the job's events ------------------------------------------------------------------------


def _on_stop(state: CoordState, ev: StopJob, now_ms: int, spec: JobSpec, epoch: int) -> Decision:
    if state.status.state in TERMINAL_JOB_STATES:
        return _unchanged(state, f"stop ignored: job already {state.status.state.value}")
    status = replace(state.status.moved(JobState.STOPPED, now_ms), reason=ev.reason)
    return Decision(replace(state, status=status), (), ev.reason)


def _on_completed(state: CoordState, ev: JobCompleted, now_ms: int, spec: JobSpec, epoch: int) -> Decision:
    if state.status.state in TERMINAL_JOB_STATES:
        return _unchanged(state, f"completion ignored: job already {state.status.state.value}")
    reason = f"completed at step {ev.step} (reported by {ev.worker_id or ''})"
    summary = dict(ev.summary)
    if state.status.steps_redone:
        redone = state.status.steps_redone
        reason += (f"; {redone} committed step{'s were' if redone != 1 else ' was'} redone "
                   f"(every replica that held {'them' if redone != 1 else 'it'} was lost)")
        summary["steps_redone"] = redone
    status = replace(state.status.moved(JobState.COMPLETED, now_ms), reason=reason, summary=summary)
    return Decision(replace(state, status=status), (), reason)


def _on_checkpointed(state: CoordState, ev: Checkpointed, now_ms: int, spec: JobSpec, epoch: int) -> Decision:
    # a checkpoint is of a committed step
    state = replace(state, status=redone.saw_step(state.status, StepSeen(ev.generation, ev.step), now_ms))
    if ev.step <= state.status.latest_step:
        return _unchanged(state, f"checkpoint of step {ev.step} ignored: LATEST is at step {state.status.latest_step}")
    pointer = LatestPointer(step=ev.step, store=ev.store, generation=ev.generation).to_json()
    reason = f"LATEST -> checkpoint of step {ev.step} in {ev.store}"
    state = replace(state, status=replace(state.status, latest_step=ev.step))
    return Decision(state, (SetLatest(pointer, ev.step),), reason)


# ---- a worker's events (the worker is on record) ------------------------------------------------


def _on_ready(state: CoordState, ev: Ready, rec: WorkerRecord, now_ms: int, spec: JobSpec, epoch: int) -> Decision:
    wid = rec.worker_id
    if rec.state == WorkerState.ACTIVE and ev.generation == state.status.generation:
        # a member that stays active through a switch (a generation that only removed others)
        # says so too: the generation formed, its formation clock stops (else the job would
        # fail formation_timeout after a removal-only switch with nobody joining)
        status = formation.formed(state.status)
        status, again = redone.resumed(status, ev.generation, ev.step, now_ms)
        if status == state.status:
            return _unchanged(state, f"ready from {wid} in generation {ev.generation}: already active")
        reason = f"{wid} active in generation {ev.generation}"
        return Decision(replace(state, status=status), (), f"{reason}; {again}" if again else reason)
    if rec.state != WorkerState.SYNCING:
        return _unchanged(state, f"ready from {wid} ignored: it is {rec.state.value}")
    if ev.generation != state.status.generation:
        return _unchanged(state, f"ready from {wid} for generation {ev.generation} ignored: current is {state.status.generation}")
    reason = f"{wid} active in generation {ev.generation}"
    state = _move(state, wid, WorkerState.ACTIVE, reason, now_ms)
    state = replace(state, status=formation.formed(state.status))  # the generation formed
    status, again = redone.resumed(state.status, ev.generation, ev.step, now_ms)
    state = replace(state, status=status)
    return Decision(state, (), f"{reason}; {again}" if again else reason)


def _on_leave(state: CoordState, ev: LeaveRequest, rec: WorkerRecord, now_ms: int, spec: JobSpec,
              epoch: int) -> Decision:
    wid = rec.worker_id
    if rec.state not in PLANNED:
        return _unchanged(state, f"leave from {wid} ignored: it is {rec.state.value}")
    why = f"{wid} draining ({ev.reason})"
    state = _move(state, wid, WorkerState.DRAINING, why, now_ms)
    state, actions, reason = replan(state, spec, now_ms, epoch, why)
    return Decision(state, tuple(actions), reason)


def _on_left(state: CoordState, ev: Left, rec: WorkerRecord, now_ms: int, spec: JobSpec, epoch: int) -> Decision:
    wid = rec.worker_id
    if rec.state not in LIVE:
        return _unchanged(state, f"left from {wid} ignored: it is {rec.state.value}")
    why = f"{wid} left"
    if rec.state == WorkerState.ACTIVE:
        state = _move(state, wid, WorkerState.DRAINING, "leaving", now_ms)
    state = _move(state, wid, WorkerState.LEFT, why, now_ms)
    state, actions, reason = replan(state, spec, now_ms, epoch, why)
    return Decision(state, (Forget(wid), *actions), reason)


def _on_exited(state: CoordState, ev: WorkerExited, rec: WorkerRecord, now_ms: int, spec: JobSpec,
               epoch: int) -> Decision:
    wid = rec.worker_id
    if ev.pid and rec.pid and ev.pid != rec.pid:
        return _unchanged(state, f"exit of pid {ev.pid} ignored: {wid} is pid {rec.pid}")
    how = f"signal {ev.signal}" if ev.signal else f"exit code {ev.exit_code}"
    tail = ev.traceback.strip().splitlines()[-1] if ev.traceback.strip() else ""
    ended = f"process ended with {how}" + (f" ({tail})" if tail else "")
    if rec.state == WorkerState.FAILED and rec.cause == FailureCause.HEARTBEAT_TIMEOUT:
        # the heartbeat timeout won the race; the agent's report says why the process
        # died, and is the root cause if the timeout was (the rank is the one the timeout
        # recorded: the worker is planned no more)
        why = f"{_failed(wid, rec.rank)} {ended}"
        status = state.status
        if ev.exit_code == WorkerExit.STOPPED_IN_OUTAGE:
            # it was asked to stop while Redis was gone (its beats stopped with it): no root
            # cause of anything, and not the job's first failure
            why = f"{wid} was asked to stop during a Redis outage and ended without leaving ({how})"
            if status.first_failure_worker == wid:
                status = replace(status, first_failure="", first_failure_traceback="", first_failure_worker="")
        elif status.first_failure_worker == wid:
            status = replace(status, first_failure=why, first_failure_traceback=ev.traceback)
        workers = {**state.workers, wid: replace(rec, reason=why, cause=FailureCause.EXITED)}
        state = replace(state, status=status, workers=workers)
        actions = [_record(wid, rec.rank, why, ev)]
        if ev.gave_up and len(state.in_state(PLANNED)) < spec.min_workers:
            return _give_up(state, wid, ev, spec, now_ms, actions)
        return Decision(state, tuple(actions), f"root cause of {wid}: {why}")
    rank = published_ranks(state, spec).get(wid, -1)
    why = f"{_failed(wid, rank)} {ended}"
    if rec.state not in LIVE:
        if ev.gave_up and len(state.in_state(PLANNED)) < spec.min_workers:
            return _give_up(state, wid, ev, spec, now_ms, [])
        return _unchanged(state, f"exit of {wid} ignored: it is {rec.state.value}")
    if rec.state == WorkerState.DRAINING and ev.exit_code == WorkerExit.OK:
        state = _move(state, wid, WorkerState.LEFT, f"{wid} exited cleanly while draining", now_ms)
        actions: list[Action] = [Forget(wid)]
    elif ev.exit_code == WorkerExit.STOPPED_IN_OUTAGE:  # asked to stop while it could not leave: a leave, not a failure
        why = f"{wid} was asked to stop during a Redis outage and ended without leaving ({how}): it left"
        if rec.state == WorkerState.ACTIVE:  # the drain it could not announce
            state = _move(state, wid, WorkerState.DRAINING, why, now_ms)
        state = _move(state, wid, WorkerState.LEFT, why, now_ms)
        actions = [Forget(wid)]
    else:
        state, actions = _fail(state, wid, FailureCause.EXITED, rank, why, now_ms, ev)
    if ev.gave_up and len(state.in_state(PLANNED)) < spec.min_workers:
        return _give_up(state, wid, ev, spec, now_ms, actions)
    state, more, reason = replan(state, spec, now_ms, epoch, why)
    return Decision(state, tuple(actions + more), reason)


def _on_step_failed(state: CoordState, ev: StepFailed, rec: WorkerRecord, now_ms: int, spec: JobSpec,
                    epoch: int) -> Decision:
    wid = rec.worker_id
    said = f"{wid} reports step {ev.step} of generation {ev.generation} failed: {ev.error[:200]}"
    if ev.generation != state.status.generation or state.status.state != JobState.RUNNING or rec.state not in PLANNED:
        return _unchanged(state, f"{said}; nothing to do: generation {state.status.generation} is current")
    if ev.rendezvous:
        status, reason = formation.failed(state, ev, now_ms, spec)
        return Decision(replace(state, status=status), (), reason)
    # The step is dropped everywhere; the members need a fresh generation to redo it. Not at
    # once: a peer that died is reported by its agent within moments, and the new generation
    # should not include it. A member that is alive is kept (one whose step is stuck is
    # evicted by the step timeout, not here).
    # the progress watchdog counts who reports failing which step (coordinator/watchdog.py)
    stall = watchdog.step_failed(state.status.stall, ev.step, wid, ev.error, now_ms, local=ev.local)
    state = replace(state, status=replace(state.status, stall=stall))
    if state.status.step_failed_ms:
        return Decision(state, (), f"{said}; a new generation is already due")
    failure = f"step {ev.step} of generation {ev.generation} failed on {wid} ({' '.join(ev.error.split())[:200]})"
    status = replace(state.status, step_failed_ms=now_ms, step_failure=failure)
    return Decision(replace(state, status=status), (),
                    f"{failure}; the same members get a new generation in {SETTLE_MS} ms unless one leaves first")


#: Longest list of metrics an evaluation's reason (the decision log, ``shoal events``) shows.
EVAL_REASON_CHARS = 300


def format_metrics(metrics: dict[str, float], limit: int = EVAL_REASON_CHARS) -> str:
    """``accuracy=0.8531 loss=0.4127`` (4 significant digits), cut at ``limit`` characters."""
    text = " ".join(f"{k}={v:.4g}" if isinstance(v, (int, float)) else f"{k}={v!r}"
                    for k, v in metrics.items()) or "no metrics"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _on_eval(state: CoordState, ev: EvalReported, rec: WorkerRecord, now_ms: int, spec: JobSpec,
             epoch: int) -> Decision:
    """Keep the newest evaluation in the job's record. One from a worker no longer live, after
    the job ended, or from a generation older than the recorded one's (a late report) changes
    nothing. A lower step from a newer generation is kept: the job resumed below it (from a
    checkpoint), so that step is the newest evaluation of the model training goes on from."""
    said = f"{rec.worker_id} evaluated step {ev.step}"
    if state.status.state in TERMINAL_JOB_STATES:
        return _unchanged(state, f"{said}: ignored, job already {state.status.state.value}")
    if rec.state not in LIVE:
        return _unchanged(state, f"{said}: ignored, it is {rec.state.value}")
    last = state.status.eval
    if last is not None and ev.generation < last.generation:
        return _unchanged(state, f"{said} in generation {ev.generation}: ignored, the job's evaluation of step "
                                 f"{last.step} is from generation {last.generation}")
    newest = Evaluation(step=ev.step, epoch=ev.epoch, generation=ev.generation, metrics=dict(ev.metrics),
                        worker_id=rec.worker_id)
    done = f"{ev.epoch} epoch{'' if ev.epoch == 1 else 's'} done"
    reason = f"{said} ({done}, generation {ev.generation}{', final' if ev.final else ''}): {format_metrics(ev.metrics)}"
    return Decision(replace(state, status=replace(state.status, eval=newest)), (), reason)


def _on_start_failed(state: CoordState, ev: WorkerStartFailed, now_ms: int, spec: JobSpec,
                     epoch: int = 0) -> Decision:
    """A worker process ended before it joined: a failure of the job like any other (kept as
    the first failure, with its traceback, when it is the first), and the end of the job when
    its agent gave up and too few workers remain - instead of a job ``pending`` forever."""
    if state.status.state in TERMINAL_JOB_STATES:
        return _unchanged(state, f"start failure of {ev.who()} ignored: job already {state.status.state.value}")
    how = f"signal {ev.signal}" if ev.signal else f"exit code {ev.exit_code}"
    tail = ev.traceback.strip().splitlines()[-1] if ev.traceback.strip() else ""
    if ev.exit_code is None and ev.signal is None:  # the agent could not start it at all
        why = f"{ev.who()} could not be started" + (f": {tail}" if tail else "")
    else:
        why = f"{ev.who()} failed before joining: process ended with {how}" + (f" ({tail})" if tail else "")
    if ev.will_restart:
        why += f"; restarting it (restart {ev.restarts + 1})"
    status = state.status
    if not status.first_failure:
        status = replace(status, first_failure=why, first_failure_worker="", first_failure_traceback=ev.traceback)
    state = replace(state, status=status)
    slot = f"{ev.node or '?'}/slot{ev.slot}"
    actions = [RecordFailure(slot, -1, why, ev.exit_code, ev.signal, ev.traceback)]
    if ev.gave_up and len(state.in_state(PLANNED)) < spec.min_workers:
        return _give_up(state, slot, ev, spec, now_ms, actions)
    return Decision(state, tuple(actions), why)


def _give_up(state: CoordState, wid: str, ev: WorkerExited | WorkerStartFailed, spec: JobSpec, now_ms: int,
             actions: list) -> Decision:
    if state.status.state in TERMINAL_JOB_STATES:
        return Decision(state, tuple(actions), f"{wid}'s slot gave up; job already {state.status.state.value}")
    reason = (f"job failed: {wid}'s slot gave up after {ev.restarts} restarts and fewer than "
              f"min_workers={spec.min_workers} remain; first failure: {state.status.first_failure}")
    status = replace(state.status.moved(JobState.FAILED, now_ms), reason=reason)
    return Decision(replace(state, status=status), tuple(actions), reason)


def _on_join(state: CoordState, ev: JoinRequest, now_ms: int, spec: JobSpec, epoch: int) -> Decision:
    status = state.status
    planned = state.in_state(PLANNED)
    refusal = ""
    if status.state in TERMINAL_JOB_STATES:
        refusal = f"job is {status.state.value}"
    elif len(planned) >= spec.max_workers:
        refusal = f"job already has {len(planned)} workers (max_workers={spec.max_workers})"
    elif ev.backend:
        other = sorted((w for w in planned if w.backend and w.backend != ev.backend), key=lambda w: _id_order(w.worker_id))
        if other:
            names = ", ".join(w.worker_id for w in other[:5]) + (" ..." if len(other) > 5 else "")
            refusal = (f"its backend {ev.backend} differs from the job's members' {other[0].backend} ({names}): the "
                       f"members of a generation must agree; set backend: {other[0].backend} (or the same GPUs per "
                       "worker) on every node")
    if refusal:  # counted in the job's record: a late or surplus worker is visible in status
        reason = f"join rejected: {refusal}"
        who = f"{ev.host or '?'} pid {ev.pid}" + (f" on node {ev.node}" if ev.node else "")
        status = replace(status, rejected_joins=status.rejected_joins + 1, last_rejection=f"{who}: {refusal}")
        return Decision(replace(state, status=status),
                        (ReplyJoin(ev.event_id, JoinReply(accepted=False, reason=reason)),), reason)
    if ev.last_generation > status.generation:
        # Redis lost the job and a surviving process rejoins: number on above what it saw
        status = replace(status, generation=ev.last_generation)
    wid = f"w{status.next_worker}"
    rec = WorkerRecord(
        worker_id=wid, state=WorkerState.SYNCING, joined_ms=now_ms, host=ev.host, pid=ev.pid, node=ev.node,
        reason="joined", changed_ms=now_ms, backend=ev.backend or "", device=ev.device or "", gpu=ev.gpu or "",
        placement=ev.placement,
    )
    status = replace(status, next_worker=status.next_worker + 1, pending_join_ms=now_ms)
    if ev.num_shards and not status.num_shards:  # a streaming dataset: owners from the next plan on
        status = replace(status, num_shards=ev.num_shards)
    state = replace(state, status=status, workers={**state.workers, wid: rec})
    why = f"{wid} joined from {ev.host or '?'} pid {ev.pid}"
    actions: list[Action] = [Watch(wid, now_ms), ReplyJoin(ev.event_id, JoinReply(accepted=True, worker_id=wid))]
    if len(planned) + 1 >= spec.max_workers:
        state, more, why = replan(state, spec, now_ms, epoch, why)
        actions += more
    return Decision(state, tuple(actions), why)


def _on_tick(state: CoordState, tick: Tick, now_ms: int, spec: JobSpec, epoch: int) -> Decision:
    if formation.expired(state.status, spec, now_ms):
        status, reason = formation.timed_out(state.status, spec, now_ms)
        return Decision(replace(state, status=status), (), reason)
    ttl_ms = int(spec.heartbeat_ttl * 1000)
    reasons: list[str] = []
    actions: list[Action] = []
    changed = False
    removals = False
    before = state  # the ranks are the published ones, before this tick's first failure
    ranks: dict[str, int] = {}

    def rank_of(wid: str) -> int:
        # only when a worker fails: sorting every member costs milliseconds at 16,384, and a
        # coordinator ticks every 100 ms, also between the entries of a switch's Readys
        if not ranks:
            ranks.update(published_ranks(before, spec))
        return ranks.get(wid, -1)

    for wid, seen in sorted(tick.last_seen.items()):
        rec = state.workers.get(wid)
        if rec is None or rec.state not in LIVE or now_ms - seen <= ttl_ms:
            continue
        rank = rank_of(wid)
        why = f"{_failed(wid, rank)} no heartbeat for {now_ms - seen} ms (ttl {ttl_ms} ms)"
        state, more = _fail(state, wid, FailureCause.HEARTBEAT_TIMEOUT, rank, why, now_ms)
        actions += more
        reasons.append(why)
        changed = removals = True
    step_ms = int(spec.step_timeout * 1000)
    for wid, since in sorted(tick.busy_since.items()):
        rec = state.workers.get(wid)
        if rec is None or rec.state not in LIVE or now_ms - since <= step_ms:
            continue
        rank = rank_of(wid)
        why = (f"{_failed(wid, rank)} step timeout: its step has been busy for {(now_ms - since) / 1000:.1f} s "
               f"(step_timeout {spec.step_timeout:g} s) while its heartbeat is alive")
        state, more = _fail(state, wid, FailureCause.STEP_TIMEOUT, rank, why, now_ms)
        actions += more
        reasons.append(why)
        changed = removals = True
    status = state.status
    for seen in tick.steps.values():  # no decision of its own: kept in the status
        status = redone.saw_step(status, seen, now_ms)
    if tick.step_times:
        status = replace(status, step_ms=int(1000 * statistics.median(tick.step_times.values())))
    if tick.work and by_speed(spec, status):  # a new rate changes only the status, like a step
        live = {w: v for w, v in tick.work.items() if w in state.workers and state.workers[w].state in LIVE}
        status = replace(status, split=slices.observe(status.split, live, spec.shard_space))
    state = replace(state, status=status)
    if tick.step_times:
        state, flagged = _flag_stragglers(state, tick.step_times, spec.straggler_factor, now_ms)
        if flagged:
            reasons.append(flagged)
            changed = True
    pending = state.status.pending_join_ms
    failed_at = state.status.step_failed_ms
    step_failed = bool(failed_at) and now_ms - failed_at >= SETTLE_MS
    reform = formation.retry_due(state.status, now_ms)
    regroup_at = state.status.regroup_at_ms
    regroup = bool(regroup_at) and now_ms >= regroup_at  # workers waited for node-mates long enough
    if step_failed and not removals and not reform:
        state, more, said, failed = _watch_progress(state, spec, now_ms, rank_of)
        actions += more
        if failed:
            return Decision(state, tuple(actions), said, changed=True)
        if said:  # members restarted: the plan below leaves them out
            reasons.append(said)
            removals = True
    if (not removals and not pending and not failed_at and not reform and not regroup and by_speed(spec, state.status)
            and tick.work):
        state, look = _look_at_slices(state, spec)
        if look is not None and look.replan:
            state, more, reason = replan(state, spec, now_ms, epoch, look.reason, force=True, reslice=True)
            return Decision(state, tuple(actions + more), reason, changed=True)
    if removals or (pending and now_ms - pending >= SETTLE_MS) or step_failed or reform or regroup:
        if reasons:
            why = "; ".join(reasons)
        elif step_failed:
            why = f"{state.status.step_failure}; same members"
        elif reform:
            why = formation.retry_reason(state.status)
        elif regroup and not pending:
            why = "waited for node-mates"
        else:
            why = "joins settled"
        # a failed step or formation needs a fresh generation even when the members are the same
        state, more, reason = replan(state, spec, now_ms, epoch, why, force=step_failed or reform)
        actions += more
        return Decision(state, tuple(actions), reason, changed=True)
    return Decision(state, tuple(actions), "; ".join(reasons) or "tick", changed=changed)


def _look_at_slices(state: CoordState, spec: JobSpec) -> tuple[CoordState, slices.Look | None]:
    """Slices by speed between membership changes (``coordinator.slices.look``): only for a
    running generation that formed with every member active, whose newest committed step was
    reported by that generation. Returns the state (the split record as the look left it) and
    the look (None: not looked at)."""
    status = state.status
    if (status.state != JobState.RUNNING or status.formation.unformed_since_ms
            or status.high_step_generation != status.generation):
        return state, None
    ids = member_ids(state, spec)
    if not ids or _plan_digest(ids, False) != status.plan_digest:
        return state, None
    if any(state.workers[w].state != WorkerState.ACTIVE for w in ids):
        return state, None
    look = slices.look(status.split, ids, spec.shard_space, status.generation, status.high_step,
                       spec.batch_split_every)
    return replace(state, status=replace(status, split=look.split)), look


def _watch_progress(state: CoordState, spec: JobSpec, now_ms: int,
                    rank_of) -> tuple[CoordState, list[Action], str, bool]:
    """A failed step is about to get the same members a new generation: count it for the
    progress watchdog (``coordinator.watchdog``) and act on its verdict - restart the members
    that keep failing the step (failed with cause ``stuck``; their agents start them again),
    or fail the job. Returns the state, the actions, the reason ("" : the same-members
    generation goes ahead) and whether the job failed."""
    status = state.status
    if _plan_digest(member_ids(state, spec), False) != status.plan_digest:
        return state, [], "", False  # the membership changes with this plan anyway: not the same members
    status = replace(status, stall=watchdog.same_members_again(status.stall, status.generation))
    state = replace(state, status=status)
    verdict = watchdog.judge(status, {w.worker_id for w in state.in_state(PLANNED)}, now_ms)
    if verdict is None:
        return state, [], "", False
    if verdict.fail:
        status = replace(status.moved(JobState.FAILED, now_ms), reason=verdict.reason, step_failed_ms=0)
        return replace(state, status=status), [], verdict.reason, True
    actions: list[Action] = []
    for wid in verdict.stuck:
        rank = rank_of(wid)
        why = f"{_failed(wid, rank)} stuck: {verdict.reason}"
        state, more = _fail(state, wid, FailureCause.STUCK, rank, why, now_ms)
        actions += more
    stall = watchdog.restarted(state.status.stall, now_ms)
    return replace(state, status=replace(state.status, stall=stall)), actions, verdict.reason, False


def _flag_stragglers(state: CoordState, step_times: dict[str, float], factor: float, now_ms: int) -> tuple[CoordState, str]:
    active = {w: t for w, t in step_times.items() if w in state.workers and state.workers[w].state == WorkerState.ACTIVE and t > 0}
    if len(active) < 2:
        return state, ""
    median = statistics.median(active.values())
    workers = dict(state.workers)
    notes = []
    for wid, rec in state.workers.items():
        if rec.state != WorkerState.ACTIVE or wid not in active:
            continue
        # relative and absolute: 8 ms against a 4 ms median is noise, not a straggler
        slow = active[wid] > factor * median and active[wid] - median > STRAGGLER_FLOOR_S
        if slow != rec.straggler:
            workers[wid] = replace(rec, straggler=slow, changed_ms=now_ms)
            verb = "straggler" if slow else "no longer a straggler"
            notes.append(f"{wid} {verb}: step {active[wid]:.3f}s vs median {median:.3f}s")
    return replace(state, workers=workers), "; ".join(notes)


#: The handler of each event of the job as a whole (no worker record needed):
#: ``(state, event, now_ms, spec, epoch) -> Decision``.
_HANDLERS = {
    StopJob: _on_stop,
    JoinRequest: _on_join,
    WorkerStartFailed: _on_start_failed,
    JobCompleted: _on_completed,
    Checkpointed: _on_checkpointed,
}
#: The handler of each event a worker on record sends:
#: ``(state, event, its record, now_ms, spec, epoch) -> Decision``.
_WORKER_HANDLERS = {
    EvalReported: _on_eval,
    Ready: _on_ready,
    LeaveRequest: _on_leave,
    Left: _on_left,
    WorkerExited: _on_exited,
    StepFailed: _on_step_failed,
}
