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


def run_until_failed(r, redis_url: str, tmp_path, spec: JobSpec) -> dict:
    """Run ``spec`` under a coordinator and a node agent (node n7, two workers, one restart
    each) until the job fails and the agent gives up; the coordinator's failing decision."""
    create_job(r, spec)
    watch = ControlWatcher(r, spec.name)
    with LocalProcs(redis_url, tmp_path / "logs") as procs:
        procs.coordinator("coord")
        agent = procs.start("agent", "agent", spec.name, "--workers", "2", "--max-restarts", "1", "--backoff", "0.1",
                            "--node", "n7", "--run-dir", str(tmp_path / "agent"))
        try:
            failed = watch.wait_for(lambda d: d.job_state == "failed", 120)
            assert agent.wait(60) == 1  # it gave up
        except BaseException:
            dump_logs(procs, tmp_path / "agent")
            raise
    return failed


def test_workers_dying_before_they_join_fail_the_job_with_the_cause_in_status_and_logs(
        r, redis_url, tmp_path, subprocess_env) -> None:
    job = "nostart-" + tmp_path.name[-6:]
    failed = run_until_failed(r, redis_url, tmp_path, JobSpec(name=job, entrypoint="shoal.examples.digits:buidl",
                                                              max_steps=10, min_workers=1, max_workers=2))
    assert failed.reason.startswith("job failed: n7/slot"), failed.reason
    assert "gave up after 1 restarts" in failed.reason
    assert "first failure: the worker process on node n7 (slot " in failed.reason
    assert "failed before joining: process ended with exit code" in failed.reason
    assert "buidl" in failed.reason  # the cause itself, from the worker's last output line

    env = dict(subprocess_env, REDIS_URL=redis_url)
    status = run_cli(env, "status", job, "--json")
    assert status.returncode == 0, status.stderr
    s = json.loads(status.stdout)
    assert s["state"] == "failed" and s["failures"] >= 2
    assert "failed before joining" in s["first_failure"] and "buidl" in s["first_failure_traceback"]
    logs = run_cli(env, "logs", job)
    assert logs.returncode == 0, logs.stderr
    assert "n7/slot0" in logs.stdout and "died with exit code" in logs.stdout and "buidl" in logs.stdout


def test_a_dataset_that_raises_mid_training_fails_the_job_with_its_file_and_line(
        r, redis_url, tmp_path, subprocess_env) -> None:
    """A worker-side failure after joining (issue 14, acceptance 2): the dataset raises in
    ``__getitem__`` at a fixed index, so every start of every worker fails the same way; the
    agent spends its restart budget, and the job fails with the user's exception, its file
    and line, in ``status`` and ``shoal logs``."""
    job = "corrupt-" + tmp_path.name[-6:]
    failed = run_until_failed(r, redis_url, tmp_path, JobSpec(name=job, entrypoint="tests.entrypoints:corrupt_digits",
                                                              epochs=1, min_workers=1, max_workers=2))
    assert "corrupt sample 100" in failed.reason, failed.reason
    env = dict(subprocess_env, REDIS_URL=redis_url)
    s = json.loads(run_cli(env, "status", job, "--json").stdout)
    assert s["state"] == "failed" and "corrupt sample 100" in s["first_failure"], s["first_failure"]
    assert "tests/entrypoints.py" in s["first_failure"] + s["first_failure_traceback"]
    logs = run_cli(env, "logs", job).stdout
    assert "ValueError: corrupt sample 100" in logs or "raised ValueError: corrupt sample 100" in logs, logs[-3000:]
