"""Launch units on the RQ queue: enqueueing them (``shoal submit``) and re-enqueueing them
when a queue-launched job lost its node agents (the coordinator process's launcher).

A *launch unit* is one RQ job on :data:`shoal.events.keys.LAUNCH_QUEUE` that calls
``shoal.launch.run_launch(job_id, workers)``: a node agent running ``workers`` worker
processes of the job on whichever node picked it up, until the job ends. Its RQ id
(:func:`shoal.events.keys.launch_unit_id`) names the job, so counting a job's units needs no
payload decoding. Payloads use RQ's JSON serializer and hold only the job id and the
worker count: no URL, no credential.

The launcher is not part of the fenced decision path: it reads job state like ``shoal
status`` does and only enqueues RQ work. :func:`launches_needed` is the pure rule; a
``SET NX PX`` on ``keys.relaunch`` makes one replica re-enqueue per job per cooldown, which
also bounds how fast a job whose workers keep crashing can be relaunched.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Iterable

import redis
from rq import Queue
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from shoal.coordinator.persist import load_state
from shoal.coordinator.states import CoordState
from shoal.events.states import PLANNED, JobState, is_terminal
from shoal.events.keys import JOBS, LAUNCH_QUEUE, job_keys, job_of_launch_unit, launch_unit_id
from shoal.events.keys import LAUNCH_UNIT_RESULT_TTL_S as RESULT_TTL
from shoal.events.models import LaunchSettings
from shoal.core.jobspec import JobSpec

log = logging.getLogger("shoal.launcher")

#: The RQ function of a launch unit (a string: enqueueing imports nothing of the node side).
LAUNCH_FUNC = "shoal.launch.run_launch"
#: RQ's "no timeout": a launch unit runs as long as the job trains (RQ's default is 180 s).
NO_TIMEOUT = -1
#: States in which a job wants workers (re-enqueue applies to these only).
WANTS_WORKERS = frozenset({JobState.RUNNING, JobState.PAUSED})
_WANTING_NAMES = frozenset(s.value for s in WANTS_WORKERS)


def launch_queue(client: redis.Redis) -> Queue:
    return Queue(LAUNCH_QUEUE, connection=client, serializer=JSONSerializer)


def unit_sizes(total: int, per_unit: int) -> list[int]:
    """Worker counts of the launch units covering ``total`` workers, ``per_unit`` each
    (the last one smaller): ``unit_sizes(5, 2) == [2, 2, 1]``."""
    if per_unit < 1:
        raise ValueError("per_unit must be >= 1")
    if total <= 0:
        return []
    full, rest = divmod(total, per_unit)
    return [per_unit] * full + ([rest] if rest else [])


def launches_needed(state: CoordState, spec: JobSpec, queued: int, *, workers_per_unit: int = 1) -> int:
    """How many launch units to enqueue for a job (pure).

    Only a running or paused job with fewer live (Syncing or Active) workers than
    ``max_workers`` and no launch unit queued or running (``queued`` == 0) gets any: as many
    units of ``workers_per_unit`` as cover the missing workers. Anything queued or running
    may still bring workers, so nothing more is asked for until it is gone.
    """
    if state.status.state not in WANTS_WORKERS or queued > 0:
        return 0
    missing = spec.max_workers - len(state.in_state(PLANNED))
    return len(unit_sizes(missing, max(1, workers_per_unit)))


def enqueue_units(queue: Queue, job_id: str, sizes: Iterable[int], *, pipeline=None) -> list[str]:
    """Enqueue one launch unit per entry of ``sizes``; returns their RQ ids. With
    ``pipeline`` the writes join the caller's transaction (nothing is sent yet)."""
    ids = []
    for n in sizes:
        rq_id = launch_unit_id(job_id, uuid.uuid4().hex[:12])
        queue.enqueue_call(
            LAUNCH_FUNC, args=(job_id, int(n)), timeout=NO_TIMEOUT, result_ttl=RESULT_TTL,
            failure_ttl=RESULT_TTL, job_id=rq_id, description=f"launch {n} worker(s) of job {job_id}",
            pipeline=pipeline,
        )
        ids.append(rq_id)
    return ids


