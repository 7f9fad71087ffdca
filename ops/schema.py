"""The published wire schema: JSON Schema files of everything shoal puts on the wire or into
Redis values and store objects, generated from the models that read them.

``docs/schema/`` holds one file per entry of :data:`CATALOG` (``<name>.json``: JSON Schema
2020-12 with ``$id``, ``title``, a ``description`` from the model's docstring and, for each
field, from its ``#:`` comment) and an index, ``README.md``. The files are generated, never
edited by hand::

    python3 scripts/dev.py python -m shoal.ops.schema --write    # regenerate docs/schema/
    python3 scripts/dev.py python -m shoal.ops.schema --check    # exit 1 naming stale files

``tests/unit/test_schema_published.py`` runs the check, so a model changed without
regenerating fails the suite with the names of the stale files and the command above.

Values of Redis HASH keys (:data:`HASH` entries) are published as HGETALL returns them: every
value a string, integers as decimal strings; no field is required there (readers take a
missing field's default; a missing ``state`` hash is a ``pending`` job).
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import GenerateJsonSchema

from shoal.events.records import JobStatus, WorkerRecord
from shoal.core.jobspec import JobSpec
from shoal.events import models as m
from shoal.events import streams as st
from shoal.storage.datasets import DatasetIndex
from shoal.storage.manifest import Manifest
from shoal.storage.sharded import ShardIndex

#: JSON Schema dialect of every published file.
DIALECT = "https://json-schema.org/draft/2020-12/schema"
#: ``$id`` of a published file: a URN, so nothing pretends to be served from a host.
ID_PREFIX = "urn:shoal:schema:"
#: Where the files live, relative to the repository root.
DEFAULT_DIR = Path("docs/schema")
#: The command that regenerates them (named by every staleness message).
WRITE_COMMAND = "python3 scripts/dev.py python -m shoal.ops.schema --write"

#: Kinds of entries: the JSON of a STRING key, of a stream entry's ``data`` field, of a
#: store object; a HASH key's HGETALL; or a flat stream entry's fields (XRANGE: every value a
#: string, like a hash's; lists comma-separated, booleans ``1``/``0``, a mapping as JSON).
JSON, HASH, FIELDS = "json", "hash", "fields"


@dataclass(frozen=True)
class Published:
    """One published schema: ``name`` (the file stem), the type it is generated from, where
    the value lives (for people: a key of ``docs/keys.md`` or a store object) and its kind."""

    name: str
    source: Any
    where: str
    kind: str = JSON
    #: Edits applied to the generated schema (properties a plain type does not declare).
    patch: Callable[[dict], None] | None = field(default=None, compare=False)


def _latest_checkpoint(schema: dict) -> None:
    """:class:`~shoal.events.models.LatestPointer` writes ``checkpoint`` (a property): declare it."""
    schema["properties"]["checkpoint"] = {
        "type": "string", "pattern": rf"^{m.CHECKPOINT_DIR_PREFIX}[0-9]{{9,}}$", "title": "Checkpoint",
        "description": "The checkpoint's folder in the store: step zero-padded to 9 digits (step-000000123).",
    }
    schema["required"] = sorted({*schema.get("required", []), "checkpoint"})


def _job_state(schema: dict) -> None:
    """The state hash's meaning when absent, and its ``state`` field's states."""
    schema["description"] = (
        "The coordinator's record of one job, HGETALL of `shoal:{J}:state`: every value a string. "
        "A job whose hash does not exist yet (or lacks `state`) is `pending`: registered, no "
        "coordinator has written its state; any missing field reads as its default (0 or \"\"). "
        "Allowed moves of `state`: pending -> running | paused | completed | failed | stopped; "
        "running <-> paused; completed, failed and stopped are terminal.\n\n" + inspect.getdoc(JobStatus))


def _progress_kinds(schema: dict) -> None:
    """What rank 0 writes of each kind, and what a reader skips without: an evaluation needs
    its ``metrics``, a committed step its ``step``, ``loss``, ``generation``, ``world_size``, ``t``."""
    schema["if"] = {"properties": {"kind": {"const": "eval"}}, "required": ["kind"]}
    schema["then"] = {"required": ["kind", "step", "epoch", "generation", "metrics", "t"]}
    schema["else"] = {"required": ["step", "loss", "generation", "world_size", "t"]}


_EVENTS = [m.JoinRequest, m.Ready, m.LeaveRequest, m.Left, m.WorkerExited, m.WorkerStartFailed, m.StepFailed,
           m.JobCompleted, m.Checkpointed, m.EvalReported, m.StopJob]

#: Everything published, in index order.
CATALOG: tuple[Published, ...] = (
    Published("WorkerEvent", m.WorkerEvent, "`shoal:{J}:events` stream entries: field `data` (any event, by `kind`)"),
    *(Published(cls.__name__, cls,
                f"`shoal:{{J}}:events` stream entries: field `data` with `kind` = `{cls.model_fields['kind'].default}`")
      for cls in _EVENTS),
    Published("JoinReply", m.JoinReply, "`shoal:{J}:join:<event id>` LIST (one element)"),
    Published("ShardTable", m.ShardTable, "`shoal:{J}:shard` STRING; `shoal:{J}:generations` stream entries: field `data`"),
    Published("Heartbeat", m.Heartbeat, "`shoal:{J}:hb:<worker id>` STRING"),
    Published("WorkerRecord", WorkerRecord, "`shoal:{J}:workers` HASH: each value"),
    Published("JobState", JobStatus, "`shoal:{J}:state` HASH (HGETALL); absent: a pending job", HASH, _job_state),
    Published("LaunchSettings", m.LaunchSettings, "`shoal:{J}:launch` HASH (HGETALL)", HASH),
    Published("LatestPointer", m.LatestPointer, "`shoal:{J}:latest` STRING; the store's `LATEST` object",
              patch=_latest_checkpoint),
    Published("ControlEntry", st.ControlEntry, "`shoal:{J}:control` stream entries (fields)", FIELDS),
    Published("FailureEntry", st.FailureEntry, "`shoal:{J}:failures` stream entries (fields)", FIELDS),
    Published("ProgressEntry", st.ProgressEntry,
              "`shoal:{J}:progress` stream entries (fields): a committed step, or (`kind` = `eval`) an evaluation",
              FIELDS, _progress_kinds),
    Published("LogEntry", st.LogEntry, "`shoal:{J}:logs` stream entries (fields)", FIELDS),
    Published("DeadLetter", st.DeadLetter, "`shoal:{J}:dead` stream entries (fields)", FIELDS),
    Published("JobSpec", JobSpec, "`shoal:{J}:spec` STRING (what `shoal submit` writes; readers ignore unknown fields)"),
    Published("CheckpointManifest", Manifest, "a checkpoint's `manifest.json` in the store (`step-<9 digits>/`)"),
    Published("CheckpointShardIndex", ShardIndex,
              "a sharded checkpoint's `shard-K-of-S.json`: where member K's tensor chunks lie in its `.bin`"),
    Published("DatasetIndex", DatasetIndex, "a dataset's `index.json` in the store (`data_uri`)"),
)

# ---- field descriptions from ``#:`` comments ---------------------------------------------------

_FIELD = re.compile(r"^    (\w+)\s*:")


def field_notes(cls: type) -> dict[str, str]:
    """``{field: text}`` of the ``#:`` comment lines right above each field of ``cls`` and its
    shoal bases (a subclass's note wins). Classes without source give none."""
    notes: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("shoal."):
            notes.update(_own_notes(klass))
    return notes


@functools.cache
def _own_notes(klass: type) -> dict[str, str]:
    notes: dict[str, str] = {}
    try:
        lines = inspect.getsource(klass).splitlines()
    except (OSError, TypeError):
        return notes
    pending: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        hit = _FIELD.match(line)
        if hit and pending:
            notes[hit.group(1)] = " ".join(pending)
        pending = []
    return notes


class _Generator(GenerateJsonSchema):
    """pydantic's generator, plus each field's ``#:`` note as its ``description``."""

    def _with_notes(self, json_schema: dict, cls: type) -> dict:
        notes = field_notes(cls)
        target = json_schema
        if "$ref" in target and "properties" not in target:
            target = self.definitions.get(target["$ref"].split("/")[-1], {})
        for name, prop in target.get("properties", {}).items():
            if name in notes and "description" not in prop:
                prop["description"] = notes[name]
        return json_schema

    def model_schema(self, schema):  # noqa: D102 - pydantic's hook
        return self._with_notes(super().model_schema(schema), schema["cls"])

    def dataclass_schema(self, schema):  # noqa: D102 - pydantic's hook
        return self._with_notes(super().dataclass_schema(schema), schema["cls"])


# ---- HASH values: what HGETALL returns -------------------------------------------------------------

_AS_STRING = {
    "integer": {"type": "string", "pattern": r"^-?[0-9]+$"},
    "number": {"type": "string", "pattern": r"^(-?[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?|nan)$"},
    "boolean": {"type": "string", "enum": ["0", "1"]},
    "array": {"type": "string", "pattern": r"^([^,]+(,[^,]+)*)?$"},
    "object": {"type": "string", "contentMediaType": "application/json"},
}
#: What a list, a boolean and a mapping look like in their string form.
_WIRE_NOTE = {"array": "comma-separated", "object": "JSON text", "boolean": "1 or 0"}


def _wire_default(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def _inline(prop: dict, defs: dict) -> dict:
    """``prop`` with its ``$ref`` (an enum) replaced by the definition it names."""
    if "$ref" in prop:
        inlined = copy.deepcopy(defs[prop.pop("$ref").split("/")[-1]])
        inlined.pop("title", None)
        prop.update({k: v for k, v in inlined.items() if k not in prop})
    return prop


def _hash_form(schema: dict) -> dict:
    """``schema`` as an HGETALL reply (or a flat stream entry's fields): integer, number,
    boolean, list and mapping properties become their string forms, an optional property (a
    value or null) is the value's form (null: the field is absent), enum references are
    inlined, an open enum (``SomeEnum | str``) is its values or any other text, no property
    is required."""
    defs = schema.pop("$defs", {})
    for name, prop in schema.get("properties", {}).items():
        if "anyOf" in prop:  # X | None: absent when None
            kept = [_inline(alt, defs) for alt in prop.pop("anyOf") if alt.get("type") != "null"]
            if len(kept) == 1:
                prop.update({k: v for k, v in kept[0].items() if k not in prop})
            else:
                prop["anyOf"] = kept
            if prop.get("default", 0) is None:
                prop.pop("default")
        _inline(prop, defs)
        kind = prop.get("type")
        if kind in _AS_STRING:
            for key in ("items", "additionalProperties", "minimum", "maximum", "exclusiveMinimum", "maxItems",
                        "propertyNames"):
                prop.pop(key, None)
            prop.update(_AS_STRING[kind])
            if kind in _WIRE_NOTE and "description" in prop:
                prop["description"] += f" ({_WIRE_NOTE[kind]})"
            if "default" in prop:
                prop["default"] = _wire_default(prop["default"])
    schema.pop("required", None)
    schema["additionalProperties"] = {"type": "string"}
    return schema


# ---- rendering ------------------------------------------------------------------------------------


def _docstring(source: Any) -> str:
    doc = inspect.getdoc(source) if isinstance(source, type) else ""
    return inspect.cleandoc(doc or "")


def schema_of(entry: Published) -> dict:
    """The JSON Schema document of one entry (a fresh dict)."""
    if isinstance(entry.source, type) and issubclass(entry.source, BaseModel):
        schema = entry.source.model_json_schema(schema_generator=_Generator)
    else:
        schema = TypeAdapter(entry.source).json_schema(schema_generator=_Generator)
    if entry.patch is not None:
        entry.patch(schema)
    if entry.kind in (HASH, FIELDS):
        schema = _hash_form(schema)
    if entry.source is m.WorkerEvent:
        schema["description"] = ("Any worker event: the JSON in the `data` field of an entry of a job's `events` "
                                 "stream, told apart by `kind`. " + (inspect.getdoc(m) or "").split("\n\n", 1)[1])
    doc = _docstring(entry.source)
    if doc and "description" not in schema:
        schema["description"] = doc
    schema["title"] = entry.name
    schema["$id"] = ID_PREFIX + entry.name
    schema["$schema"] = DIALECT
    schema["x-shoal-location"] = entry.where
    return schema


def _text(schema: dict) -> str:
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _index(catalog: tuple[Published, ...]) -> str:
    rows = "\n".join(f"| [`{e.name}.json`]({e.name}.json) | {e.where} |" for e in catalog)
    return (
        "# Wire schema\n\n"
        "Generated by `shoal.ops.schema` from the models that read these values; do not edit.\n"
        f"Regenerate with `{WRITE_COMMAND}` (the test suite fails while a file is stale).\n"
        "Key names, writers, readers and TTLs: [../keys.md](../keys.md). JSON Schema 2020-12; each\n"
        "file's `$id` is `urn:shoal:schema:<name>` and `x-shoal-location` says where the value lives.\n"
        "HASH keys are published as HGETALL returns them, and flat stream entries as XRANGE does: every value\n"
        "a string (integers in decimal, lists comma-separated, booleans 1/0, a mapping as JSON).\n\n"
        "| schema | where the value lives |\n| --- | --- |\n" + rows + "\n"
    )


def render(catalog: tuple[Published, ...] = CATALOG) -> dict[str, str]:
    """``{file name: text}`` of every published file, index included. Deterministic: the same
    models always give byte-identical text (sorted keys, two-space indent, final newline)."""
    files = {f"{e.name}.json": _text(schema_of(e)) for e in catalog}
    files["README.md"] = _index(catalog)
    return files


def stale(directory: Path, rendered: dict[str, str]) -> list[str]:
    """Names of the files in ``directory`` that differ from ``rendered``: changed, missing,
    or a ``.json`` file no model produces any more. Empty: up to date."""
    out = []
    for name, text in sorted(rendered.items()):
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            out.append(name)
    if directory.is_dir():
        out += sorted(p.name for p in directory.glob("*.json") if p.name not in rendered)
    return out


def stale_message(names: list[str], directory: Path = DEFAULT_DIR) -> str:
    """The one line that reports stale schema files and how to regenerate them."""
    return f"wire schema out of date in {directory}/: {', '.join(names)}; run: {WRITE_COMMAND}"


def write(directory: Path, rendered: dict[str, str]) -> list[str]:
    """Write the stale files of ``rendered`` into ``directory`` and delete ``.json`` files no
    model produces; returns the names changed."""
    changed = stale(directory, rendered)
    directory.mkdir(parents=True, exist_ok=True)
    for name in changed:
        if name in rendered:
            (directory / name).write_text(rendered[name], encoding="utf-8")
        else:
            (directory / name).unlink()
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.ops.schema", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="regenerate the files (default: only check them)")
    ap.add_argument("--check", action="store_true", help="exit 1, naming the stale files, when they are out of date")
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"where the files live (default: {DEFAULT_DIR})")
    args = ap.parse_args(argv)
    rendered = render()
    if args.write:
        try:
            changed = write(args.dir, rendered)
        except OSError as exc:
            print(f"cannot write the schema into {args.dir}/: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"{len(changed)} file(s) written in {args.dir}/" + (f": {', '.join(changed)}" if changed else ""))
        return 0
    names = stale(args.dir, rendered)
    if names:
        print(stale_message(names, args.dir), file=sys.stderr)
        return 1
    print(f"{len(rendered)} schema files in {args.dir}/ are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
