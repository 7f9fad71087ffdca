"""The published wire schema (docs/schema/) is generated from the models and kept up to date:
the check regenerates it in memory and compares, and fails naming the stale files and the
command that regenerates them - also when a model changed and nobody regenerated."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jsonschema
import pytest
from pydantic import Field, create_model

from shoal.events import models as m
from shoal.ops import schema

DOCS = Path(__file__).resolve().parents[2] / "docs" / "schema"


def test_the_published_schema_is_up_to_date() -> None:
    names = schema.stale(DOCS, schema.render())
    assert not names, schema.stale_message(names)


def test_every_published_file_is_a_valid_json_schema_with_id_title_and_description() -> None:
    for entry in schema.CATALOG:
        doc = json.loads((DOCS / f"{entry.name}.json").read_text())
        jsonschema.Draft202012Validator.check_schema(doc)
        assert doc["$id"] == f"urn:shoal:schema:{entry.name}"
        assert doc["title"] == entry.name
        assert doc["description"].strip(), entry.name
    # the fields an outside client needs are described, from the models' ``#:`` comments
    join = json.loads((DOCS / "JoinRequest.json").read_text())["properties"]
    for name in ("event_id", "job_id", "worker_id", "host", "pid", "node"):
        assert join[name].get("description"), name
    assert "reply key" in join["event_id"]["description"]


def test_rendering_is_deterministic() -> None:
    assert schema.render() == schema.render()


def _patched(**models) -> tuple[schema.Published, ...]:
    """The catalog with some entries generated from other models (by entry name)."""
    return tuple(dataclasses.replace(e, source=models[e.name]) if e.name in models else e for e in schema.CATALOG)


def test_a_model_changed_without_regenerating_fails_the_check() -> None:
    """Acceptance 5: a field added to ShardTable (a patched copy of the model) and a field
    whose constraint changed in Heartbeat make the check name exactly those files."""
    table = create_model("ShardTable", __base__=m.ShardTable, __doc__=m.ShardTable.__doc__,
                         priority=(int, Field(default=0)))
    beat = create_model("Heartbeat", __base__=m.Heartbeat, __doc__=m.Heartbeat.__doc__,
                        step=(int, Field(default=0, ge=0)))
    names = schema.stale(DOCS, schema.render(_patched(Heartbeat=beat, ShardTable=table)))
    assert names == ["Heartbeat.json", "ShardTable.json"]
    msg = schema.stale_message(names)
    assert "Heartbeat.json, ShardTable.json" in msg and schema.WRITE_COMMAND in msg


def test_the_command_checks_writes_and_removes(tmp_path, capsys) -> None:
    out = tmp_path / "schema"
    shutil.copytree(DOCS, out)
    assert schema.main(["--check", "--dir", str(out)]) == 0
    # a hand edit, a deleted file and a file no model produces any more
    (out / "JoinReply.json").write_text("{}\n")
    (out / "Left.json").unlink()
    (out / "Gone.json").write_text("{}\n")
    assert schema.main(["--check", "--dir", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"wire schema out of date in {out}/: JoinReply.json, Left.json, Gone.json; "
                   f"run: {schema.WRITE_COMMAND}")
    assert schema.main(["--write", "--dir", str(out)]) == 0
    assert not (out / "Gone.json").exists()
    assert schema.stale(out, schema.render()) == []


def test_hash_values_are_published_as_hgetall_returns_them() -> None:
    state = json.loads((DOCS / "JobState.json").read_text())
    check = jsonschema.Draft202012Validator(state)
    assert check.is_valid({})  # no hash yet: a pending job
    assert check.is_valid({"state": "running", "generation": "3", "reason": "w1 joined"})
    assert not check.is_valid({"state": "running", "generation": 3})  # HGETALL gives strings
    assert not check.is_valid({"state": "sleeping"})
    assert "pending" in state["description"]


@pytest.mark.parametrize("name", ["ShardTable", "JobSpec", "CheckpointManifest"])
def test_files_list_their_location(name: str) -> None:
    doc = json.loads((DOCS / f"{name}.json").read_text())
    assert doc["x-shoal-location"]
    assert f"[`{name}.json`]({name}.json)" in (DOCS / "README.md").read_text()


def test_an_unwritable_directory_is_one_line(tmp_path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert schema.main(["--write", "--dir", str(blocker / "schema")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"cannot write the schema into {blocker}/schema/")


def test_a_stream_entry_written_through_its_model_reads_back_through_every_reader(r, job_id):
    """One model per flat stream: what the writer's model writes, the published schema
    accepts, and every reader (the model itself, ``shoal events``'s formatting, the HTTP API's
    JSON, the report's marks) reads back the same typed fields."""
    from shoal.events.keys import job_keys
    from shoal.events.streams import ControlEntry
    from shoal.ops.report import membership_events
    from shoal.ops.streams import decision_json, format_decision, read_range
    from tests.wire_schema import assert_valid

    keys = job_keys(job_id)
    written = ControlEntry(ts_ms=1700000000000, epoch=3, kind="exited", source_id="5-0", job_state="running",
                           generation=4, reason="w2 failed: process ended with signal 9", world_size=2,
                           joined=("w3",), removed=("w2", "w1"), causes=("exited", "left"))
    fields = written.to_fields()
    assert fields["removed"] == "w2,w1" and fields["world_size"] == "2" and "paused" not in fields
    assert_valid("ControlEntry", fields)
    r.xadd(keys.control, fields)
    ((sid, read),) = read_range(r, keys.control, ControlEntry)
    assert read == written and (read.failed, read.left) == (("w2",), ("w1",))
    assert decision_json(sid, read)["removed"] == ["w2", "w1"]
    assert format_decision(read).endswith("[exited] w2 failed: process ended with signal 9")
    (mark,) = membership_events([read])
    assert (mark.kind, mark.failed, mark.joined, mark.world_size) == ("failure", ("w2",), ("w3",), 2)