def count_launches(queue: Queue) -> Counter:
    """Launch units per job id that are queued or running (RQ's queue, its intermediate
    queue of units a worker is taking, and the started registry; a unit whose node vanished
    stays "running" until RQ's heartbeat for it expires)."""
    ids = list(queue.get_job_ids())
    ids += queue.intermediate_queue.get_job_ids()
    ids += StartedJobRegistry(queue=queue).get_job_ids()
    counts: Counter = Counter()
    for rq_id in ids:
        job_id = job_of_launch_unit(rq_id)
        if job_id is not None:
            counts[job_id] += 1
    return counts


def cancel_queued(queue: Queue, job_id: str) -> int:
    """Remove the job's launch units that no node picked up yet; returns how many."""
    n = 0
    for rq_id in queue.get_job_ids():
        # LREM first: a unit a node popped meanwhile is running and is left alone
        if job_of_launch_unit(rq_id) == job_id and queue.remove(rq_id):
            n += 1
            job = queue.fetch_job(rq_id)
            if job is not None:
                job.delete(remove_from_queue=False)
    return n


class Launcher:
    """Re-enqueues launch units of queue-launched jobs that lost agents; drops queued units
    of jobs that ended. Call :meth:`run_once` every few seconds from any thread (it uses
    only its client)."""

    def __init__(self, client: redis.Redis, *, instance_id: str = "launcher", cooldown: float = 30.0):
        self.client = client
        self.instance_id = instance_id
        self.cooldown_ms = max(1, int(cooldown * 1000))
        self.queue = launch_queue(client)

    def run_once(self) -> dict[str, int]:
        """One pass over every queue-launched job; returns {job id: units enqueued}."""
        job_ids = sorted(j.decode() for j in self.client.smembers(JOBS))
        managed = []
        pipe = self.client.pipeline(transaction=False)
        for jid in job_ids:
            try:
                keys = job_keys(jid)
            except ValueError:
                continue
            managed.append(keys)
            pipe.hgetall(keys.launch)
            pipe.hget(keys.state, "state")
        replies = pipe.execute() if managed else []
        todo = []
        for keys, launch, state in zip(managed, replies[0::2], replies[1::2]):
            if launch:
                try:
                    per_unit = max(1, LaunchSettings.from_hash(launch).workers)
                except ValueError:
                    per_unit = 1
                todo.append((keys, per_unit, state.decode() if state else JobState.PENDING.value))
        if not todo:
            return {}
        counts = count_launches(self.queue)
        done: dict[str, int] = {}
        for keys, per_unit, state in todo:
            jid = keys.job_id
            if is_terminal(state):
                if counts[jid]:
                    n = cancel_queued(self.queue, jid)
                    if n:
                        log.info("job %s is %s: dropped %d queued launch unit(s)", jid, state, n)
                continue
            if state not in _WANTING_NAMES or counts[jid]:
                continue
            raw = self.client.get(keys.spec)
            if raw is None:
                continue
            try:
                spec = JobSpec.from_stored(raw)
            except ValueError:
                continue
            cs = load_state(self.client, keys)
            n = launches_needed(cs, spec, counts[jid], workers_per_unit=per_unit)
            if not n:
                continue
            if not self.client.set(keys.relaunch, self.instance_id, nx=True, px=self.cooldown_ms):
                continue  # another replica (or we, recently) re-enqueued this job
            missing = spec.max_workers - len(cs.in_state(PLANNED))
            sizes = unit_sizes(missing, per_unit)[:n]
            ids = enqueue_units(self.queue, jid, sizes)
            done[jid] = len(ids)
            log.warning("job %s (%s) has %d of %d workers and no launch unit queued or running: "
                        "enqueued %d unit(s) %s", jid, state, spec.max_workers - missing, spec.max_workers,
                        len(ids), sizes)
        return done
