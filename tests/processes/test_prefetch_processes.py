"""The prefetching input pipeline with real workers (issue 17): loader processes, a join and
a kill mid-epoch, exactly-once, identical replicas, and no orphan loaders.

(The default job spec prefetches too - one loader, two steps ahead - so the other process
tests run with it: ``test_training_elastic`` compares weights after a kill with a
failure-free run, ``test_start_failure`` fails a job on a dataset that raises in a loader.)
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import psutil
import pytest
import torch

from shoal.core.jobspec import JobSpec
from shoal.core.procs import pid_runs
from shoal.core.registry import create_job
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger
from shoal.worker.userapi import TrainingSetup
from tests.entrypoints import slow_digits
from tests.helpers import ControlWatcher, wait_until

pytestmark = pytest.mark.slow


def micro_digits() -> TrainingSetup:
    """The slow digits job in micro-batches of 8: several prefetched items per step."""
    setup = slow_digits()
    setup.micro_batch = 8
    return setup


def test_prefetching_workers_survive_a_join_and_a_kill_exactly_once(r, redis_url, tmp_path: Path) -> None:
    job = "prefetch-" + tmp_path.name[-8:]
    spec = JobSpec(name=job, entrypoint="tests.processes.test_prefetch_processes:micro_digits", min_workers=1,
                   max_workers=3, global_batch_size=64, epochs=2, heartbeat_interval=0.2, heartbeat_ttl=1.5, seed=5,
                   loader_workers=2, prefetch_steps=3)
    create_job(r, spec)
    watch = ControlWatcher(r, job)
    env = {"SHOAL_LEDGER_DIR": str(tmp_path / "ledger"), "SHOAL_EXPORT_DIR": str(tmp_path / "final"),
           "SHOAL_TEST_STEP_DELAY": "0.03"}
    loaders: list[int] = []
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        ws = [procs.worker(job, f"p{i}") for i in range(2)]
        try:
            watch.wait_for(lambda d: d.world_size == 2, 120)
            joiner = procs.worker(job, "joiner")  # a join mid-epoch
            watch.wait_for(lambda d: d.world_size == 3, 90)
            watch.wait_for(lambda d: d.kind == "ready" and "w2 active" in d.reason, 60)
            loaders = [c.pid for c in psutil.Process(joiner.pid).children()]
            assert len(loaders) == 2, loaders  # its two loader processes
            joiner.signal(signal.SIGKILL)  # a failure: the loaders must not outlive their worker
            watch.wait_for(lambda d: "w2" in d.failed, 60)
            wait_until(lambda: not any(pid_runs(pid) for pid in loaders), 30,
                       lambda: f"the killed worker's loaders to exit: {[p for p in loaders if pid_runs(p)]} alive")
            watch.wait_for(lambda d: d.job_state == "completed", 240)
            codes = {p.name: p.wait(60) for p in procs.procs if p.name != "coord"}
        except BaseException:
            for p in procs.procs:
                print(f"===== {p.name}\n{p.log_tail(40)}")
            raise
    assert codes == {"p0": 0, "p1": 0, "joiner": -signal.SIGKILL}
    verdict = ledger.verify(ledger.read(tmp_path / "ledger"), 5000)
    assert verdict.ok, verdict.problem
    assert verdict.epochs_complete == 2 and verdict.steps == 2 * 79
    finals = [torch.load(f, weights_only=True) for f in sorted((tmp_path / "final").glob("final-*.pt"))]
    assert len(finals) == 2
    for name in finals[0]:
        assert torch.equal(finals[0][name], finals[1][name]), name  # replicas bit-identical
    for p in ws:  # the loaders served the survivors' batches (misses only around switches)
        closed = re.findall(r"input pipeline closed: (\d+) batches prefetched, (\d+) fetched inline", p.log_tail(400))
        assert closed, p.log_tail(40)
        prefetched, inline = map(int, closed[-1])
        assert prefetched > 4 * inline, closed
