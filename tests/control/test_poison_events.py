"""Fuzzed poison input on the event stream: the coordinator never crashes, loses nothing and
keeps serving; every entry is either applied or dead-lettered with a reason."""

from __future__ import annotations

import json
import uuid

import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.coordinator.loop import Coordinator
from shoal.events import bus
from shoal.events.keys import job_keys
from shoal.events.models import JoinRequest
from shoal.core.registry import create_job
from shoal.core.jobspec import JobSpec

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
_kinds = st.sampled_from(["join", "ready", "leave", "left", "exited", "step_failed", "completed", "stop", "checkpoint", "nope", ""])


@st.composite
def event_like(draw, job: str) -> dict:
    """Dicts near the real schema: right or wrong kinds, job ids, field types and sizes."""
    d = draw(st.dictionaries(st.sampled_from(["generation", "worker_id", "step", "exit_code", "signal", "reason",
                                              "schema_version", "event_id", "store", "summary", "host", "pid"]),
                             _json, max_size=6))
    d["kind"] = draw(_kinds)
    d["job_id"] = draw(st.sampled_from([job, job, "other-job", 7]))
    return d


def _entries(job: str):
    raw = st.dictionaries(st.binary(min_size=1, max_size=12), st.binary(max_size=200), min_size=1, max_size=3)
    as_json = event_like(job).map(lambda d: {b"data": json.dumps(d, default=str).encode()})
    huge = st.just({b"data": b'{"kind": "stop", "job_id": "x", "reason": "' + b"a" * 70000 + b'"}'})
    return st.lists(st.one_of(raw, as_json, as_json, huge), min_size=1, max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_entries_never_crash_the_coordinator_nor_get_lost(r, redis_url, data) -> None:
    job = f"fz-{uuid.uuid4().hex[:12]}"
    keys = job_keys(job)
    create_job(r, JobSpec(name=job, entrypoint="simulate", min_workers=1, max_workers=50, global_batch_size=8))
    coord = Coordinator(redis.Redis.from_url(redis_url), instance_id="fuzz", max_attempts=2)
    coord.run_once(block_ms=1)
    entries = data.draw(_entries(job))
    for fields in entries:
        r.xadd(keys.events, fields)
    for _ in range(len(entries) + 3):
        coord.run_once(block_ms=1)
    info = bus.group_info(r, keys.events)
    assert info.pending == 0  # nothing stuck
    applied = r.hget(keys.state, "applied").decode()
    last = r.xrevrange(keys.events, count=1)[0][0].decode()
    assert applied == last  # every entry was handled, in order
    dead = r.xlen(keys.dead)
    assert dead <= len(entries)
    for _sid, d in r.xrange(keys.dead):
        assert d[b"reason"] and d[b"source_id"]
    # and it still serves a real join afterwards
    ev = JoinRequest(job_id=job, host="h", pid=1)
    bus.publish(r, keys.events, ev)
    coord.run_once(block_ms=50)
    reply = r.lpop(keys.join_reply(ev.event_id))
    assert reply is not None
    r.srem("shoal:jobs", job)
