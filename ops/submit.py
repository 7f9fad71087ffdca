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
