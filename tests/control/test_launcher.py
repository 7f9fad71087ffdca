"""Launch units: the pure re-enqueue rule, RQ ids, ``submit``'s transaction and the
coordinator's Launcher against a real Redis (no RQ worker: nothing here runs a unit)."""

from __future__ import annotations

import json

import pytest
from rq.job import Job, validate_job_id
from rq.serializers import JSONSerializer

from shoal.coordinator.launcher import (
    NO_TIMEOUT,
    RESULT_TTL,
    Launcher,
    cancel_queued,
    count_launches,
    launches_needed,
    unit_sizes,
)
from shoal.coordinator.states import CoordState
from shoal.events.records import JobStatus, WorkerRecord
from shoal.events.states import JobState, WorkerState
from shoal.events.keys import JOBS, job_keys, job_of_launch_unit, launch_unit_id
from shoal.core.errors import ConfigError
from shoal.core.registry import delete_job
from shoal.core.jobspec import JobSpec
from shoal.ops.submit import submit


def _state(job: JobState, *workers: WorkerState) -> CoordState:
    recs = {f"w{i}": WorkerRecord(f"w{i}", s, joined_ms=0) for i, s in enumerate(workers)}
    return CoordState(status=JobStatus(state=job), workers=recs)


SPEC = JobSpec(name="j", entrypoint="simulate", min_workers=1, max_workers=4)
A, S, D, F, L = WorkerState.ACTIVE, WorkerState.SYNCING, WorkerState.DRAINING, WorkerState.FAILED, WorkerState.LEFT


@pytest.mark.parametrize(
    "state, queued, per_unit, want",
    [
        (_state(JobState.RUNNING, A, F, F, L), 0, 1, 3),  # only Syncing/Active count as live
        (_state(JobState.RUNNING, A, S, D), 0, 1, 2),  # a draining worker is on its way out
        (_state(JobState.PAUSED), 0, 1, 4),  # paused below min_workers: everything is missing
        (_state(JobState.PAUSED), 0, 3, 2),  # 4 missing, 3 per unit: units of 3 and 1
        (_state(JobState.RUNNING, A, F), 1, 1, 0),  # a unit is queued or running: wait for it
        (_state(JobState.RUNNING, A, A, A, A), 0, 1, 0),  # full
        (_state(JobState.PENDING), 0, 1, 0),  # submit queued the first units; not the launcher's job
        (_state(JobState.COMPLETED, F), 0, 1, 0),
        (_state(JobState.FAILED), 0, 1, 0),
        (_state(JobState.STOPPED), 0, 1, 0),
    ],
)
def test_launches_needed(state, queued, per_unit, want) -> None:
    assert launches_needed(state, SPEC, queued, workers_per_unit=per_unit) == want


def test_unit_sizes_cover_exactly() -> None:
    assert unit_sizes(5, 2) == [2, 2, 1]
    assert unit_sizes(4, 4) == [4]
    assert unit_sizes(0, 3) == [] and unit_sizes(-2, 1) == []
    for total in range(0, 20):
        for per in range(1, 7):
            sizes = unit_sizes(total, per)
            assert sum(sizes) == max(0, total) and all(1 <= s <= per for s in sizes)


@pytest.mark.parametrize("job_id", ["digits", "a_b.c-d", "x__y..z", "A-1-2-3_d", "9" * 64])
def test_launch_unit_ids_round_trip(job_id) -> None:
    rq_id = launch_unit_id(job_id, "0123456789ab")
    assert job_of_launch_unit(rq_id) == job_id
    validate_job_id(rq_id)  # RQ's own rule: letters, digits, '_' and '-' only


@pytest.mark.parametrize("rq_id", ["", "abc", "shoal-launch-", "shoal-launch-x-0123", "shoal-launch-a_zb-0123456789ab",
                                   "shoal-launch-{x}-0123456789ab", "other-digits-0123456789ab"])
def test_foreign_rq_ids_belong_to_no_job(rq_id) -> None:
    assert job_of_launch_unit(rq_id) is None


@pytest.fixture
def cleanup(r):
    ids: list[str] = []
    yield ids
    for j in ids:
        delete_job(r, j)


