"""The node agent's restart policy and failure reports, with real child processes standing
in for workers.

A worker that dies at once is in a crash loop: its restart delay doubles up to the cap. A
worker that ran ``backoff_reset`` seconds before dying starts the doubling over, so a
long-lived slot that crashes rarely is not kept waiting the capped delay. The restart budget
is a total either way.
"""

from __future__ import annotations

import json
import sys

import fakeredis

from shoal.events.keys import job_keys
from shoal.events.models import WorkerExited, decode_event
from shoal.worker.agent import REPORT_CHARS, NodeAgent, failure_report, restart_delay
from tests.helpers import wait_until


def _agent(tmp_path, child: str, **kw) -> NodeAgent:
    agent = NodeAgent(fakeredis.FakeRedis(), "redis://unused", "bk", 1, run_dir=tmp_path, **kw)
    # the child records a worker id (so the agent reports its exit), then runs ``child``
    agent.worker_argv = [sys.executable, "-c",
                         "import os, time, sys; open(os.environ['SHOAL_WORKER_ID_FILE'], 'w').write('w-test'); " + child]
    return agent


def _drive_until_done(agent: NodeAgent, timeout: float = 30) -> None:
    """Drive the agent until its loop ends (every slot gave up or finished)."""
    wait_until(lambda: not agent.run_once(timeout=0.2), timeout, "the agent to give up", interval=0)


def _exits(agent: NodeAgent) -> list[WorkerExited]:
    events = [decode_event(fields, "bk") for _id, fields in agent.client.xrange(job_keys("bk").events)]
    assert all(isinstance(e, WorkerExited) for e in events)
    return events


