"""Pure pieces of the HTTP API and of the stream readers the CLI shares with it: the token's
loading rules, stream-entry ids from clients, entries read through their wire models (a bad
field is dropped, not the entry), one-line error details, and SSE framing."""

from __future__ import annotations

import pytest

from shoal.core.errors import ConfigError
from shoal.events.streams import ControlEntry, LogEntry
from shoal.ops.api.auth import load_token
from shoal.ops.api.errors import MAX_DETAIL, one_line
from shoal.ops.api.sse import event
from shoal.ops.streams import format_decision, format_log, stream_id


def test_the_token_comes_from_the_file_first_then_the_environment(tmp_path) -> None:
    f = tmp_path / "t"
    f.write_text("file-token-0123456789\nsecond line ignored\n")
    assert load_token(str(f), {"SHOAL_API_TOKEN": "env-token-0123456789"}) == "file-token-0123456789"
    assert load_token(None, {"SHOAL_API_TOKEN": " env-token-0123456789\n"}) == "env-token-0123456789"
    assert load_token(None, {}) is None and load_token(None, {"SHOAL_API_TOKEN": "  "}) is None
    for text, why in (("", "is empty"), ("short", "at least 16"), ("has a space in the middle", "without spaces")):
        f.write_text(text)
        with pytest.raises(ConfigError, match=why) as err:
            load_token(str(f), {})
        assert text not in str(err.value) or not text
    with pytest.raises(ConfigError, match="cannot read --token-file"):
        load_token(str(tmp_path / "missing"), {})


def test_stream_ids_from_clients() -> None:
    assert stream_id(None) == "0-0" and stream_id("") == "0-0"
    assert stream_id("1700000000000") == "1700000000000-0" and stream_id("17-3") == "17-3"
    for bad in ("yesterday", "1-", "-1", "1-x", "1 2", "9" * 50):
        with pytest.raises(ValueError):
            stream_id(bad)


def test_entries_read_through_their_models_keep_what_parses() -> None:
    line = LogEntry.from_fields({b"worker": b"w1", b"level": b"INFO", b"msg": "h\u00e9".encode(), b"ts": b"12.5",
                                b"extra": b"ignored"})
    assert (line.worker, line.level, line.msg, line.ts) == ("w1", "INFO", "h\u00e9", 12.5)
    bad_ts = LogEntry.from_fields({b"worker": b"w2", b"msg": b"m", b"ts": b"not-a-time"})
    assert (bad_ts.worker, bad_ts.msg, bad_ts.ts) == ("w2", "m", 0.0)
    assert format_log(bad_ts).startswith("--:--:-- w2")
    d = ControlEntry.from_fields({"ts_ms": "0", "generation": "x", "kind": "join", "job_state": "running", "reason": "r"})
    assert (d.generation, d.kind, d.reason) == (0, "join", "r")
    assert format_decision(d).endswith("gen   0 running   [join] r")
    assert ControlEntry.from_fields({}) == ControlEntry()


def test_error_details_are_one_printable_line() -> None:
    assert one_line(ValueError("first\nsecond")) == "first"
    assert one_line("a\x1b[31mred") == "a\\x1b[31mred"
    assert len(one_line("x" * 5000)) == MAX_DETAIL


def test_sse_framing() -> None:
    assert event("log", {"msg": "a\nb"}, "1-0") == 'id: 1-0\nevent: log\ndata: {"msg":"a\\nb"}\n\n'
    assert event("end", {"state": "completed"}) == 'event: end\ndata: {"state":"completed"}\n\n'
