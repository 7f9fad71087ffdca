"""The stream bus: publishing events and consuming them through a consumer group.

Delivery is at-least-once: an entry stays in the group's pending list until acknowledged,
and a replacement consumer takes over a dead one's pending entries with XAUTOCLAIM.
Consumers must therefore acknowledge and dead-letter in the same atomic write as their
state change (the coordinator does both inside its fenced script; ``XACK`` itself is not
owner-checked): then an entry still pending was never applied, whatever its id - a
reclaimed entry can be older than one its new owner already applied.

Capping never drops unacknowledged entries: :func:`safe_trim_id` computes the oldest id
still needed (pending or undelivered) and producers never pass ``maxlen`` on the event
stream; only informational streams (control log, dead letters) are approximately capped.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from shoal.events.keys import COORDINATOR_GROUP
from shoal.events.models import EventBase, encode_event

Entry = tuple[str, dict[bytes, bytes]]


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def publish(client: redis.Redis, stream: str, event: EventBase) -> str:
    """Append ``event`` to ``stream``; returns the entry id. Redis errors propagate."""
    return _s(client.xadd(stream, encode_event(event)))


def ensure_group(client: redis.Redis, stream: str, group: str = COORDINATOR_GROUP) -> None:
    """Create the consumer group (and the stream) if missing, reading from the beginning."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def read_new(
    client: redis.Redis, streams: list[str], consumer: str, *, count: int, block_ms: int | None, group: str = COORDINATOR_GROUP
) -> dict[str, list[Entry]]:
    """New entries (never delivered before) per stream; blocks at most ``block_ms``."""
    if not streams:
        return {}
    resp = client.xreadgroup(group, consumer, {s: ">" for s in streams}, count=count, block=block_ms)
    return _by_stream(resp)


def read_own_pending(
    client: redis.Redis, stream: str, consumer: str, *, count: int, group: str = COORDINATOR_GROUP
) -> list[Entry]:
    """Entries delivered to ``consumer`` but not yet acknowledged (to retry them)."""
    resp = client.xreadgroup(group, consumer, {stream: "0"}, count=count)
    return _by_stream(resp).get(stream, [])


def reclaim(
    client: redis.Redis, stream: str, consumer: str, *, min_idle_ms: int = 0, count: int = 100, group: str = COORDINATOR_GROUP
) -> list[Entry]:
    """Take over every pending entry idle for ``min_idle_ms`` (XAUTOCLAIM), oldest first.

    Entries that were deleted from the stream while pending come back with no fields; they
    are dropped from the pending list by Redis and not returned."""
    out: list[Entry] = []
    start = "0-0"
    while True:
        resp = client.xautoclaim(stream, group, consumer, min_idle_ms, start_id=start, count=count)
        next_id, entries = resp[0], resp[1]
        out.extend((_s(i), f) for i, f in entries if f is not None)
        if _s(next_id) == "0-0":
            return out
        start = _s(next_id)


@dataclass(frozen=True)
class GroupInfo:
    pending: int
    last_delivered: str
    oldest_pending: str | None


def group_info(client: redis.Redis, stream: str, group: str = COORDINATOR_GROUP) -> GroupInfo | None:
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return None
    for g in groups:
        if _s(g["name"]) == group:
            oldest = None
            if g["pending"]:
                summary = client.xpending(stream, group)
                oldest = _s(summary["min"]) if summary.get("min") else None
            return GroupInfo(pending=int(g["pending"]), last_delivered=_s(g["last-delivered-id"]), oldest_pending=oldest)
    return None


def id_lt(a: str, b: str) -> bool:
    """Stream-id order (``ms-seq``)."""
    am, _, asq = a.partition("-")
    bm, _, bsq = b.partition("-")
    return (int(am), int(asq or 0)) < (int(bm), int(bsq or 0))


def id_max(a: str, b: str) -> str:
    """The later of two stream ids."""
    return b if id_lt(a, b) else a


def safe_trim_id(info: GroupInfo) -> str:
    """The MINID up to which the stream may be trimmed exactly: every entry before it was
    delivered and acknowledged. Undelivered entries come after ``last_delivered``."""
    if info.oldest_pending is not None:
        return info.oldest_pending
    return info.last_delivered


def dead_letter_fields(fields: dict, reason: str, source_id: str) -> dict[str, str]:
    """The dead-letter entry for an event: its original fields plus the reason and source id.
    Binary garbage is kept as a replacement-decoded string so it stays readable."""
    out: dict[str, str] = {}
    for k, v in fields.items():
        key = _s(k) if not isinstance(k, bytes) else k.decode("utf-8", "replace")
        val = v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
        out[f"orig_{key}"[:200]] = val[:4096]
    out["reason"] = reason
    out["source_id"] = source_id
    return out


def _by_stream(resp) -> dict[str, list[Entry]]:
    out: dict[str, list[Entry]] = {}
    for stream, entries in resp or []:
        out[_s(stream)] = [(_s(i), f) for i, f in entries if f is not None]
    return out
