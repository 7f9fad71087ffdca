"""A job that had to redo committed steps says so (issue 13, acceptance 5).

Two workers of a digits job with no checkpoint store commit 20 steps, then both stall at the
step boundary (``SHOAL_FAULTS=w0@20:before_step:sleep=...``: heartbeats go on, so the
coordinator's progress sample sees step 20) and are SIGKILLed together: every replica of the
trained state is lost. The node agent restarts both; they join as new workers, start from
scratch and train to the end. The coordinator's decision says that the new generation
resumed at step 0 and that steps 1-20, committed before, are redone; ``shoal status`` (text
and ``--json``), the completion reason, the stored summary and the launch summary all carry
the 20 steps, which is exactly what the ledger shows committed twice. Before, the job ended
``completed`` with nothing to tell it had trained 80 steps for 60.
"""

from __future__ import annotations

import json
import os
import signal
from collections import defaultdict

import pytest

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.ops.launch import job_summary
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger
from tests.helpers import ControlWatcher, dump_logs, run_cli, wait_until

pytestmark = pytest.mark.slow
STEPS = 60
LOST_AT = 20


def test_all_replicas_lost_without_a_checkpoint_the_steps_redone_are_reported(r, redis_url, subprocess_env, tmp_path) -> None:
    job = "redone-" + tmp_path.name[-6:]
    keys = job_keys(job)
    create_job(r, JobSpec(name=job, entrypoint="tests.entrypoints:slow_digits", global_batch_size=64,
                          max_steps=STEPS, min_workers=2, max_workers=2, heartbeat_interval=0.2, heartbeat_ttl=2.0))
    watch = ControlWatcher(r, job)
    # w0 and w1 stall once they committed LOST_AT steps (long enough for the coordinator's
    # progress sample, every 5 s); their replacements get new ids, so the rule spares them
    stall = f"w0@{LOST_AT}:before_step:sleep=30,w1@{LOST_AT}:before_step:sleep=30"
    env = {"SHOAL_TEST_STEP_DELAY": "0.02", "SHOAL_LEDGER_DIR": str(tmp_path / "ledger"), "SHOAL_FAULTS": stall}
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        agent = procs.start("agent", "agent", job, "--workers", "2", "--max-restarts", "1", "--backoff", "0.1",
                            "--run-dir", str(tmp_path / "agent"))
        try:
            # the coordinator has seen step LOST_AT committed (both members are stalled there)
            wait_until(lambda: r.hget(keys.state, "high_step") == str(LOST_AT).encode(), 60,
                       lambda: f"high_step {LOST_AT}; state: {r.hgetall(keys.state)}")
            pids = {wid: rec["pid"] for wid, rec in watch.workers().items()}
            assert sorted(pids) == ["w0", "w1"], pids
            for pid in pids.values():  # lose every replica at once
                os.kill(pid, signal.SIGKILL)
            redone = watch.wait_for(lambda d: "redone" in d.reason, 60)
            done = watch.wait_for(lambda d: d.job_state == "completed", 60)
            assert agent.wait(60) == 0
        except BaseException:
            dump_logs(procs, tmp_path / "agent")
            raise
    # the ledger: which steps were committed in more than one generation (each generation
    # commits a step once, on every rank: the ranks' entries of a step share it)
    generations: dict[int, set[int]] = defaultdict(set)
    for e in ledger.read(tmp_path / "ledger"):
        generations[e["step"]].add(e["generation"])
    assert sorted(generations) == list(range(1, STEPS + 1))
    twice = sorted(step for step, gens in generations.items() if len(gens) > 1)
    assert twice == list(range(1, LOST_AT + 1)), twice
    assert all(len(gens) == 2 for gens in generations.values() if len(gens) > 1)

    # the decision, as `shoal events` shows it, names the generation, the step and the range
    gen = int(redone.generation)
    said = f"generation {gen} resumed at step 0 (from scratch): steps 1-{LOST_AT}, committed before, are redone"
    assert said in redone.reason, redone.reason
    assert said in run_cli(subprocess_env, "events", job).stdout
    # the job is not silently completed: its reason, summary, status and launch summary say it
    assert f"; {LOST_AT} committed steps were redone" in done.reason, done.reason
    assert json.loads(r.hget(keys.state, "summary"))["steps_redone"] == LOST_AT
    status = json.loads(run_cli(subprocess_env, "status", job, "--json").stdout)
    assert status["state"] == "completed" and status["steps_redone"] == LOST_AT == len(twice)
    assert f"steps redone: {LOST_AT} (committed, then lost" in run_cli(subprocess_env, "status", job).stdout
    assert job_summary(r, job)["steps_redone"] == LOST_AT
