"""Registering and removing jobs (the submit side; never the coordinator's fenced state)."""

from __future__ import annotations

from collections.abc import Callable

import redis
from redis.client import Pipeline

from events.keys import JOBS, job_keys
from shoal.errors import ConfigError
from shoal.jobspec import JobSpec


def create_job(client: redis.Redis, spec: JobSpec, *, also: Callable[[Pipeline], None] | None = None) -> str:
    """Store the spec and register the job; a coordinator picks it up on its next lease
    refresh. Raises ConfigError if a job of that name already exists.

    ``also(pipe)`` adds more writes (e.g. ``shoal submit``'s launch units) to the same
    MULTI/EXEC transaction: either the job is registered with all of them, or nothing is
    written (WATCH on the spec key makes a concurrent create of the same name lose)."""
    keys = job_keys(spec.name)
    exists = ConfigError(f"job {spec.name!r} already exists (use 'shoal delete {spec.name}' first)")
    if also is None:
        if not client.set(keys.spec, spec.to_json(), nx=True):
            raise exists
        client.sadd(JOBS, spec.name)
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
    return spec.name


def delete_job(client: redis.Redis, job_id: str, *, batch: int = 500) -> int:
    """Remove every key of the job and unregister it. Returns the number of keys deleted."""
    keys = job_keys(job_id)
    client.srem(JOBS, job_id)
    n = 0
    for pattern in keys.all_patterns():
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
