"""What really lands in Redis validates against the published schema (docs/schema/).

The coordinator runs in-process against the real Redis, driven by ``run_once()``; one worker
joins the way an outside client would (a raw ``XADD`` of the JSON that docs/keys.md shows,
``worker_id: null``, its own ``event_id``, the reply popped from ``join:<event_id>``), one
through shoal's own Membership, and a real Heartbeater beats. Every value is then read back
raw and validated with ``jsonschema`` against the checked-in files: the events, the join
reply, the shard table (key and stream), the state and workers hashes, a heartbeat, the
LATEST pointer, the launch hash and the spec; and the flat entries of the informational
streams - decisions, failures, dead letters, progress and log lines - written by their real
writers."""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid

import redis

from shoal.coordinator.loop import Coordinator
from shoal.core.jobspec import JobSpec
from shoal.events import bus
from shoal.events.keys import job_keys
from shoal.events.models import Checkpointed, Ready, WorkerExited
from shoal.ops.submit import submit
from shoal.worker.heartbeat import Heartbeater
from shoal.worker.loghandler import redis_logging
from shoal.worker.membership import Membership
from shoal.worker.progress import ProgressRecorder
from tests.helpers import wait_until
from tests.wire_schema import assert_valid, stream_entries, validator


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def test_real_wire_values_validate_against_the_published_schema(r, redis_url, job_id, queue) -> None:
    keys = job_keys(job_id)
    spec = JobSpec(name=job_id, entrypoint="simulate", min_workers=2, max_workers=3, global_batch_size=12)
    submit(r, spec, workers_per_unit=3)  # spec, registry, launch hash
    assert not r.exists(keys.state)  # no coordinator yet: the job reads as pending
    assert_valid("JobState", {})
    coord = Coordinator(redis.Redis.from_url(redis_url), instance_id="schema", lease_ttl=5)
    coord.run_once(block_ms=1)

    # an outside client joins with exactly the fields docs/keys.md lists
    event_id = uuid.uuid4().hex
    raw_join = {"kind": "join", "job_id": job_id, "event_id": event_id, "worker_id": None,
                "host": "outside-host", "pid": 4242, "node": "", "ts": 1.7e9, "schema_version": 1}
    assert_valid("JoinRequest", raw_join)
    assert_valid("WorkerEvent", raw_join)
    r.xadd(keys.events, {"data": json.dumps(raw_join)})
    coord.run_once(block_ms=50)
    (reply_raw,) = r.lrange(keys.join_reply(event_id), 0, -1)  # named after the JSON event_id
    reply = json.loads(reply_raw)
    assert_valid("JoinReply", reply)
    assert reply["accepted"] and reply["worker_id"] == "w0"
    outside = reply["worker_id"]

    # shoal's own worker joins (its reply is popped by Membership)
    inside = Membership(redis.Redis.from_url(redis_url), job_id, node="n1")
    joined: list[str] = []
    t = threading.Thread(target=lambda: joined.append(inside.join(10)))
    t.start()
    wait_until(lambda: (coord.run_once(block_ms=20), not t.is_alive())[1], 20, "the second join's reply")
    t.join(5)
    assert joined == ["w1"]
    hb = Heartbeater(redis.Redis.from_url(redis_url), keys, "w1", interval=0.2, ttl=2.0, pid=os.getpid())
    hb.update(step=3, generation=1, loss=0.5, step_time=0.01, epoch=0, total_steps=10)
    assert hb.beat()

    # both were planned into a generation (min_workers 2): they report ready, w1 checkpoints
    table = wait_until(lambda: (coord.run_once(block_ms=20), r.get(keys.shard))[1], 20, "a shard table")
    generation = json.loads(table)["generation"]
    bus.publish(r, keys.events, Ready(job_id=job_id, worker_id=outside, generation=generation, step=0))
    inside.ready(generation, 0)
    bus.publish(r, keys.events, Checkpointed(job_id=job_id, worker_id="w1", step=2, store="file:///tmp/x",
                                             generation=generation))
    wait_until(lambda: (coord.run_once(block_ms=20), r.get(keys.latest))[1], 20, "the LATEST pointer")

    for _sid, fields in r.xrange(keys.events):
        event = json.loads(fields[b"data"])
        assert_valid("WorkerEvent", event)
        assert_valid({"join": "JoinRequest", "ready": "Ready", "checkpoint": "Checkpointed"}[event["kind"]], event)
    assert_valid("ShardTable", json.loads(r.get(keys.shard)))
    stream = r.xrange(keys.generations)
    assert stream
    for _sid, fields in stream:
        assert_valid("ShardTable", json.loads(fields[b"data"]))
    state = {_text(k): _text(v) for k, v in r.hgetall(keys.state).items()}
    assert state["state"] == "running"
    assert_valid("JobState", state)
    workers = r.hgetall(keys.workers)
    assert {_text(k) for k in workers} == {"w0", "w1"}
    for value in workers.values():
        assert_valid("WorkerRecord", json.loads(value))
    assert_valid("Heartbeat", json.loads(r.get(keys.heartbeat("w1"))))
    assert_valid("LatestPointer", json.loads(r.get(keys.latest)))
    assert_valid("LaunchSettings", {_text(k): _text(v) for k, v in r.hgetall(keys.launch).items()})
    assert_valid("JobSpec", json.loads(r.get(keys.spec)))

    # the flat stream entries: a failure (the outside worker's process exited), a dead letter
    bus.publish(r, keys.events, WorkerExited(job_id=job_id, worker_id=outside, exit_code=3, pid=4242,
                                             traceback="Traceback: boom"))
    r.xadd(keys.events, {"data": "not json"})
    wait_until(lambda: (coord.run_once(block_ms=20), r.xlen(keys.dead))[1], 20, "the dead letter")
    (failure,) = stream_entries(r, keys.failures)
    assert failure["worker"] == outside and failure["exit_code"] == "3"
    assert_valid("FailureEntry", failure)
    (dead,) = stream_entries(r, keys.dead)
    assert_valid("DeadLetter", dead)
    control = stream_entries(r, keys.control)
    assert {"join", "ready", "checkpoint", "exited", "dead_letter"} <= {c["kind"] for c in control}
    for entry in control:
        assert_valid("ControlEntry", entry)
    progress = ProgressRecorder(r, keys)
    assert progress.record(5, 0.25, generation, 2, input_wait=0.001, compute=0.02, exposed_comm=0.0)
    assert progress.record(6, None, generation + 1, 1)  # no loss: "nan"
    assert progress.record_eval(6, 0, generation + 1, {"accuracy": 0.5})
    entries = stream_entries(r, keys.progress)
    assert [e.get("kind") for e in entries] == [None, None, "eval"] and entries[1]["loss"] == "nan"
    for entry in entries:
        assert_valid("ProgressEntry", entry)
    quiet = logging.getLogger("test.wire")
    with redis_logging(r, job_id, "w1", quiet):
        quiet.warning("a line for the logs stream")
    (line,) = stream_entries(r, keys.logs)
    assert_valid("LogEntry", line)


def test_the_schema_rejects_what_the_reader_rejects() -> None:
    """The published files are not looser than the models on the points an outside writer
    gets wrong: a join without job_id, a worker id that is not a string, an unknown kind."""
    good = {"kind": "join", "job_id": "j", "event_id": "e1", "worker_id": None}
    assert_valid("WorkerEvent", good)
    check = validator("WorkerEvent")
    assert not check.is_valid({k: v for k, v in good.items() if k != "job_id"})
    assert not check.is_valid({**good, "worker_id": 7})
    assert not check.is_valid({**good, "kind": "hello"})
    assert not validator("ShardTable").is_valid({"job_id": "j", "generation": 1})
    step = {"step": "3", "loss": "0.5", "generation": "1", "world_size": "2", "t": "1700000000.125"}
    assert_valid("ProgressEntry", step)
    assert not validator("ProgressEntry").is_valid({**step, "step": "three"})
    assert not validator("ProgressEntry").is_valid({"kind": "eval", "step": "3"})