def test_restart_delay_doubles_and_is_capped() -> None:
    assert [restart_delay(n, 0.5, 30) for n in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert restart_delay(10_000, 0.5, 30) == 30  # no overflow however long the loop


def test_crash_loop_doubles_then_caps_and_spends_the_budget(tmp_path) -> None:
    agent = _agent(tmp_path, "sys.exit(3)", max_restarts=5, backoff=0.01, backoff_max=0.05, backoff_reset=60)
    _drive_until_done(agent)
    slot = agent.slots[0]
    assert slot.delays == [0.01, 0.02, 0.04, 0.05, 0.05]
    assert slot.gave_up and len(slot.spawns) == 6
    events = _exits(agent)
    assert [e.restarts for e in events] == [0, 1, 2, 3, 4, 5]
    assert [e.will_restart for e in events] == [True] * 5 + [False] and events[-1].gave_up
    assert all(e.exit_code == 3 and e.worker_id == "w-test" for e in events)


def test_a_healthy_run_resets_the_backoff_not_the_budget(tmp_path) -> None:
    reset_after = 0.2
    # each run lasts longer than backoff_reset, so no restart waits more than the first delay
    agent = _agent(tmp_path, "time.sleep(0.4); sys.exit(3)", max_restarts=3, backoff=0.01, backoff_max=10,
                   backoff_reset=reset_after)
    _drive_until_done(agent)
    slot = agent.slots[0]
    assert all(b - a >= reset_after for a, b in zip(slot.spawns, slot.exits))
    assert slot.delays == [0.01, 0.01, 0.01]
    assert slot.gave_up and slot.restarts == 3  # the budget is still a total


def test_the_report_is_the_dead_process_traceback_whole(tmp_path) -> None:
    # a deep traceback (20 distinct frames): longer than any fixed number of tail lines
    child = "".join(f"def f{i}():\n    return f{i + 1}()\n" for i in range(20)) + "def f20():\n    return 1 / 0\n"
    child += "print('training...', flush=True)\nf0()"
    agent = _agent(tmp_path, f"exec({child!r})", max_restarts=0)
    _drive_until_done(agent)
    (event,) = _exits(agent)
    assert event.exit_code == 1 and event.gave_up
    assert event.traceback.startswith("Traceback (most recent call last):")
    assert event.traceback.endswith("ZeroDivisionError: division by zero")
    assert all(f"in f{i}\n" in event.traceback for i in range(21)) and "training..." not in event.traceback


def test_the_report_reads_only_the_latest_process_output(tmp_path) -> None:
    log = tmp_path / "slot.log"
    old = "Traceback (most recent call last):\n  File \"x\", line 1\nValueError: an earlier crash\n"
    log.write_text(old)
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("step 1\nstep 2\nexiting with code 3\n")
    # the latest process left no traceback: its last lines, never the earlier crash's
    assert failure_report(log, start) == "step 1\nstep 2\nexiting with code 3"
    # a traceback too long for the event keeps its end (the exception line)
    with open(log, "a") as f:
        f.write("Traceback (most recent call last):\n" + "  frame\n" * 5000 + "KeyError: 'x'\n")
    report = failure_report(log, start)
    assert len(report) == REPORT_CHARS and report.endswith("KeyError: 'x'")


def test_a_worker_the_job_refused_is_not_restarted_nor_reported_as_a_failure(tmp_path) -> None:
    """Exit code 4 before joining is the job refusing the worker (at ``max_workers``, or a
    worker that came after the job ended): starting it again would only be refused again,
    and it is no crash (the coordinator counts the refusal in the job's record)."""
    agent = NodeAgent(fakeredis.FakeRedis(), "redis://unused", "bk", 2, run_dir=tmp_path, max_restarts=3,
                      backoff=0.01)
    agent.worker_argv = [sys.executable, "-c",
                         "import sys; print('shoal: join rejected: job is completed', file=sys.stderr); sys.exit(4)"]
    _drive_until_done(agent)
    assert [len(s.spawns) for s in agent.slots] == [1, 1]
    assert not any(s.gave_up for s in agent.slots)
    assert agent.client.xlen(job_keys("bk").events) == 0


# --- GPUs: each slot its own, the backend chosen per node ------------------------------------
def test_each_slot_gets_a_gpu_of_its_own_and_nccl(tmp_path, r, job_id) -> None:
    """A node with four GPUs (named as CUDA_VISIBLE_DEVICES names them) and ``backend: auto``:
    each worker process sees one GPU, a different one, and is told NCCL (torchrun's
    ``--nproc-per-node gpu``)."""
    from shoal.core.jobspec import JobSpec
    from shoal.core.registry import create_job

    spec = JobSpec(name=job_id, entrypoint="simulate", max_workers=4)
    create_job(r, spec)
    agent = NodeAgent(r, "redis://unused", job_id, 4, run_dir=tmp_path, spec=spec, max_restarts=0,
                      gpus=["0", "1", "GPU-2c", "3"], node="n1")
    out = tmp_path / "env"
    out.mkdir()
    agent.worker_argv = [sys.executable, "-c", (
        "import json, os; keep = ('CUDA_VISIBLE_DEVICES', 'SHOAL_BACKEND', 'SHOAL_DEVICE', 'LOCAL_RANK', "
        "'LOCAL_WORLD_SIZE', 'SHOAL_PLACEMENT'); "
        f"open(os.path.join({str(out)!r}, os.environ['LOCAL_RANK']), 'w').write("
        "json.dumps({k: os.environ.get(k) for k in keep}))")]
    _drive_until_done(agent)
    seen = {int(p.name): json.loads(p.read_text()) for p in out.iterdir()}
    assert sorted(seen) == [0, 1, 2, 3]
    assert [seen[i]["CUDA_VISIBLE_DEVICES"] for i in range(4)] == ["0", "1", "GPU-2c", "3"]
    assert {(e["SHOAL_BACKEND"], e["SHOAL_DEVICE"], e["LOCAL_WORLD_SIZE"]) for e in seen.values()} == {("nccl", "cuda", "4")}
    assert seen[0]["SHOAL_PLACEMENT"] == "each of the 4 workers on node n1 has a GPU of its own"


def test_more_workers_than_gpus_share_them_over_gloo(tmp_path, r, job_id) -> None:
    from shoal.core.jobspec import JobSpec

    agent = NodeAgent(r, "redis://unused", job_id, 3, run_dir=tmp_path, gpus=["0"],
                      spec=JobSpec(name=job_id, entrypoint="simulate"), node="n1")
    assert agent.placement.backend == "gloo" and agent.placement.device == "cuda" and agent.slot_gpus == ["0"] * 3


def test_nccl_with_more_workers_than_gpus_is_refused_at_start_where_the_user_looks(tmp_path, r, job_id) -> None:
    """The agent starts no worker: one line (the CLI's message), the job's log stream and a
    start failure per slot (the coordinator fails the job when too few workers remain)."""
    import pytest

    from shoal.core.jobspec import JobSpec
    from shoal.core.registry import create_job
    from shoal.events.models import WorkerStartFailed
    from shoal.worker.placement import PlacementRefused

    spec = JobSpec(name=job_id, entrypoint="simulate", backend="nccl")
    create_job(r, spec)
    agent = NodeAgent(r, "redis://unused", job_id, 3, run_dir=tmp_path, gpus=["0"], spec=spec, node="n1")
    agent.worker_argv = [sys.executable, "-c", "raise SystemExit('must not start')"]
    with pytest.raises(PlacementRefused) as info:
        agent.run()
    line = str(info.value)
    assert line == ("backend: nccl with 3 workers share 1 GPU on node n1: NCCL needs one GPU per worker: start one "
                    "worker per GPU (--workers gpu) or use backend: gloo")
    assert all(not s.spawns for s in agent.slots)
    events = [decode_event(fields, job_id) for _id, fields in r.xrange(job_keys(job_id).events)]
    assert [(type(e), e.slot, e.gave_up, e.traceback) for e in events] == [(WorkerStartFailed, i, True, line) for i in range(3)]
    (log_entry,) = r.xrange(job_keys(job_id).logs)
    assert log_entry[1][b"msg"].decode() == f"no worker can start on node n1: {line}"
