"""Reading a job's coordinator state from Redis and turning a Decision into a fenced batch.

Only changed worker records are written, so one event costs one Lua call regardless of
how many workers the job has.
"""

from __future__ import annotations

import redis

from shoal.core.durable import execute_confirmed
from shoal.coordinator.decide import Decision, Forget, Publish, RecordFailure, ReplyJoin, SetLatest, Watch
from shoal.coordinator.fenced import FencedBatch
from shoal.coordinator.states import CoordState
from shoal.events.streams import ControlEntry, ControlKind, FailureEntry
from shoal.events.records import JobStatus, WorkerRecord
from shoal.events.keys import CONTROL_MAXLEN, FAILURES_MAXLEN, GENERATIONS_MAXLEN, JOIN_REPLY_TTL_S, JobKeys


def load_state(client: redis.Redis, keys: JobKeys) -> CoordState:
    """The job's state as last written by a leader (empty state for a new job). A worker
    record that does not parse raises ValueError (see ``WorkerRecord.from_json``); under
    Sentinel, NotReplicated when no replica holds what was read."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.state)
    pipe.hgetall(keys.workers)
    # under Sentinel: only a state a replica holds (a cut-off primary's may be dropped)
    status_raw, workers_raw = execute_confirmed(client, pipe, f"state of job {keys.job_id}")
    workers = {}
    for raw in workers_raw.values():
        rec = WorkerRecord.from_json(raw)
        workers[rec.worker_id] = rec
    return CoordState(status=JobStatus.from_hash(status_raw), workers=workers)


def decision_batch(
    keys: JobKeys, old: CoordState, decision: Decision, *, kind: ControlKind | str, source_id: str, now_ms: int, epoch: int,
    coordinator: str = "",
) -> FencedBatch:
    """Writes for ``decision``: status, changed workers, actions and a control-log entry."""
    new = decision.state
    batch = FencedBatch(keys)
    if new.status != old.status:
        batch.hset(keys.state, new.status.to_hash())
    # records are immutable: an unchanged worker is the very same object (O(1) per worker)
    changed = {wid: rec for wid, rec in new.workers.items() if old.workers.get(wid) is not rec}
    if changed:
        batch.hset(keys.workers, {wid: rec.to_json() for wid, rec in changed.items()})
    for action in decision.actions:
        if isinstance(action, ReplyJoin):
            key = keys.join_reply(action.event_id)
            batch.add("RPUSH", key, action.reply.model_dump_json())
            batch.add("EXPIRE", key, JOIN_REPLY_TTL_S)
        elif isinstance(action, Publish):
            doc = action.table.model_dump_json()
            batch.add("SET", keys.shard, doc)
            batch.xadd(keys.generations, {"data": doc}, maxlen=GENERATIONS_MAXLEN)
        elif isinstance(action, Watch):
            batch.add("ZADD", keys.last_seen, action.now_ms, action.worker_id)
        elif isinstance(action, SetLatest):
            batch.add("SETLATEST", keys.latest, action.step, action.pointer_json)
        elif isinstance(action, Forget):
            batch.add("ZREM", keys.last_seen, action.worker_id)
            batch.add("ZREM", keys.busy, action.worker_id)
            batch.add("DEL", keys.heartbeat(action.worker_id))
        elif isinstance(action, RecordFailure):
            failure = FailureEntry(ts_ms=now_ms, worker=action.worker_id, rank=action.rank, reason=action.reason,
                                   traceback=action.traceback, exit_code=action.exit_code, signal=action.signal)
            batch.xadd(keys.failures, failure.to_fields(), maxlen=FAILURES_MAXLEN)
    if decision.changed:
        entry = control_entry(decision, kind=kind, source_id=source_id, now_ms=now_ms, epoch=epoch,
                              coordinator=coordinator)
        batch.xadd(keys.control, entry.to_fields(), maxlen=CONTROL_MAXLEN)
    return batch


def control_entry(decision: Decision, *, kind: ControlKind | str, source_id: str, now_ms: int, epoch: int,
                  coordinator: str = "") -> ControlEntry:
    """The control stream's entry of ``decision``: what it applied, the job's state after it,
    the reason, the typed membership change of the generation it planned, if any, and the
    step LATEST now names, if it moved."""
    status = decision.state.status
    change = next((a.change for a in decision.actions if isinstance(a, Publish) and a.change is not None), None)
    latest = next((a.step for a in decision.actions if isinstance(a, SetLatest)), None)
    return ControlEntry(ts_ms=now_ms, epoch=epoch, coordinator=coordinator, kind=kind, source_id=source_id, job_state=status.state,
                        generation=status.generation, reason=decision.reason, latest_step=latest,
                        **(change.fields() if change is not None else {}))
