"""A group that can never form fails fast with its cause (issue 26).

Before, ``shoal agent J --workers 2 --iface nosuch0`` logged a clear cause ("interface
'nosuch0' has no IPv4 address") on every try and the coordinator planned a new generation
of the same members every ~0.2 s (143 in 75 s) until ``formation_timeout`` (300 s). Now each
worker classifies its error (a configuration error: it cannot go away by retrying), the
coordinator backs off between generations of the same members and fails the job on the
third generation in a row with the same configuration error, naming the error and its fix.
"""

from __future__ import annotations

import json
import time

import pytest

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.ops.localproc import LocalProcs
from tests.helpers import ControlWatcher, dump_logs, run_cli

pytestmark = pytest.mark.slow


def test_an_interface_without_an_address_fails_the_job_within_a_minute_naming_it(r, redis_url, tmp_path,
                                                                                   subprocess_env) -> None:
    job = "nosuch-" + tmp_path.name[-6:]
    create_job(r, JobSpec(name=job, entrypoint="shoal.examples.digits:build", max_steps=50, min_workers=2,
                          max_workers=2))
    watch = ControlWatcher(r, job)
    with LocalProcs(redis_url, tmp_path / "logs") as procs:
        procs.coordinator("coord")
        started = time.monotonic()
        agent = procs.start("agent", "agent", job, "--workers", "2", "--iface", "nosuch0", "--node", "n1",
                            "--run-dir", str(tmp_path / "agent"))
        try:
            failed = watch.wait_for(lambda d: d.job_state == "failed", 60)
            took = time.monotonic() - started
            assert agent.wait(60) == 0  # the workers saw the job fail and exited
        except BaseException:
            dump_logs(procs, tmp_path / "agent")
            raise
    reason = failed.reason
    planned = watch.planned()
    print(f"failed {took:.1f} s after the agent started, {len(planned)} generations planned: {reason}")
    assert took < 60 and len(planned) <= 15
    assert "\n" not in reason
    assert reason.startswith("job failed: generation ") and "(no_interface_address)" in reason
    assert "interface 'nosuch0' (--iface/SHOAL_IFACE) has no IPv4 address" in reason
    assert "fix: name an interface that has an IPv4 address here with --iface" in reason
    # while it happened, each failure said when the same members would try again
    assert any("the same members get a new generation in 0.5 s" in d.reason for d in watch.seen)
    env = dict(subprocess_env, REDIS_URL=redis_url)
    s = json.loads(run_cli(env, "status", job, "--json").stdout)
    assert s["state"] == "failed" and s["reason"] == reason
