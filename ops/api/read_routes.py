"""The read-only endpoints: jobs, a job's status, summary, chart data, log lines and
decisions (as lists and as Server-Sent Event streams). None needs a token; none writes."""

from __future__ import annotations

from typing import Annotated

import redis
from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from shoal.core.connection import redact_url
from shoal.core.errors import ConfigError
from shoal.core.jobspec import JobSpec
from shoal.core.registry import list_jobs
from shoal.events.streams import ControlEntry, LogEntry
from shoal.ops.api import sse
from shoal.ops.api.charts import chart_page
from shoal.ops.api.errors import COMMON, described
from shoal.ops.jobs import job_state, require_job
from shoal.ops.status import job_status, job_summary, jobs_overview
from shoal.ops.streams import decision_json, follow, last_id, log_json, read_range, stream_id

router = APIRouter(responses=COMMON)
_404 = described(_404="no such job")
_SSE = {**_404, 200: {"description": "text/event-stream: one event per entry, then 'end'",
                      "content": {"text/event-stream": {"schema": {"type": "string"}}}}}

#: Most entries one list call returns (ask again after ``last_id`` for more).
MAX_PAGE = 10_000


def client_of(request: Request) -> redis.Redis:
    return request.app.state.client


Client = Annotated[redis.Redis, Depends(client_of)]
After = Annotated[str | None, Query(description="return entries after this stream entry id (e.g. 1700000000000-0)",
                                    max_length=41)]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description="at most this many entries")]


def _after(text: str | None) -> str:
    try:
        return stream_id(text)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def spec_view(raw: bytes | None) -> dict | None:
    """The stored spec as JSON, its URIs redacted (a spec never holds credentials, but one
    written by an older version might); None when it does not read as a spec."""
    if raw is None:
        return None
    try:
        spec = JobSpec.from_stored(raw).model_dump(mode="json")
    except (ValidationError, ValueError):
        return None
    for field in ("checkpoint_uri", "data_uri"):
        if spec.get(field):
            spec[field] = redact_url(spec[field])
    return spec


@router.get("/jobs", summary="every registered job, one line each")
def jobs(client: Client) -> dict:
    """Job id, state, generation, world size, step, total steps, percent, steps/s, reason and
    the number of Active workers of every registered job."""
    return {"jobs": jobs_overview(client)}


@router.get("/jobs/summaries", summary="every registered job's summary")
def summaries(client: Client) -> dict:
    """What ``GET /jobs/{id}/summary`` returns, for every registered job."""
    return {"jobs": [job_summary(client, j) for j in list_jobs(client)]}


@router.get("/jobs/{job_id}", responses=_404, summary="a job's status (shoal status --json) and its spec")
def job(job_id: str, client: Client) -> dict:
    """State, progress (step, total, epoch, percent, steps/s, ETA), generation, world size,
    reason, first failure, the leading coordinator replica (its name only), and per worker:
    state, rank, step, loss, heartbeat age, straggler flag, digest, host, pid, ranges; plus
    the job's spec."""
    keys = require_job(client, job_id)
    out = job_status(client, job_id)
    out["spec"] = spec_view(client.get(keys.spec))
    return out


@router.get("/jobs/{job_id}/summary", responses=_404, summary="a job's summary (what its launch units return)")
def summary(job_id: str, client: Client) -> dict:
    """State, reason, generation, steps, steps redone, the completion summary rank 0 reported
    and the newest evaluation."""
    require_job(client, job_id, "state")
    return job_summary(client, job_id)


@router.get("/jobs/{job_id}/progress", responses=_404, summary="chart data: committed steps and membership marks")
def progress(request: Request, job_id: str, client: Client, after: After = None,
             limit: Limit = 5000) -> dict:
    """Committed-step points after ``after`` as columns (``t_ms`` Redis server time, step,
    loss, generation, world size), the evaluations among them, and every membership mark
    (start, join, failure, leave, pause, end: ``shoal report``'s vertical lines). Poll again
    with ``after`` = ``last_id``; ``more`` is true while the stream goes on."""
    keys = require_job(client, job_id, "progress", "control")
    return chart_page(client, keys, request.app.state.marks, after=_after(after), limit=limit)


