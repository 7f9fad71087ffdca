"""Server-Sent Events from a followed stream (:func:`shoal.ops.streams.follow`).

Each entry is one event: ``id:`` its stream entry id (so a reconnecting ``EventSource`` resumes
after it with ``Last-Event-ID``), ``event:`` its kind (``log``, ``decision``), ``data:`` one
line of JSON. A comment line every :data:`KEEPALIVE_S` seconds keeps proxies from closing an
idle stream. When the job has ended (and, for logs, its workers went quiet) the stream sends
``event: end`` with the job's state and closes. When Redis fails under a stream, it sends
``event: unavailable`` with the reason and closes; the browser reconnects and resumes.

The blocking Redis reads run in worker threads of their own (at most :data:`MAX_STREAMS` open
streams per server process), so open streams never starve the
threads of ordinary requests; a stream asked for beyond that gets 503.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import redis
import anyio.to_thread
from fastapi import HTTPException
from fastapi.responses import StreamingResponse

from shoal.ops.api.errors import one_line

#: Open event streams per server process.
MAX_STREAMS = 64
#: Seconds between keep-alive comments on an idle stream.
KEEPALIVE_S = 15.0
#: What a browser waits before reconnecting a dropped stream, ms.
RETRY_MS = 3000

#: The threads the streams' blocking reads run in: one at a time per stream.
_THREADS = anyio.CapacityLimiter(MAX_STREAMS)
_open = 0  # streams open now (changed on the event loop only)


def event(kind: str, data: dict, sid: str | None = None) -> str:
    """One event in the wire format (JSON data on one line)."""
    head = f"id: {sid}\n" if sid else ""
    return f"{head}event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def response(backlog: list[str], ticks: Iterator[list[str]], final: Callable[[], dict]) -> StreamingResponse:
    """A ``text/event-stream`` response: the ``backlog`` events, then each batch ``ticks``
    yields (an empty batch is a tick of about a second), then ``event: end`` with ``final()``
    once ``ticks`` is exhausted. 503 when :data:`MAX_STREAMS` streams are open already."""
    if _open >= MAX_STREAMS:
        raise HTTPException(503, f"too many open event streams on this server (at most {MAX_STREAMS}); try later")

    async def body() -> AsyncIterator[str]:
        global _open
        _open += 1
        try:
            yield f"retry: {RETRY_MS}\n\n"
            for item in backlog:
                yield item
            idle = 0.0
            done = object()
            try:
                while True:
                    batch = await anyio.to_thread.run_sync(next, ticks, done, limiter=_THREADS)
                    if batch is done:
                        break
                    if batch:
                        idle = 0.0
                        yield "".join(batch)
                    else:
                        idle += 1.0
                        if idle >= KEEPALIVE_S:
                            idle = 0.0
                            yield ": keep-alive\n\n"
                ended = await anyio.to_thread.run_sync(final, limiter=_THREADS)
            except redis.RedisError as exc:  # the client reconnects (retry:) and resumes after the last id
                yield event("unavailable", {"detail": f"Redis unavailable: {one_line(exc)}"})
                return
            yield event("end", ended)
        finally:
            _open -= 1
            close = getattr(ticks, "close", None)
            if close is not None:
                try:
                    close()
                except ValueError:  # still running in its thread (cancelled): it ends within a tick
                    pass

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
