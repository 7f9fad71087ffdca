"""A slow peer is not a failure (issue 13): one of three workers sleeps mid-step for longer
than the collective timeout while its heartbeats go on (``SHOAL_FAULTS=w1@N:mid_step:sleep=S``).

Its peers' all-reduce times out and they report the failed step; the coordinator gives the
same members a new generation; the step is dropped everywhere and redone in it. The job
completes with every step and sample exactly once, no worker process exits or is replaced
(the agent may not restart anyone), and the replicas end bit-identical. Before, the
coordinator ignored a failed step, every worker re-joined the generation it had used, and
all of them exited; the agents' replacements resumed from the last checkpoint and committed
the steps after it a second time.
"""

from __future__ import annotations

import pytest
import torch

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger
from tests.helpers import ControlWatcher, dump_logs

pytestmark = pytest.mark.slow
STEPS = 60
DIGITS = 5000


def test_a_peer_slower_than_the_collective_timeout_is_waited_out_and_nobody_exits(r, redis_url, tmp_path) -> None:
    job = "slow-" + tmp_path.name[-6:]
    # TTL 2 s: the collective timeout is max(3, TTL + 1) = 3 s, shorter than the 4 s stall
    create_job(r, JobSpec(name=job, entrypoint="tests.entrypoints:slow_digits", global_batch_size=64,
                          max_steps=STEPS, min_workers=3, max_workers=3, heartbeat_interval=0.2, heartbeat_ttl=2.0))
    watch = ControlWatcher(r, job)
    env = {"SHOAL_TEST_STEP_DELAY": "0.02", "SHOAL_LEDGER_DIR": str(tmp_path / "ledger"),
           "SHOAL_EXPORT_DIR": str(tmp_path / "final"), "SHOAL_FAULTS": "w1@20:mid_step:sleep=4"}
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        agent = procs.start("agent", "agent", job, "--workers", "3", "--max-restarts", "0",
                            "--run-dir", str(tmp_path / "agent"))
        try:
            replanned = watch.wait_for(lambda d: "same members; generation" in d["reason"], 90)
            assert "step 20 of generation 1 failed on" in replanned["reason"]
            assert "generation 2: world size 3 (w0, w1, w2)" in replanned["reason"], replanned["reason"]
            watch.wait_for(lambda d: d["job_state"] == "completed", 120)
            assert agent.wait(60) == 0
        except BaseException:
            dump_logs(procs, tmp_path / "agent")
            raise
    # nobody was declared failed, and no worker process exited before the end
    assert not [d["reason"] for d in watch.seen if " failed (rank" in d["reason"]]
    agent_log = "".join(f.read_text() for f in (tmp_path / "agent").glob("*.log"))
    assert agent_log.count("fault injected: sleep=4 at w1@20:mid_step") == 1
    assert "died with" not in (tmp_path / "logs" / "agent.log").read_text()
    entries = ledger.read(tmp_path / "ledger")
    assert {e["worker"] for e in entries} == {"w0", "w1", "w2"}
    assert len({e["pid"] for e in entries}) == 3  # one process each, all through the job
    verdict = ledger.verify(entries, DIGITS)
    assert verdict.ok, verdict.problem
    assert verdict.steps == STEPS
    finals = [torch.load(p, weights_only=True) for p in sorted((tmp_path / "final").glob("final-*.pt"))]
    assert len(finals) == 3 and all(torch.equal(finals[0][k], f[k]) for f in finals[1:] for k in finals[0])
