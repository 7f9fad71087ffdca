"""A queue-mode agent (``shoal agent --queue``) rides out a Redis primary fail-over (issue 35):
an HA set of the embedded binary (a primary, 2 replicas, 3 sentinels), a coordinator and a
``--queue`` agent running one launch unit of 2 workers, all through a ``redis+sentinel://``
URL. The primary is killed with SIGKILL mid-job (connections refused, then a new primary).

Before, RQ's work-horse monitor (``monitor_work_horse -> job.get_status()``) raised on the
fail-over, the RQ worker quit and took its workers with it. Checked from outside the processes:

- the agent process never exits, and after the job it still serves the queue;
- the workers that finish the job are the processes that started it (same PIDs), and no
  worker was declared failed;
- every committed step and every sample exactly once (the workers' ledgers);
- the unit is a finished RQ job with the job's summary;
- then SIGTERM drains the idle agent: exit 0.
"""

from __future__ import annotations

import signal

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from shoal.coordinator.launcher import enqueue_units, launch_queue
from shoal.core.connection import connect
from shoal.core.registry import create_job
from shoal.ops.embedded import start_ha
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger
from tests.helpers import ControlWatcher, job_spec, wait_until

pytestmark = pytest.mark.slow

STEPS, DIGITS, AT = 80, 5000, 25


def test_a_queue_agent_and_its_workers_ride_out_a_primary_failover(tmp_path) -> None:
    with start_ha(tmp_path / "ha") as ha:
        client = connect(ha.url, ride_out=60, timeout=10)
        job = "qfailover"
        create_job(client, job_spec(job, entrypoint="tests.entrypoints:slow_digits", global_batch_size=32,
                                    max_steps=STEPS, min_workers=1, max_workers=2))
        [unit] = enqueue_units(launch_queue(client), job, [2])
        watch = ControlWatcher(client, job)
        env = {"SHOAL_TEST_STEP_DELAY": "0.05", "SHOAL_LEDGER_DIR": str(tmp_path / "ledger"),
               "SHOAL_HOME": str(tmp_path / "home")}
        with LocalProcs(ha.url, tmp_path / "logs", extra_env=env) as procs:
            procs.coordinator("coord")
            agent = procs.start("agent", "agent", "--queue", "--name", "qagent", "--heartbeat", "1")
            try:
                watch.wait_for(lambda d: d.world_size == 2, 120)

                def committed() -> list[dict]:
                    return ledger.read(tmp_path / "ledger")

                before = wait_until(lambda: (es := committed()) and max(e["step"] for e in es) >= AT and es, 60,
                                    f"step {AT} committed")
                pids = {e["pid"] for e in before}
                assert len(pids) == 2
                old = ha.kill_primary()
                ha.wait_failover(old)
                # a worker declared failed (the agent died with its workers) ends the wait at once
                watch.wait_for(lambda d: d.job_state in ("completed", "failed") or d.failed, 240)
                assert watch.seen[-1].job_state == "completed", watch.seen[-1].reason
                # the unit ends as a finished RQ job with the job's summary, and the agent serves on
                result = wait_until(lambda: Job.fetch(unit, connection=client, serializer=JSONSerializer)
                                    .return_value(), 30, "the unit's result")
                assert result["state"] == "completed" and result["agent_exit_code"] == 0, result
                assert agent.popen.poll() is None, "the queue agent exited:\n" + agent.log_tail(60)
                assert "unhandled exception" not in agent.log_tail(400)
                assert all(rec["state"] != "Failed" for rec in watch.workers().values()), watch.workers()
                # SIGTERM to the (idle) agent: it stops, exit 0
                agent.signal(signal.SIGTERM)
                assert agent.wait(30) == 0, agent.log_tail(60)
            except BaseException:
                for p in procs.procs:
                    print(f"===== {p.name}\n{p.log_tail(60)}")
                raise

    entries = ledger.read(tmp_path / "ledger")
    verdict = ledger.verify(entries, DIGITS)
    assert verdict.ok, verdict.problem
    assert verdict.steps == STEPS
    # the same two processes committed every step, the last one included: none was lost
    assert {e["pid"] for e in entries} == pids
    assert {e["pid"] for e in entries if e["step"] == STEPS} == pids
