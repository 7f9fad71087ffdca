"""What really lands in Redis validates against the published schema (docs/schema/).

The coordinator runs in-process against the real Redis, driven by ``run_once()``; one worker
joins the way an outside client would (a raw ``XADD`` of the JSON that docs/keys.md shows,
``worker_id: null``, its own ``event_id``, the reply popped from ``join:<event_id>``), one
through shoal's own Membership, and a real Heartbeater beats. Every value is then read back
raw and validated with ``jsonschema`` against the checked-in files: the events, the join
reply, the shard table (key and stream), the state and workers hashes, a heartbeat, the
LATEST pointer, the launch hash and the spec."""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path

import jsonschema
import redis
from referencing import Registry, Resource

from shoal.coordinator.loop import Coordinator
from shoal.core.jobspec import JobSpec
from shoal.events import bus
from shoal.events.keys import job_keys
from shoal.events.models import Checkpointed, Ready
from shoal.ops.submit import submit
from shoal.worker.heartbeat import Heartbeater
from shoal.worker.membership import Membership
from tests.helpers import wait_until

DOCS = Path(__file__).resolve().parents[2] / "docs" / "schema"


def _validator(name: str) -> jsonschema.Draft202012Validator:
    doc = json.loads((DOCS / f"{name}.json").read_text())
    registry = Registry().with_resource(doc["$id"], Resource.from_contents(doc))
    return jsonschema.Draft202012Validator(doc, registry=registry, format_checker=jsonschema.FormatChecker())


def _valid(name: str, value) -> None:
    """``value`` (as read from Redis) is valid against ``docs/schema/<name>.json``."""
    errors = sorted(_validator(name).iter_errors(value), key=str)
    assert not errors, f"{name}: {errors[0].message} at {list(errors[0].absolute_path)} in {value!r}"


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def test_real_wire_values_validate_against_the_published_schema(r, redis_url, job_id, queue) -> None:
    keys = job_keys(job_id)
    spec = JobSpec(name=job_id, entrypoint="simulate", min_workers=2, max_workers=3, global_batch_size=12)
    submit(r, spec, workers_per_unit=3)  # spec, registry, launch hash
    assert not r.exists(keys.state)  # no coordinator yet: the job reads as pending
    _valid("JobState", {})
    coord = Coordinator(redis.Redis.from_url(redis_url), instance_id="schema", lease_ttl=5)
    coord.run_once(block_ms=1)

    # an outside client joins with exactly the fields docs/keys.md lists
    event_id = uuid.uuid4().hex
    raw_join = {"kind": "join", "job_id": job_id, "event_id": event_id, "worker_id": None,
                "host": "outside-host", "pid": 4242, "node": "", "ts": 1.7e9, "schema_version": 1}
    _valid("JoinRequest", raw_join)
    _valid("WorkerEvent", raw_join)
    r.xadd(keys.events, {"data": json.dumps(raw_join)})
    coord.run_once(block_ms=50)
    (reply_raw,) = r.lrange(keys.join_reply(event_id), 0, -1)  # named after the JSON event_id
    reply = json.loads(reply_raw)
    _valid("JoinReply", reply)
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
        _valid("WorkerEvent", event)
        _valid({"join": "JoinRequest", "ready": "Ready", "checkpoint": "Checkpointed"}[event["kind"]], event)
    _valid("ShardTable", json.loads(r.get(keys.shard)))
    stream = r.xrange(keys.generations)
    assert stream
    for _sid, fields in stream:
        _valid("ShardTable", json.loads(fields[b"data"]))
    state = {_text(k): _text(v) for k, v in r.hgetall(keys.state).items()}
    assert state["state"] == "running"
    _valid("JobState", state)
    workers = r.hgetall(keys.workers)
    assert {_text(k) for k in workers} == {"w0", "w1"}
    for value in workers.values():
        _valid("WorkerDoc", json.loads(value))
    _valid("Heartbeat", json.loads(r.get(keys.heartbeat("w1"))))
    _valid("LatestPointer", json.loads(r.get(keys.latest)))
    _valid("LaunchSettings", {_text(k): _text(v) for k, v in r.hgetall(keys.launch).items()})
    _valid("JobSpec", json.loads(r.get(keys.spec)))


def test_the_schema_rejects_what_the_reader_rejects() -> None:
    """The published files are not looser than the models on the points an outside writer
    gets wrong: a join without job_id, a worker id that is not a string, an unknown kind."""
    good = {"kind": "join", "job_id": "j", "event_id": "e1", "worker_id": None}
    _valid("WorkerEvent", good)
    check = _validator("WorkerEvent")
    assert not check.is_valid({k: v for k, v in good.items() if k != "job_id"})
    assert not check.is_valid({**good, "worker_id": 7})
    assert not check.is_valid({**good, "kind": "hello"})
    assert not _validator("ShardTable").is_valid({"job_id": "j", "generation": 1})
