"""Writes that must survive a Redis fail-over: confirmed by a replica before they count.

Redis replicates asynchronously: a primary that dies (or is cut off and later demoted) takes
with it the writes its replicas had not received, although it acknowledged them. Most of
shoal's writes can be lost that way and recovered (progress, logs, heartbeats: the next one
replaces it). A few cannot: a lease takeover and its epoch, a fenced write of the
coordinator (a generation's table, the job's state, the LATEST pointer), the commit fence's
beat, a job's registration. After each of those, :func:`confirm` waits for a replica to
acknowledge everything written so far (``WAIT``) and raises :class:`NotReplicated` when none
did in time: the write then counts as failed, and its writer handles it as it handles an
outage (the coordinator reloads its state and decides again; the worker does not commit).
``WAIT`` is not a transaction: a write it did not confirm may still be applied, so every
caller's retry is idempotent (a reload-and-decide, a compare-and-set).

How: one pipeline on one connection, a marker write then ``WAIT n timeout``. Replication is
one ordered stream, so the replica's acknowledgement of the marker covers every write the
primary applied before it, on whatever connection: the caller's write has returned, so it is
among them. With no replicas to wait for (:func:`~shoal.core.connection.replicas_to_wait`: 0
unless the client came from a ``redis+sentinel://`` URL, or ``SHOAL_REDIS_WAIT_REPLICAS``
says otherwise) nothing is sent.
"""

from __future__ import annotations

import os
import time

import redis

from shoal.core.connection import replicas_to_wait

#: how long a durable write waits for its replica (ms); the commit fence uses its own bound
WAIT_MS = int(os.environ.get("SHOAL_REDIS_WAIT_MS", "500"))
MARKER = "shoal:durable"


class NotReplicated(redis.ConnectionError):
    """The server acknowledged a write that no replica confirmed in time: it may be lost in a
    fail-over (or the server is a cut-off primary). Handled as an outage."""


def confirm(client: redis.Redis, what: str, *, timeout_ms: int | None = None) -> None:
    """Return once ``replicas_to_wait(client)`` replicas hold every write made so far; raise
    NotReplicated naming ``what`` otherwise (after ``timeout_ms``, default :data:`WAIT_MS`)."""
    need = replicas_to_wait(client)
    if need <= 0:
        return
    wait = WAIT_MS if timeout_ms is None else timeout_ms
    pipe = client.pipeline(transaction=False)
    pipe.set(MARKER, str(time.time()), px=60_000)
    pipe.execute_command("WAIT", need, wait)
    got = int(pipe.execute()[-1])
    if got < need:
        raise NotReplicated(f"{what}: {got} of {need} replica(s) confirmed it within {wait} ms "
                            f"(it may be lost in a fail-over; handled as a failed write)")