@router.get("/jobs/{job_id}/logs", responses=_404, summary="the workers' log lines (shoal logs)")
def logs(job_id: str, client: Client, worker: Annotated[str | None, Query(max_length=64)] = None,
         tail: Annotated[int | None, Query(ge=1, le=MAX_PAGE)] = None, after: After = None,
         limit: Limit = 1000) -> dict:
    """Log lines (``id``, ``ts``, ``worker``, ``level``, ``msg``), oldest first: the last
    ``tail`` ones, or the first ``limit`` after ``after``; only ``worker``'s when given."""
    keys = require_job(client, job_id, "logs")
    keep = (lambda line: line.worker == worker) if worker else None
    newest = last_id(client, keys.logs)
    got = read_range(client, keys.logs, LogEntry, after=_after(after), until=newest, keep=keep, tail=tail,
                     limit=None if tail else limit)
    return {"lines": [log_json(sid, line) for sid, line in got], "last_id": got[-1][0] if got else _after(after)}


@router.get("/jobs/{job_id}/events", responses=_404,
            summary="the coordinator's decisions with their reasons (shoal events)")
def events(job_id: str, client: Client, after: After = None, limit: Limit = 1000) -> dict:
    """Decisions (``id``, ``ts_ms``, ``epoch``, ``kind``, ``source_id``, ``job_state``,
    ``generation``, ``reason``), oldest first, the first ``limit`` after ``after``."""
    keys = require_job(client, job_id, "control")
    got = read_range(client, keys.control, ControlEntry, after=_after(after), limit=limit)
    return {"decisions": [decision_json(sid, d) for sid, d in got], "last_id": got[-1][0] if got else _after(after)}


def _stream(client: redis.Redis, keys, key: str, model, to_json, kind: str, *, resume: str | None,
            tail: int, keep=None, quiet_s: float = 0.0):
    """An SSE response: the last ``tail`` entries (none when resuming after ``resume``, a
    reconnecting browser's Last-Event-ID), then new ones as they come, until the job ended."""
    if resume:
        start, backlog = _after(resume), []
    else:
        start = last_id(client, key)
        backlog = [sse.event(kind, to_json(sid, e), sid)
                   for sid, e in read_range(client, key, model, until=start, keep=keep, tail=tail)] if tail else []
    ticks = ([sse.event(kind, to_json(sid, e), sid) for sid, e in batch]
             for batch in follow(client, keys, key, model, after=start, keep=keep, quiet_s=quiet_s))
    return sse.response(backlog, ticks, lambda: {"job_id": keys.job_id, "state": job_state(client, keys)})


LastEventId = Annotated[str | None, Header(alias="Last-Event-ID", max_length=41,
                                           description="resume after this entry (sent by a reconnecting EventSource)")]


@router.get("/jobs/{job_id}/logs/stream", responses=_SSE, response_class=StreamingResponse,
            summary="log lines as Server-Sent Events, live")
def logs_stream(job_id: str, client: Client, worker: Annotated[str | None, Query(max_length=64)] = None,
                tail: Annotated[int, Query(ge=0, le=MAX_PAGE)] = 200, last_event_id: LastEventId = None):
    """``event: log`` per line (data: the line as in ``GET /jobs/{id}/logs``, ``id:`` its entry
    id), starting with the last ``tail`` lines; ``event: end`` (data: the job's state) once the
    job ended and its workers were quiet for 2 s."""
    keys = require_job(client, job_id, "logs")
    keep = (lambda line: line.worker == worker) if worker else None
    return _stream(client, keys, keys.logs, LogEntry, log_json, "log", resume=last_event_id, tail=tail, keep=keep,
                   quiet_s=2.0)


@router.get("/jobs/{job_id}/events/stream", responses=_SSE, response_class=StreamingResponse,
            summary="decisions as Server-Sent Events, live")
def events_stream(job_id: str, client: Client, tail: Annotated[int, Query(ge=0, le=MAX_PAGE)] = 1000,
                  last_event_id: LastEventId = None):
    """``event: decision`` per coordinator decision (data: as in ``GET /jobs/{id}/events``),
    starting with the last ``tail``; ``event: end`` once the job ended."""
    keys = require_job(client, job_id, "control")
    return _stream(client, keys, keys.control, ControlEntry, decision_json, "decision", resume=last_event_id, tail=tail)
