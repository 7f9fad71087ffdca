"""Registering and removing jobs (the submit side; never the coordinator's fenced state)."""

from __future__ import annotations

import redis

from events.keys import JOBS, job_keys
from shoal.errors import ConfigError
from shoal.jobspec import JobSpec


def create_job(client: redis.Redis, spec: JobSpec) -> str:
    """Store the spec and register the job; a coordinator picks it up on its next lease
    refresh. Raises ConfigError if a job of that name already exists."""
    keys = job_keys(spec.name)
    if not client.set(keys.spec, spec.to_json(), nx=True):
        raise ConfigError(f"job {spec.name!r} already exists (use 'shoal delete {spec.name}' first)")
    client.sadd(JOBS, spec.name)
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
