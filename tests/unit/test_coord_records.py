"""Worker records and job status as stored in Redis: typed fields that decisions read, and
values that old and new code both parse. Pure: no Redis, time passed in."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shoal.coordinator.decide import EventInput, RecordFailure, Tick, decide
from shoal.coordinator.loop import _step_times
from shoal.coordinator.persist import decision_batch
from shoal.coordinator.states import CoordState
from shoal.events.records import JobStatus, WorkerRecord
from shoal.events.states import FailureCause, JobState, WorkerState
from shoal.core.jobspec import JobSpec
from shoal.events.keys import FAILURES_MAXLEN, job_keys
from shoal.events.models import Heartbeat, JoinRequest, LaunchSettings, WorkerExited

SPEC = JobSpec(name="j", entrypoint="simulate", min_workers=2, max_workers=3, global_batch_size=10, heartbeat_ttl=2.0, heartbeat_interval=0.5)
T0 = 1_000_000

#: a record exactly as the coordinator wrote it before ``cause`` and ``rank`` existed
OLD_RECORD = ('{"worker_id": "w1", "state": "Failed", "joined_ms": 5, "host": "h", "pid": 7, "node": "n", '
              '"reason": "w1 failed (rank 1): no heartbeat for 3000 ms (ttl 2000 ms)", "changed_ms": 9, '
              '"restarts": 2, "straggler": true}')
OLD_FIELDS = ("worker_id", "state", "joined_ms", "host", "pid", "node", "reason", "changed_ms", "restarts", "straggler")


def _old_reader(raw: str) -> dict:
    """What the coordinator before this change kept of a stored record (``from_json_dict``):
    the fields it knew, the state as a WorkerState; it required worker_id, state, joined_ms."""
    d = json.loads(raw)
    known = {k: v for k, v in d.items() if k in OLD_FIELDS}
    known["state"] = WorkerState(known["state"])
    assert {"worker_id", "state", "joined_ms"} <= known.keys()
    return known


def three_workers() -> CoordState:
    s = CoordState()
    for i in range(3):
        s = decide(s, EventInput("1-0", JoinRequest(job_id="j", host="h", pid=i + 1)), T0 + i, SPEC).state
    return s


def test_a_record_round_trips_with_its_typed_fields() -> None:
    rec = WorkerRecord("w3", WorkerState.FAILED, joined_ms=1, host="h", pid=2, node="n", reason="w3 failed (rank 2): x",
                       changed_ms=3, restarts=4, straggler=True, cause=FailureCause.EXITED, rank=2)
    assert WorkerRecord.from_json(rec.to_json()) == rec
    assert WorkerRecord.from_json(rec.to_json().encode()) == rec  # as redis-py returns it


def test_the_stored_text_is_the_old_one_with_the_new_fields_appended() -> None:
    rec = WorkerRecord("w0", WorkerState.ACTIVE, joined_ms=5, host="h", pid=7, reason="joined", changed_ms=6)
    old_text = json.dumps({"worker_id": "w0", "state": "Active", "joined_ms": 5, "host": "h", "pid": 7, "node": "",
                           "reason": "joined", "changed_ms": 6, "restarts": 0, "straggler": False})
    assert rec.to_json() == old_text[:-1] + ', "cause": "", "rank": -1, "backend": "", "device": "", "gpu": "", "placement": "", "planned_in": 0, "dropped_in": 0, "replica_group": "", "shard": -1}'


def test_old_code_reads_a_new_record() -> None:
    rec = WorkerRecord("w1", WorkerState.FAILED, joined_ms=5, host="h", pid=7, node="n", reason="w1 failed (rank 1): y",
                       changed_ms=9, restarts=2, straggler=True, cause=FailureCause.HEARTBEAT_TIMEOUT, rank=1)
    old = _old_reader(rec.to_json())
    assert old == {f: getattr(rec, f) for f in OLD_FIELDS}


def test_new_code_reads_an_old_record_with_defaults_and_ignores_unknown_fields() -> None:
    rec = WorkerRecord.from_json(OLD_RECORD)
    assert (rec.worker_id, rec.state, rec.joined_ms, rec.host, rec.pid, rec.node) == ("w1", WorkerState.FAILED, 5, "h", 7, "n")
    assert (rec.changed_ms, rec.restarts, rec.straggler) == (9, 2, True)
    # nothing is read out of the reason text: an old record has no cause and no rank
    assert (rec.cause, rec.rank) == (FailureCause.NONE, -1)
    newer = json.loads(OLD_RECORD) | {"cause": "oom_killed", "rank": 1, "some_future_field": [1]}
    rec = WorkerRecord.from_json(json.dumps(newer))
    assert (rec.cause, rec.rank) == (FailureCause.NONE, 1)  # a cause this version does not know


@pytest.mark.parametrize("raw", ['{"worker_id": "w1"}', '["w1", "Failed"]', "{not json", '{"worker_id": "w1", "state": "Lost"}'])
def test_a_value_that_is_not_a_worker_record_raises_value_error(raw: str) -> None:
    with pytest.raises(ValueError):
        WorkerRecord.from_json(raw)


def test_both_workers_failed_in_one_tick_are_stored_with_their_ranks_and_causes() -> None:
    s = three_workers()
    keys = job_keys("j")
    d = decide(s, Tick(last_seen={"w0": T0, "w1": T0}), T0 + 5000, SPEC)
    batch = decision_batch(keys, s, d, kind="tick", source_id="tick", now_ms=T0 + 5000, epoch=1)
    workers_idx = batch.keys.index(keys.workers) + 1
    failures_idx = batch.keys.index(keys.failures) + 1
    (hset,) = [op for op in batch.ops if op[:2] == ["HSET", workers_idx]]
    stored = {f: WorkerRecord.from_json(v) for f, v in zip(hset[2::2], hset[3::2])}
    assert {w: (r.state, r.cause, r.rank) for w, r in stored.items()} == {
        "w0": (WorkerState.FAILED, FailureCause.HEARTBEAT_TIMEOUT, 0),
        "w1": (WorkerState.FAILED, FailureCause.HEARTBEAT_TIMEOUT, 1),
    }
    xadds = [op for op in batch.ops if op[:2] == ["XADD", failures_idx]]
    assert [op[2:6] for op in xadds] == [["MAXLEN", "~", str(FAILURES_MAXLEN), "*"]] * 2
    entries = [dict(zip(op[6::2], op[7::2])) for op in xadds]
    assert [(e["worker"], e["rank"], e["reason"]) for e in entries] == [
        ("w0", "0", "w0 failed (rank 0): no heartbeat for 5000 ms (ttl 2000 ms)"),
        ("w1", "1", "w1 failed (rank 1): no heartbeat for 5000 ms (ttl 2000 ms)"),
    ]


def _timed_out(rank: int, reason: str, cause: FailureCause) -> CoordState:
    """Three workers of generation 1, w2 failed with ``cause`` holding ``rank``, with ``reason``."""
    s = three_workers()
    s = decide(s, Tick(last_seen={"w2": T0}), T0 + 5000, SPEC).state
    w2 = s.workers["w2"]
    return replace(s, workers={**s.workers, "w2": replace(w2, reason=reason, cause=cause, rank=rank)})


def test_an_exit_report_is_promoted_on_the_recorded_cause_and_rank_whatever_the_reason_says() -> None:
    s = _timed_out(2, "edited by hand", FailureCause.HEARTBEAT_TIMEOUT)
    assert s.status.first_failure_worker == "w2"
    d = decide(s, EventInput("2-0", WorkerExited(job_id="j", worker_id="w2", exit_code=1, traceback="E: boom")), T0 + 5001, SPEC)
    why = "w2 failed (rank 2): process ended with exit code 1 (E: boom)"
    assert d.changed and d.reason == f"root cause of w2: {why}"
    w2 = d.state.workers["w2"]
    assert (w2.reason, w2.cause, w2.rank) == (why, FailureCause.EXITED, 2)
    assert (d.state.status.first_failure, d.state.status.first_failure_traceback) == (why, "E: boom")
    assert RecordFailure("w2", 2, why, 1, None, "E: boom") in d.actions
    # a second report finds the cause already EXITED: nothing more to learn
    d2 = decide(d.state, EventInput("3-0", WorkerExited(job_id="j", worker_id="w2", exit_code=1)), T0 + 5002, SPEC)
    assert not d2.changed and not d2.actions


def test_a_reason_that_reads_like_a_timeout_does_not_make_one() -> None:
    s = _timed_out(2, "w2 failed (rank 2): no heartbeat for 3000 ms (ttl 2000 ms)", FailureCause.EXITED)
    d = decide(s, EventInput("2-0", WorkerExited(job_id="j", worker_id="w2", exit_code=1)), T0 + 5001, SPEC)
    assert not d.changed and not d.actions and d.reason == "exit of w2 ignored: it is Failed"


def test_an_old_status_hash_reads_without_the_root_cause_worker() -> None:
    old = {b"state": b"running", b"generation": b"3", b"first_failure": b"w1 failed (rank 1): x", b"latest_step": b"7"}
    status = JobStatus.from_hash(old)
    assert (status.state, status.generation, status.latest_step) == (JobState.RUNNING, 3, 7)
    assert (status.first_failure, status.first_failure_worker) == ("w1 failed (rank 1): x", "")
    full = JobStatus(first_failure="w1 failed: y", first_failure_worker="w1")
    assert JobStatus.from_hash(full.to_hash()) == full


def test_launch_settings_parse_a_hash_of_bytes_and_refuse_garbage() -> None:
    assert LaunchSettings.from_hash({b"workers": b"4", b"units": b"2"}) == LaunchSettings(workers=4, units=2)
    assert LaunchSettings.from_hash({b"units": b"2"}).workers == 1
    with pytest.raises(ValueError):
        LaunchSettings.from_hash({b"workers": b"four"})


def test_step_times_come_from_heartbeats_read_through_their_model() -> None:
    good = Heartbeat(worker_id="w0", step=3, step_time=0.25).model_dump_json().encode()
    older = b'{"worker_id": "w1", "step_time": 0.5}'  # a heartbeat with only some fields
    no_step_yet = Heartbeat(worker_id="w2").model_dump_json().encode()
    junk = [None, b"[1, 2]", b"{not json", b'{"step_time": 0.1}', b'{"worker_id": "w9", "step_time": "slow"}']
    assert _step_times([good, older, no_step_yet, *junk]) == {"w0": 0.25, "w1": 0.5}
    assert _step_times(None) == {}
