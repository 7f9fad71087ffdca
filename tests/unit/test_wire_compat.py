"""Wire compatibility of the events that changed in issues 13 and 14."""

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
