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

How: one pipeline on one connection, the commands that matter, a marker write, then ``WAIT n
timeout`` (:func:`execute_confirmed`). Replication is one ordered stream, so the replica's
acknowledgement of the marker covers every write the primary applied before it, the
pipeline's own among them; and a value the pipeline read was on that primary, so it is held
by a replica too: a read that decides something (a generation table adopted, a LATEST pointer
resumed from, a coordinator's state after a takeover) is confirmed the same way. With no replicas to wait for (:func:`~shoal.core.connection.replicas_to_wait`: 0
unless the client came from a ``redis+sentinel://`` URL, or ``SHOAL_REDIS_WAIT_REPLICAS``
says otherwise) nothing is sent.
"""

from __future__ import annotations

import time

import redis
import redis.client

from shoal.events import envvars
from shoal.events.keys import DURABLE_MARKER, DURABLE_MARKER_TTL_MS
from shoal.core.connection import replicas_to_wait

#: how long a durable write waits for its replica (ms); the commit fence uses its own bound
WAIT_MS = int(envvars.REDIS_WAIT_MS.get())


class NotReplicated(redis.ConnectionError):
    """The server acknowledged a write that no replica confirmed in time: it may be lost in a
    fail-over (or the server is a cut-off primary). Handled as an outage."""


def confirm(client: redis.Redis, what: str, *, timeout_ms: int | None = None) -> None:
    """Return once ``replicas_to_wait(client)`` replicas hold every write made so far; raise
    NotReplicated naming ``what`` otherwise (after ``timeout_ms``, default :data:`WAIT_MS`).
    Only for a write made on ``client`` by an earlier call that has returned, where it does
    not matter on which server the confirmation runs; for a write or a read whose result
    matters, put the command and its confirmation in one pipeline: :func:`execute_confirmed`."""
    execute_confirmed(client, client.pipeline(transaction=False), what, timeout_ms=timeout_ms)


def execute_confirmed(client: redis.Redis, pipe: redis.client.Pipeline, what: str, *,
                      timeout_ms: int | None = None) -> list:
    """Execute ``pipe`` (its commands queued, not run) followed by the confirmation (a marker
    write, ``WAIT``) on the same connection; return the results of the queued commands.

    One connection makes the confirmation cover what those commands wrote and read, on the
    server they ran on. Confirmed separately, a fail-over between the two could let a
    confirmation from the new primary vouch for a write or a read made on the old one: a
    client that reconnected after the old primary was demoted, or that read a cut-off
    primary's table and then confirmed on the promoted replica. A demoted primary refuses the
    marker (READONLY); a cut-off one answers ``WAIT`` with 0: NotReplicated, naming ``what``.
    A client that retries re-runs the whole pipeline, commands included, on whichever server
    it reaches: the confirmation then covers that run."""
    need = replicas_to_wait(client)
    if need > 0:
        wait = WAIT_MS if timeout_ms is None else timeout_ms
        pipe.set(DURABLE_MARKER, str(time.time()), px=DURABLE_MARKER_TTL_MS)
        pipe.execute_command("WAIT", need, wait)
    results = pipe.execute(raise_on_error=False)
    for result in results:  # the first error, as the server said it (not re-worded by the pipeline)
        if isinstance(result, Exception):
            raise result
    if need <= 0:
        return results
    got = int(results[-1])
    if got < need:
        raise NotReplicated(f"{what}: {got} of {need} replica(s) confirmed it within {wait} ms "
                            f"(it may be lost in a fail-over; handled as a failed write)")
    return results[:-2]
