"""Wire contract: key names, event decoding errors, round trips."""

from __future__ import annotations

import json

import pytest

from shoal.events.keys import job_keys, job_of_key
from shoal.events.models import MAX_EVENT_BYTES, InvalidEvent, JoinRequest, Ready, decode_event, encode_event


def test_every_job_key_shares_the_hash_tag() -> None:
    k = job_keys("my-job")
    names = [k.spec, k.lease, k.epoch, k.state, k.workers, k.shard, k.generations, k.control, k.join_reply("e"),
             k.latest, k.events, k.dead, k.heartbeat("w1"), k.last_seen, k.logs, k.failures, k.rendezvous(3)]
    assert len(set(names)) == len(names)
    assert all(n.startswith("shoal:{my-job}:") for n in names)
    assert {job_of_key(n) for n in names} == {"my-job"}


@pytest.mark.parametrize("bad", ["", "a:b", "a{b}", "x" * 65, "sp ace"])
def test_job_ids_that_would_break_keys_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid job id"):
        job_keys(bad)


def test_round_trip_and_unknown_fields_are_tolerated() -> None:
    ev = Ready(job_id="j", worker_id="w1", generation=4)
    fields = encode_event(ev)
    assert decode_event(fields, expected_job="j") == ev
    newer = json.loads(fields["data"]) | {"some_future_field": [1, 2]}
    assert decode_event({"data": json.dumps(newer)}) == ev


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({b"foo": b"bar"}, "no 'data' field"),
        ({b"\xdf\x00": b"bar"}, "no 'data' field"),
        ({b"data": b"\xff\xfe garbage"}, "not JSON"),
        ({b"data": b'{"kind": "ready", "job_id": "j", "gener'}, "not JSON"),
        ({b"data": b"[1, 2]"}, "not a JSON object"),
        ({b"data": b'{"kind": "teleport", "job_id": "j"}'}, "schema"),
        ({b"data": b'{"kind": "ready", "job_id": "j", "generation": "soon"}'}, "schema: ready.generation"),
        ({b"data": b'{"kind": "ready", "job_id": "j", "generation": 1, "schema_version": 99}'}, "unsupported schema_version"),
        ({b"data": b"x" * (MAX_EVENT_BYTES + 1)}, "oversized"),
        ({b"data": JoinRequest(job_id="other").model_dump_json().encode()}, "does not match"),
    ],
)
def test_malformed_entries_raise_invalid_event_with_a_reason(fields, reason) -> None:
    with pytest.raises(InvalidEvent) as exc:
        decode_event(fields, expected_job="j")
    assert reason in exc.value.reason


def test_every_worker_event_kind_is_a_control_kind() -> None:
    from typing import get_args

    from shoal.events.models import WorkerEvent
    from shoal.events.streams import ControlKind

    kinds = {m.model_fields["kind"].default for m in get_args(get_args(WorkerEvent)[0])}
    assert len(kinds) == 11 and kinds <= {k.value for k in ControlKind}
    assert {k.value for k in ControlKind} - kinds == {"tick", "dead_letter"}


def test_the_stream_enums_read_known_values_as_members_and_keep_unknown_ones() -> None:
    from shoal.events.states import JobState
    from shoal.events.streams import ControlEntry, ControlKind, ProgressEntry, ProgressKind

    known = ControlEntry.from_fields({b"kind": b"exited", b"job_state": b"running", b"generation": b"3"})
    assert known.kind is ControlKind.EXITED and known.job_state is JobState.RUNNING and known.generation == 3
    assert known.to_fields()["kind"] == "exited" and known.to_fields()["job_state"] == "running"
    newer = ControlEntry.from_fields({"kind": "resharded", "job_state": "draining", "generation": "4"})
    assert (newer.kind, newer.job_state, newer.generation) == ("resharded", "draining", 4)
    assert newer.to_fields()["kind"] == "resharded" and f"{known.job_state:<8}|" == "running |"
    assert ProgressEntry.from_fields({"kind": "eval", "step": "2"}).kind is ProgressKind.EVAL
    later = ProgressEntry.from_fields({"kind": "profile", "step": "2"})
    assert later.kind == "profile" and not later.is_eval and not later.is_step
