"""``shoal submit``: validate a job spec, register the job and queue its launch units.

Everything Redis sees happens in one MULTI/EXEC transaction (spec, registry entry, launch
settings and every RQ launch unit), so a failure leaves no half-submitted job. The spec is
validated before any connection is made. RQ payloads carry the job id and a worker count
only: connection settings and credentials come from each node's environment.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from shoal.coordinator.launcher import enqueue_units, launch_queue, unit_sizes
from shoal.events.keys import job_keys
from shoal.core.registry import create_job
from shoal.core.jobspec import JobSpec


@dataclass(frozen=True)
class Submitted:
    job_id: str
    unit_ids: list[str]
    sizes: list[int]


def submit(client: redis.Redis, spec: JobSpec, *, workers_per_unit: int = 1) -> Submitted:
    """Register ``spec`` and enqueue launch units covering ``max_workers`` workers,
    ``workers_per_unit`` each (one node agent per unit). Raises ConfigError when the job
    exists; nothing is written then."""
    if workers_per_unit < 1:
        raise ValueError("workers_per_unit must be >= 1")
    per_unit = min(workers_per_unit, spec.max_workers)
    sizes = unit_sizes(spec.max_workers, per_unit)
    queue = launch_queue(client)
    queue.get_redis_server_version()  # RQ asks the server once; do it outside the transaction
    keys = job_keys(spec.name)
    ids: list[str] = []

    def also(pipe) -> None:
        pipe.hset(keys.launch, mapping={"workers": per_unit, "units": len(sizes)})
        ids.extend(enqueue_units(queue, spec.name, sizes, pipeline=pipe))

    create_job(client, spec, also=also)
    return Submitted(spec.name, ids, sizes)


def check_runnable(spec: JobSpec) -> None:
    """What can be checked on the submitting machine before a job is accepted, calling no
    user code: the entrypoint imports and names a function callable without arguments, and
    an ``s3://`` checkpoint or data URI has its S3 settings (``S3_ENDPOINT``,
    ``S3_ACCESS_KEY``, ``S3_SECRET_KEY`` or ``S3_CREDENTIALS_FILE``). ConfigError, one line
    naming the problem and ``--no-validate`` (for a job whose code or settings exist only on
    the worker nodes)."""
    from shoal.core.errors import ConfigError
    from shoal.storage.errors import StorageConfigError
    from shoal.storage.s3_config import S3Config
    from shoal.worker.errors import EntrypointError
    from shoal.worker.userapi import resolve_entrypoint

    skip = "; pass --no-validate if only the worker nodes have it"
    if spec.entrypoint != "simulate":
        try:
            resolve_entrypoint(spec.entrypoint)
        except EntrypointError as exc:
            raise ConfigError(f"{exc}{skip}") from None
    for field in ("checkpoint_uri", "data_uri"):
        uri = getattr(spec, field)
        if uri and uri.startswith("s3://"):
            try:
                S3Config.from_env()
            except StorageConfigError as exc:
                raise ConfigError(f"{field} {uri}: {exc}{skip}") from None
