"""The endpoints that change something: submit, stop, delete, purge. Each needs the API
token (:class:`shoal.ops.api.auth.TokenCheck`) and checks all of its input before it writes
anything; each is logged (what was done, never the token)."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from shoal.core.errors import ConfigError
from shoal.core.jobspec import MAX_WORKERS
from shoal.events.keys import LAUNCH_QUEUE
from shoal.ops.api.errors import COMMON, described
from shoal.ops.api.read_routes import Client
from shoal.ops.jobs import delete_job, purge_jobs, spec_from_request, stop_job

log = logging.getLogger("shoal.api")

#: Longest the entrypoint check of a submitted spec may take (a child process imports it).
CHECK_TIMEOUT_S = 120.0
SKIP_HINT = 'send "no_validate": true if only the worker nodes have it'


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SubmitRequest(_Request):
    """``shoal submit`` (or with ``queue`` false, ``shoal create``) over HTTP."""

    spec: dict[str, Any] = Field(description="the job spec: the fields of a job spec YAML file (core/jobspec.py); "
                                             "working_dir is not accepted over HTTP")
    workers: int | None = Field(None, ge=1, le=MAX_WORKERS,
                                description="worker processes per launch unit, i.e. per node agent (shoal submit "
                                            "--workers; default 1): max_workers / workers launch units are queued")
    units: int | None = Field(None, ge=1, le=MAX_WORKERS,
                              description="or: the number of launch units (node agents) to spread max_workers over")
    queue: bool = Field(True, description="queue launch units for 'shoal agent --queue' (false: only register "
                                          "the job, like shoal create)")
    no_validate: bool = Field(False, description="do not import the entrypoint or check S3 settings on the server")
    dry_build: bool = Field(False, description="also call the entrypoint (in a child process) and check what it "
                                               "returns")


class StopRequest(_Request):
    reason: str = Field("stopped by operator", min_length=1, max_length=1000,
                        description="recorded as the job's reason")


class PurgeRequest(_Request):
    states: list[str] = Field(min_length=1, max_length=3, description="finished states: completed, failed, stopped")
    dry_run: bool = Field(False, description="only list the jobs that would be deleted")


class Submitted(BaseModel):
    job_id: str
    #: False: registered only (``"queue": false``)
    queued: bool
    queue: str | None = None
    #: the RQ ids of the queued launch units
    unit_ids: list[str]
    #: worker processes of each unit
    workers_per_unit: list[int]


class Stopped(BaseModel):
    job_id: str
    #: the job's state when the stop was asked for
    was: str
    #: False: it had already ended, nothing was sent
    requested: bool
    #: launch units no node had taken, removed from the queue
    dropped_units: int


class Deleted(BaseModel):
    job_id: str
    deleted_keys: int


class Purged(BaseModel):
    #: job id -> its state, of every job purged (or, with ``dry_run``, that would be)
    jobs: dict[str, str]
    deleted_keys: int
    dry_run: bool


_ERRORS = {**COMMON, **described(_401="no token, or a wrong one", _403="the server is read-only")}


def routes(require_token) -> APIRouter:
    """The changing endpoints, each behind ``require_token``."""
    router = APIRouter(dependencies=[Depends(require_token)], responses=_ERRORS)

    @router.post("/jobs", status_code=201, summary="validate a job spec, register the job, queue its launch units",
                 responses=described(_409="a job of that name exists"))
    def submit_job(body: SubmitRequest, client: Client) -> Submitted:
        """The spec is validated by the same model and checks as ``shoal submit``; a bad one is
        refused (422, one line naming the field) before anything is written. 409 when a job of
        that name exists. Registering the job and queueing its launch units is one transaction."""
        from shoal.ops.submit import check_runnable, register, submit

        if body.no_validate and body.dry_build:
            raise ConfigError("dry_build and no_validate contradict each other")
        if body.workers is not None and body.units is not None:
            raise ConfigError("give workers (per launch unit) or units, not both")
        spec = spec_from_request(body.spec)
        per_unit = body.workers or (-(-spec.max_workers // body.units) if body.units else 1)
        if not body.no_validate:
            check_runnable(spec, build=body.dry_build, isolated=True, timeout=CHECK_TIMEOUT_S, skip_hint=SKIP_HINT)
        if not body.queue:
            register(client, spec)
            log.info("registered job %s (not queued)", spec.name)
            return Submitted(job_id=spec.name, queued=False, unit_ids=[], workers_per_unit=[])
        done = submit(client, spec, workers_per_unit=per_unit)
        log.info("registered job %s; %d launch unit(s) queued", spec.name, len(done.unit_ids))
        return Submitted(job_id=done.job_id, queued=True, queue=LAUNCH_QUEUE, unit_ids=done.unit_ids,
                         workers_per_unit=done.sizes)

    @router.post("/jobs/purge", summary="delete the keys of finished jobs (checkpoints stay)")
    def purge(body: PurgeRequest, client: Client) -> Purged:
        """Every job in one of ``states`` loses its Redis keys and queued launch units (its
        checkpoints are not touched). Waits for the jobs' coordinator leases to lapse (about
        a lease TTL). ``dry_run``: only list them."""
        done = purge_jobs(client, body.states, dry_run=body.dry_run)
        if not done.dry_run:
            log.info("purged %d job(s) (%s)", len(done.targets), ", ".join(done.targets))
        return Purged(jobs=done.targets, deleted_keys=done.deleted_keys, dry_run=done.dry_run)

    @router.post("/jobs/{job_id}/stop", summary="stop a job gracefully",
                 response_model=Stopped, responses={202: {"description": "stop requested", "model": Stopped},
                                                    200: {"description": "the job had ended"},
                                                    **described(_404="no such job")})
    def stop(job_id: str, client: Client, body: Annotated[StopRequest | None, Body()] = None) -> JSONResponse:
        """The workers see ``stopped`` and exit; queued launch units are dropped. 202 when the
        stop was requested, 200 when the job had already ended (nothing sent)."""
        done = stop_job(client, job_id, (body or StopRequest()).reason)
        if done.requested:
            log.info("stop requested for job %s (was %s)", job_id, done.was)
        out = Stopped(job_id=job_id, was=done.was, requested=done.requested, dropped_units=done.dropped_units)
        return JSONResponse(out.model_dump(), status_code=202 if done.requested else 200)

    @router.delete("/jobs/{job_id}", summary="remove every key of a job (checkpoints stay)",
                   responses=described(_404="no such job"))
    def delete(job_id: str, client: Client) -> Deleted:
        """Waits for the job's coordinator lease to lapse (about a lease TTL), then deletes its
        keys and queued launch units. A running job's workers then fail: stop it first."""
        n = delete_job(client, job_id)
        log.info("deleted job %s (%d keys)", job_id, n)
        return Deleted(job_id=job_id, deleted_keys=n)

    return router
