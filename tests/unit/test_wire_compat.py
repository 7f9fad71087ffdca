"""Wire compatibility of the events that changed in issues 13 and 14, and of the state hash
that changed in issue 36."""

from __future__ import annotations

import json

from shoal.events.models import JoinRequest, ShardTable, WorkerStartFailed, decode_event, encode_event


def test_a_join_from_an_older_worker_with_previous_worker_id_still_decodes() -> None:
    old = {"kind": "join", "job_id": "j", "host": "h", "pid": 3, "previous_worker_id": "w4"}
    ev = decode_event({"data": json.dumps(old)}, "j")
    assert isinstance(ev, JoinRequest) and ev.pid == 3 and not hasattr(ev, "previous_worker_id")


def test_a_start_failure_round_trips_and_a_table_without_evicted_reads_as_none_evicted() -> None:
    ev = WorkerStartFailed(job_id="j", node="n1", slot=2, pid=9, exit_code=2, traceback="tb", gave_up=True)
    back = decode_event(encode_event(ev), "j")
    assert back == ev and back.worker_id is None and back.who() == "the worker process on node n1 (slot 2, pid 9)"
    old_table = {"job_id": "j", "generation": 3, "world_size": 0, "strategy": "contiguous", "num_samples": 8,
                 "members": []}
    assert ShardTable.model_validate(old_table).evicted == []


def test_the_state_hash_keeps_formation_eval_summary_and_owners_as_json_in_one_field_each() -> None:
    """Issue 36: JobStatus's formation state is one record (``formation``), and ``eval``,
    ``summary``, ``shard_owners`` are typed; each is JSON in one hash field, the last three in
    the field and shape they had as strings (what an older reader parses)."""
    from dataclasses import replace

    from shoal.events.records import Evaluation, Formation, JobStatus

    status = replace(JobStatus(), formation=Formation(unformed_since_ms=5, failures=2, config_error="no_device"),
                     eval=Evaluation(step=4, epoch=1, generation=2, metrics={"acc": 0.5}, worker_id="w0"),
                     summary={"step": 4, "digest": "ab"}, shard_owners={"w0": [(0, 3)], "w1": [(3, 6)]})
    h = status.to_hash()
    assert json.loads(h["formation"])["unformed_since_ms"] == 5 and json.loads(h["formation"])["config_error"] == "no_device"
    assert json.loads(h["eval"]) == {"step": 4, "epoch": 1, "generation": 2, "metrics": {"acc": 0.5}, "worker_id": "w0"}
    assert json.loads(h["summary"]) == {"step": 4, "digest": "ab"}
    assert json.loads(h["shard_owners"]) == {"w0": [[0, 3]], "w1": [[3, 6]]}
    assert not {"unformed_since_ms", "rendezvous_error", "formation_failures"} & h.keys()
    assert JobStatus.from_hash({k.encode(): v.encode() for k, v in h.items()}) == status
    empty = JobStatus().to_hash()
    assert (empty["eval"], empty["summary"], empty["shard_owners"]) == ("", "", "")


def test_a_state_hash_of_an_older_coordinator_reads_its_flat_formation_fields() -> None:
    from shoal.events.records import Formation, JobStatus

    old = {b"state": b"running", b"unformed_since_ms": b"77", b"rendezvous_error": b"w1: refused",
           b"formation_failures": b"2", b"formation_digest": b"d1", b"formation_failed_generation": b"4",
           b"formation_retry_ms": b"900", b"formation_error": b"no_device", b"formation_strikes": b"1",
           b"formation_strike_generation": b"4", b"eval": b'{"step": 9, "metrics": {"a": 1}}', b"summary": b'{"step": 9}'}
    status = JobStatus.from_hash(old)
    assert status.formation == Formation(unformed_since_ms=77, rendezvous_error="w1: refused", failures=2, digest="d1",
                                         failed_generation=4, retry_ms=900, config_error="no_device", strikes=1,
                                         strike_generation=4)
    assert status.eval.step == 9 and status.eval.metrics == {"a": 1.0} and status.summary == {"step": 9}
    # a record written since wins over stale flat fields left in the hash
    assert JobStatus.from_hash({**old, b"formation": b'{"failures": 1}'}).formation == Formation(failures=1)


def test_a_damaged_json_field_reads_as_none_and_loses_nothing_else() -> None:
    from shoal.events.records import JobStatus

    status = JobStatus.from_hash({"state": "running", "generation": "3", "eval": "{not json", "summary": "[1]",
                                  "shard_owners": '{"w0": 5}', "formation": "7"})
    assert (status.eval, status.summary, status.shard_owners, status.generation) == (None, {}, None, 3)
    assert status.formation == JobStatus().formation