def test_submit_registers_and_queues_in_one_transaction(r, job_id, queue, cleanup) -> None:
    cleanup.append(job_id)
    spec = JobSpec(name=job_id, entrypoint="simulate", max_workers=5)
    done = submit(r, spec, workers_per_unit=2)
    assert done.sizes == [2, 2, 1] and len(done.unit_ids) == 3
    assert r.sismember(JOBS, job_id) and r.get(job_keys(job_id).spec)
    assert r.hgetall(job_keys(job_id).launch) == {b"workers": b"2", b"units": b"3"}
    assert queue.get_job_ids() == done.unit_ids
    for rq_id, n in zip(done.unit_ids, done.sizes):
        job = Job.fetch(rq_id, connection=r, serializer=JSONSerializer)
        assert job.func_name == "shoal.launch.run_launch"
        assert list(job.args) == [job_id, n] and job.kwargs == {}  # only the job id and a count
        assert job.timeout == NO_TIMEOUT and job.result_ttl == RESULT_TTL
    assert count_launches(queue)[job_id] == 3
    # a unit a node is taking right now (RQ's intermediate queue) still counts
    type(queue).lmove(r, queue.key, None)
    assert count_launches(queue)[job_id] == 3
    queue.intermediate_queue.remove(done.unit_ids[0])
    queue.push_job_id(done.unit_ids[0], at_front=True)

    # a second submit of the same name changes nothing: no spec overwrite, no extra unit
    with pytest.raises(ConfigError, match="already exists"):
        submit(r, JobSpec(name=job_id, entrypoint="simulate", max_workers=1))
    assert JobSpec.from_stored(r.get(job_keys(job_id).spec)).max_workers == 5
    assert len(queue.get_job_ids()) == 3

    assert cancel_queued(queue, job_id) == 3
    assert queue.get_job_ids() == [] and not r.exists(Job.key_for(done.unit_ids[0]))


def test_submit_caps_unit_size_at_max_workers(r, job_id, queue, cleanup) -> None:
    cleanup.append(job_id)
    done = submit(r, JobSpec(name=job_id, entrypoint="simulate", max_workers=2), workers_per_unit=8)
    assert done.sizes == [2]


def _write_state(r, job_id: str, state: JobState, *workers: WorkerState) -> None:
    """What a coordinator would have written (tests only: the real writes are fenced)."""
    cs = _state(state, *workers)
    keys = job_keys(job_id)
    r.hset(keys.state, mapping=cs.status.to_hash())
    if cs.workers:
        r.hset(keys.workers, mapping={w: json.dumps(rec.to_json_dict()) for w, rec in cs.workers.items()})


def test_launcher_reenqueues_once_per_cooldown_and_drops_units_of_ended_jobs(r, job_id, queue, cleanup) -> None:
    cleanup.append(job_id)
    done = submit(r, JobSpec(name=job_id, entrypoint="simulate", max_workers=3), workers_per_unit=1)
    launcher = Launcher(r, instance_id="test", cooldown=30)
    _write_state(r, job_id, JobState.RUNNING, A)
    assert launcher.run_once().get(job_id) is None  # its first units are still queued

    cancel_queued(queue, job_id)  # as if the agents that took them died and RQ gave up on them
    _write_state(r, job_id, JobState.RUNNING, A, F, F)
    assert launcher.run_once()[job_id] == 2  # 2 of 3 workers missing, 1 per unit
    ids = [i for i in queue.get_job_ids() if job_of_launch_unit(i) == job_id]
    assert len(ids) == 2 and not set(ids) & set(done.unit_ids)

    # a second replica in the same pass, or we right after: nothing more
    cancel_queued(queue, job_id)
    assert Launcher(r, instance_id="other", cooldown=30).run_once().get(job_id) is None
    assert 0 < r.pttl(job_keys(job_id).relaunch) <= 30_000

    # a job created without `shoal submit` (no launch settings) is never launched
    plain = f"{job_id}-plain"
    cleanup.append(plain)
    r.set(job_keys(plain).spec, JobSpec(name=plain, entrypoint="simulate").to_json())
    r.sadd(JOBS, plain)
    _write_state(r, plain, JobState.PAUSED)
    assert plain not in launcher.run_once()

    # the job ended: its queued units are dropped
    r.delete(job_keys(job_id).relaunch)
    _write_state(r, job_id, JobState.RUNNING, A)
    assert launcher.run_once()[job_id] == 2
    _write_state(r, job_id, JobState.STOPPED, A)
    assert launcher.run_once() == {}
    assert [i for i in queue.get_job_ids() if job_of_launch_unit(i) == job_id] == []
