"""A worker that dies before it joins is a visible failure, not a job ``pending`` forever
(issue 14).

The job's entrypoint names a function its module does not have, so every worker process
exits while it builds the model, before it has a worker id. Before, the agent reported
nothing (it names a dead worker by the id the worker wrote on joining), gave up after its
restart budget, and ``shoal status`` said ``pending ... reason: created``, ``failures: 0``
forever; the message was only in a slot log on the node. Now the agent reports each such
exit (node, slot, pid, exit code, the last lines of output) and copies them to the job's log
stream; the coordinator records each as a failure, keeps the first as the root cause, and
fails the job when the agent gives up.
"""

from __future__ import annotations

import json

import pytest

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.ops.localproc import LocalProcs
from tests.helpers import ControlWatcher, dump_logs, run_cli

pytestmark = pytest.mark.slow


def test_workers_dying_before_they_join_fail_the_job_with_the_cause_in_status_and_logs(
        r, redis_url, tmp_path, subprocess_env) -> None:
    job = "nostart-" + tmp_path.name[-6:]
    create_job(r, JobSpec(name=job, entrypoint="shoal.examples.digits:buidl", max_steps=10, min_workers=1,
                          max_workers=2))
    watch = ControlWatcher(r, job)
    with LocalProcs(redis_url, tmp_path / "logs") as procs:
        procs.coordinator("coord")
        agent = procs.start("agent", "agent", job, "--workers", "2", "--max-restarts", "1", "--backoff", "0.1",
                            "--node", "n7", "--run-dir", str(tmp_path / "agent"))
        try:
            failed = watch.wait_for(lambda d: d["job_state"] == "failed", 120)
            assert agent.wait(60) == 1  # it gave up
        except BaseException:
            dump_logs(procs, tmp_path / "agent")
            raise
    assert failed["reason"].startswith("job failed: n7/slot"), failed["reason"]
    assert "gave up after 1 restarts" in failed["reason"]
    assert "first failure: the worker process on node n7 (slot " in failed["reason"]
    assert "failed before joining: process ended with exit code" in failed["reason"]
    assert "buidl" in failed["reason"]  # the cause itself, from the worker's last output line

    env = dict(subprocess_env, REDIS_URL=redis_url)
    status = run_cli(env, "status", job, "--json")
    assert status.returncode == 0, status.stderr
    s = json.loads(status.stdout)
    assert s["state"] == "failed" and s["failures"] >= 2
    assert "failed before joining" in s["first_failure"] and "buidl" in s["first_failure_traceback"]
    logs = run_cli(env, "logs", job)
    assert logs.returncode == 0, logs.stderr
    assert "n7/slot0" in logs.stdout and "died with exit code" in logs.stdout and "buidl" in logs.stdout
