"""Validating values read from Redis against the published wire schema (docs/schema/), with
the ``jsonschema`` package: what tests use to show the real wire matches the published files."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
from referencing import Registry, Resource

DOCS = Path(__file__).resolve().parents[1] / "docs" / "schema"


def validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator of ``docs/schema/<name>.json`` (its ``$id`` registered, so refs resolve)."""
    doc = json.loads((DOCS / f"{name}.json").read_text())
    registry = Registry().with_resource(doc["$id"], Resource.from_contents(doc))
    return jsonschema.Draft202012Validator(doc, registry=registry, format_checker=jsonschema.FormatChecker())


def assert_valid(name: str, value) -> None:
    """``value`` (as read from Redis, decoded) is valid against ``docs/schema/<name>.json``;
    AssertionError naming the first problem otherwise."""
    errors = sorted(validator(name).iter_errors(value), key=str)
    assert not errors, f"{name}: {errors[0].message} at {list(errors[0].absolute_path)} in {value!r}"


def stream_entries(client, stream: str) -> list[dict[str, str]]:
    """Every entry of ``stream`` as a dict of decoded strings (what a flat entry's schema describes)."""
    def text(raw) -> str:
        return raw.decode() if isinstance(raw, bytes) else raw

    return [{text(k): text(v) for k, v in fields.items()} for _sid, fields in client.xrange(stream)]
