"""Reading a job's informational streams - the workers' log lines (``logs``) and the
coordinator's decisions (``control``) - for ``shoal logs``, ``shoal events`` and the HTTP
API's lists and Server-Sent Event streams. Every entry is read through its wire model
(:class:`~shoal.events.streams.LogEntry`, :class:`~shoal.events.streams.ControlEntry`). Read-only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TypeVar

import redis

from shoal.events.keys import JobKeys
from shoal.events.states import is_terminal
from shoal.events.streams import ControlEntry, LogEntry

M = TypeVar("M", LogEntry, ControlEntry)

#: Entries read per XRANGE page.
PAGE = 1000
#: Longest single blocking XREAD of a follower, ms: how long a follower may take to notice
#: that its caller wants it to stop, or that the job ended.
BLOCK_MS = 1000


def stream_id(text: str | None, default: str = "0-0") -> str:
    """A stream entry id given by a client (``1700000000000-0``, or ``1700000000000``);
    ``default`` for None or ""; ValueError for anything else."""
    if not text:
        return default
    ms, sep, seq = text.partition("-")
    if not ms.isdigit() or (sep and not seq.isdigit()) or len(text) > 41:
        raise ValueError(f"not a stream entry id: {text[:50]!r} (expected e.g. 1700000000000-0)")
    return text if sep else f"{ms}-0"


def read_range(client: redis.Redis, key: str, model: type[M], *, after: str = "0-0", until: str = "+",
               keep: Callable[[M], bool] | None = None, tail: int | None = None,
               limit: int | None = None) -> list[tuple[str, M]]:
    """``(entry id, entry)`` of the entries after id ``after`` up to id ``until`` (inclusive),
    oldest first, those ``keep`` accepts; with ``tail`` only the newest that many of them,
    with ``limit`` only the oldest that many (a page: the next one starts after the last id)."""
    out: deque | list = deque(maxlen=tail) if tail else []
    start = f"({after}" if after != "0-0" else "-"
    while True:
        entries = client.xrange(key, min=start, max=until, count=PAGE)
        for sid, fields in entries:
            entry = model.from_fields(fields)
            if keep is None or keep(entry):
                out.append((sid.decode(), entry))
                if limit is not None and not tail and len(out) >= limit:
                    return list(out)
        if len(entries) < PAGE:
            return list(out)
        start = "(" + entries[-1][0].decode()


def last_id(client: redis.Redis, key: str) -> str:
    """The id of the stream's newest entry ("0-0" when empty or absent)."""
    newest = client.xrevrange(key, count=1)
    return newest[0][0].decode() if newest else "0-0"


def _ended(client: redis.Redis, keys: JobKeys) -> bool:
    """The job ended, or was deleted (nothing more will be written for it)."""
    pipe = client.pipeline(transaction=False)
    pipe.hget(keys.state, "state")
    pipe.exists(keys.spec)
    state, spec = pipe.execute()
    return is_terminal(state) or not spec


def follow(client: redis.Redis, keys: JobKeys, key: str, model: type[M], *, after: str = "0-0",
           keep: Callable[[M], bool] | None = None, quiet_s: float = 0.0,
           block_ms: int = BLOCK_MS) -> Iterator[list[tuple[str, M]]]:
    """New entries of ``key`` (a stream of job ``keys``) after id ``after``, as they come: one
    list per blocking read of at most ``block_ms`` ms, empty when nothing came (a tick, so that
    a caller can send a keep-alive or notice it should stop). Ends once the job has ended (or
    was deleted) and the stream stayed quiet for ``quiet_s`` s after that: the job's last
    decision is the one that ended it (``quiet_s`` 0), while its workers may log a little
    longer (``shoal logs -f`` waits 2 s)."""
    quiet_since = time.monotonic()
    while True:
        ended = _ended(client, keys)  # before the read: whatever was written before the end is read below
        resp = client.xread({key: after}, count=500, block=block_ms)
        got: list[tuple[str, M]] = []
        for _stream, entries in resp or []:
            for sid, fields in entries:
                after = sid.decode()
                entry = model.from_fields(fields)
                if keep is None or keep(entry):
                    got.append((after, entry))
        if resp:
            quiet_since = time.monotonic()
        yield got
        if not resp and ended and time.monotonic() - quiet_since >= quiet_s:
            return


# ---- one entry as text (the CLI) and as JSON (the HTTP API) --------------------------------


def _clock(seconds: float) -> str:
    try:
        return time.strftime("%H:%M:%S", time.localtime(seconds))
    except (ValueError, OverflowError, OSError):
        return "--:--:--"


def format_log(line: LogEntry) -> str:
    """``12:00:01 w3       INFO    message`` (``shoal logs``)."""
    return f"{_clock(line.ts) if line.ts else '--:--:--'} {line.worker:<8} {line.level:<7} {line.msg}"


def format_decision(d: ControlEntry) -> str:
    """``12:00:01 gen   2 running   [exited] w1 failed: ...`` (``shoal events``)."""
    return f"{_clock(d.ts_ms / 1000)} gen {d.generation:>3} {d.job_state:<9} [{d.kind}] {d.reason}"


def log_json(sid: str, line: LogEntry) -> dict:
    return {"id": sid, **line.model_dump(mode="json")}


def decision_json(sid: str, d: ControlEntry) -> dict:
    return {"id": sid, **d.model_dump(mode="json")}
