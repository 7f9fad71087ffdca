"""What the operator tools do to jobs, shared by the CLI (``shoal stop``, ``purge``, ``delete``,
``submit``, ``create``) and the HTTP API (``shoal serve``): each function checks its input,
raises a :class:`~shoal.core.errors.ShoalError` subclass naming the problem (one line, nothing
written), and returns what it did as data; printing or answering is the caller's business.

Errors a caller may want to tell apart: :class:`NoSuchJob` (the job is not in this Redis),
:class:`~shoal.core.registry.JobExists` (a job of that name is registered), any other
:class:`~shoal.core.errors.ConfigError` (bad input).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from shoal.core.errors import ConfigError
from shoal.core.jobspec import JobSpec, parse_spec
from shoal.events.keys import JobKeys, job_keys
from shoal.events.states import TERMINAL_JOB_STATES, is_terminal


class NoSuchJob(ConfigError):
    """The job id names no job in this Redis (nor any trace of one)."""


def keys_of(job_id: str) -> JobKeys:
    """The key names of ``job_id``; ConfigError (one line) for an id that cannot be a job's."""
    try:
        return job_keys(job_id)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def require_job(client: redis.Redis, job_id: str, *traces: str) -> JobKeys:
    """The key names of an existing job: its spec exists, or (for a deleted spec) one of the
    keys named by ``traces`` (attribute names of :class:`JobKeys`, e.g. ``"control"``) does.
    NoSuchJob otherwise."""
    keys = keys_of(job_id)
    pipe = client.pipeline(transaction=False)
    pipe.exists(keys.spec)
    for name in traces:
        pipe.exists(getattr(keys, name))
    if not any(pipe.execute()):
        raise NoSuchJob(f"no job {job_id!r} in this Redis")
    return keys


def job_state(client: redis.Redis, keys: JobKeys) -> str:
    """The job's state (``pending`` before a coordinator wrote one)."""
    return (client.hget(keys.state, "state") or b"pending").decode()


@dataclass(frozen=True)
class StopOutcome:
    job_id: str
    #: the job's state when the stop was asked for
    was: str
    #: False: the job had already ended and nothing was sent
    requested: bool
    #: launch units of the job that no node had taken yet, removed from the queue
    dropped_units: int = 0


def stop_job(client: redis.Redis, job_id: str, reason: str = "stopped by operator") -> StopOutcome:
    """Ask the coordinator to stop ``job_id`` gracefully (a ``StopJob`` event; the workers see
    ``stopped`` and exit) and drop its launch units no node has taken. A job that already
    ended is left alone (``requested`` False). NoSuchJob when there is no such job."""
    from shoal.coordinator.launcher import cancel_queued, launch_queue
    from shoal.events import bus
    from shoal.events.models import StopJob

    if not reason.strip() or len(reason) > 1000:
        raise ConfigError("the stop reason must be 1 to 1000 characters")
    keys = require_job(client, job_id)
    state = job_state(client, keys)
    if is_terminal(state):
        return StopOutcome(job_id, state, requested=False)
    bus.publish(client, keys.events, StopJob(job_id=job_id, reason=reason))
    dropped = cancel_queued(launch_queue(client), job_id)
    return StopOutcome(job_id, state, requested=True, dropped_units=dropped)


@dataclass(frozen=True)
class PurgeOutcome:
    #: job id -> its (finished) state, of every job that matched
    targets: dict[str, str] = field(default_factory=dict)
    #: keys deleted (0 on a dry run)
    deleted_keys: int = 0
    dry_run: bool = True


def parse_purge_states(states: list[str]) -> list[str]:
    """The finished states a purge may name; ConfigError for anything else or none."""
    wanted = [s.strip() for s in states if s.strip()]
    bad = [s for s in wanted if not is_terminal(s)]
    if not wanted or bad:
        finished = ", ".join(sorted(TERMINAL_JOB_STATES))
        raise ConfigError(f"purge takes finished states only ({finished}), got {', '.join(states) or 'none'}")
    return wanted


def purge_jobs(client: redis.Redis, states: list[str], *, dry_run: bool,
               among: list[str] | None = None) -> PurgeOutcome:
    """Delete every key of each job in one of the finished ``states`` and drop its queued
    launch units (checkpoints are never touched); with ``dry_run`` only say which jobs that
    would be; with ``among``, only jobs named there (what a dry run showed someone). Waits for
    the jobs' coordinator leases to lapse (about a lease TTL, see
    :func:`shoal.core.registry.delete_jobs`)."""
    from shoal.coordinator.launcher import cancel_queued, launch_queue
    from shoal.core.registry import delete_jobs, job_states, list_jobs

    wanted = parse_purge_states(states)
    found = job_states(client, list_jobs(client))
    targets = {j: st for j, st in found.items() if st in wanted and (among is None or j in among)}
    if dry_run or not targets:
        return PurgeOutcome(targets, 0, dry_run)
    n = delete_jobs(client, list(targets))
    queue = launch_queue(client)
    for j in targets:
        cancel_queued(queue, j)
    return PurgeOutcome(targets, n, dry_run=False)


def delete_job(client: redis.Redis, job_id: str) -> int:
    """Remove every key of ``job_id`` (after its coordinator lease lapsed) and its queued
    launch units; returns the number of keys deleted. NoSuchJob when nothing of it exists."""
    from shoal.coordinator.launcher import cancel_queued, launch_queue
    from shoal.core.registry import delete_job as delete_keys

    require_job(client, job_id, "state", "control")
    n = delete_keys(client, job_id)
    cancel_queued(launch_queue(client), job_id)
    return n


def spec_from_request(fields: object) -> JobSpec:
    """A job spec sent over the HTTP API (the fields of the YAML file, as JSON), validated by
    the same model as ``shoal submit``'s; ConfigError naming the field otherwise. A
    ``working_dir`` is refused: the server cannot read the caller's files (``shoal submit``
    packs it on the caller's machine)."""
    spec = parse_spec(fields, "job spec")
    if spec.working_dir:
        raise ConfigError("job spec: working_dir: not supported over the HTTP API (the server cannot read your "
                          "files); submit a job with a working_dir with 'shoal submit'")
    return spec
