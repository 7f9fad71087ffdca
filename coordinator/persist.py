"""Reading a job's coordinator state from Redis and turning a Decision into a fenced batch.

Only changed worker records are written, so one event costs one Lua call regardless of
how many workers the job has.
"""

from __future__ import annotations

import redis

from shoal.coordinator.decide import Decision, Forget, Publish, RecordFailure, ReplyJoin, SetLatest, Watch
from shoal.coordinator.fenced import FencedBatch
from shoal.coordinator.states import CoordState, JobStatus, WorkerRecord
from shoal.events.keys import CONTROL_MAXLEN, FAILURES_MAXLEN, GENERATIONS_MAXLEN, JOIN_REPLY_TTL_S, JobKeys


def load_state(client: redis.Redis, keys: JobKeys) -> CoordState:
    """The job's state as last written by a leader (empty state for a new job). A worker
    record that does not parse raises ValueError (see ``WorkerRecord.from_json``)."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.state)
    pipe.hgetall(keys.workers)
    status_raw, workers_raw = pipe.execute()
    workers = {}
    for raw in workers_raw.values():
        rec = WorkerRecord.from_json(raw)
        workers[rec.worker_id] = rec
    return CoordState(status=JobStatus.from_hash(status_raw), workers=workers)


def decision_batch(
    keys: JobKeys, old: CoordState, decision: Decision, *, kind: str, source_id: str, now_ms: int, epoch: int
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
            fields = {"ts_ms": str(now_ms), "worker": action.worker_id, "rank": str(action.rank),
                      "reason": action.reason, "traceback": action.traceback}
            if action.exit_code is not None:
                fields["exit_code"] = str(action.exit_code)
            if action.signal is not None:
                fields["signal"] = str(action.signal)
            batch.xadd(keys.failures, fields, maxlen=FAILURES_MAXLEN)
    if decision.changed:
        batch.xadd(
            keys.control,
            {
                "ts_ms": str(now_ms),
                "epoch": str(epoch),
                "kind": kind,
                "source_id": source_id,
                "job_state": new.status.state.value,
                "generation": str(new.status.generation),
                "reason": decision.reason,
            },
            maxlen=CONTROL_MAXLEN,
        )
    return batch
