"""Registering and removing jobs (the submit side; never the coordinator's fenced state)."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis
from redis.client import Pipeline

from shoal.events.keys import JOBS, job_keys
from shoal.core.connection import replicas_to_wait
from shoal.core.durable import NotReplicated, execute_confirmed
from shoal.core.errors import ConfigError, ShoalError
from shoal.core.jobspec import JobSpec


class JobExists(ConfigError):
    """A job of that name is already registered; nothing was written."""


def create_job(client: redis.Redis, spec: JobSpec, *, also: Callable[[Pipeline], None] | None = None) -> str:
    """Store the spec and register the job; a coordinator picks it up on its next lease
    refresh. Raises JobExists (a ConfigError) if a job of that name already exists.

    ``also(pipe)`` adds more writes (e.g. ``shoal submit``'s launch units) to the same
    MULTI/EXEC transaction: either the job is registered with all of them, or nothing is
    written (WATCH on the spec key makes a concurrent create of the same name lose). Under
    Sentinel it returns once a replica holds the registration (NotReplicated otherwise)."""
    keys = job_keys(spec.name)
    exists = JobExists(f"job {spec.name!r} already exists (use 'shoal delete {spec.name}' first)")
    if also is None:
        if not client.set(keys.spec, spec.to_json(), nx=True):
            raise exists
        client.sadd(JOBS, spec.name)
        _confirm_registered(client, spec)
        return spec.name
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(keys.spec)
            if pipe.exists(keys.spec):
                raise exists
            pipe.multi()
            pipe.set(keys.spec, spec.to_json())
            pipe.sadd(JOBS, spec.name)
            also(pipe)
            pipe.execute()
        except redis.WatchError:
            raise exists from None
    _confirm_registered(client, spec)
    return spec.name


def _confirm_registered(client: redis.Redis, spec: JobSpec) -> None:
    """Under Sentinel: read the registration back with its confirmation on one connection
    (:func:`~shoal.core.durable.execute_confirmed`). A confirmation sent apart from the writes
    could run on a replica promoted in between and vouch for a registration only the old
    primary saw; the read shows whether the server that confirms holds it. NotReplicated
    when no replica confirmed it or it is gone (lost in a fail-over: submit it again)."""
    if replicas_to_wait(client) <= 0:
        return
    keys = job_keys(spec.name)
    what = f"registration of job {spec.name}"
    stored, listed = execute_confirmed(client, client.pipeline(transaction=False).get(keys.spec)
                                       .sismember(JOBS, spec.name), what)
    if stored is None or not listed or JobSpec.from_stored(stored) != spec:
        raise NotReplicated(f"{what}: not on the primary that confirmed it (lost in a Redis fail-over); submit it again")


def delete_job(client: redis.Redis, job_id: str, *, batch: int = 500, lease_wait: float = 30.0) -> int:
    """Remove every key of the job and unregister it. Returns the number of keys deleted.
    See :func:`delete_jobs` (this waits for the job's coordinator lease to lapse first)."""
    return delete_jobs(client, [job_id], batch=batch, lease_wait=lease_wait)


def delete_jobs(client: redis.Redis, job_ids: list[str], *, batch: int = 500, lease_wait: float = 30.0) -> int:
    """Unregister the jobs, wait until no coordinator leads them, then delete their keys.

    A coordinator leading a job reads its event stream through a consumer group, so the
    keys must not vanish under it: once a job is out of the registry no replica renews its
    lease, and the lease (a PX key) lapses within the lease TTL; only then are the keys
    deleted. If a lease is still there after ``lease_wait`` s (someone registered the job
    again), the jobs are registered again and nothing is deleted (ShoalError). Returns the
    number of keys deleted."""
    if not job_ids:
        return 0
    keys = [job_keys(j) for j in job_ids]
    client.srem(JOBS, *job_ids)
    deadline = time.monotonic() + lease_wait
    while True:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k.lease)
        if not any(pipe.execute()):
            break
        if time.monotonic() >= deadline:
            client.sadd(JOBS, *job_ids)
            raise ShoalError(f"a coordinator still leads {', '.join(job_ids)} after {lease_wait:g} s; nothing deleted")
        time.sleep(0.1)
    n = 0
    for k in keys:
        for pattern in k.all_patterns():
            chunk = []
            for key in client.scan_iter(match=pattern, count=batch):
                chunk.append(key)
                if len(chunk) >= batch:
                    n += client.delete(*chunk)
                    chunk = []
            if chunk:
                n += client.delete(*chunk)
    return n


def list_jobs(client: redis.Redis) -> list[str]:
    return sorted(j.decode() for j in client.smembers(JOBS))


def job_states(client: redis.Redis, job_ids: list[str]) -> dict[str, str]:
    """Each job's state (``pending`` when the coordinator has not written one yet)."""
    pipe = client.pipeline(transaction=False)
    for jid in job_ids:
        pipe.hget(job_keys(jid).state, "state")
    return {jid: (v.decode() if v else "pending") for jid, v in zip(job_ids, pipe.execute() if job_ids else [])}
