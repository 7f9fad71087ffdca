"""A job of three digits workers under one node agent that may restart nobody, with a fault
check in the middle and the end state every peer-fault test asserts (``test_slow_peer``,
``test_hung_peer``)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import torch

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger
from tests.helpers import ControlWatcher, dump_logs, wait_until

DIGITS = 5000


def run_three_workers(r, redis_url, tmp_path, job: str, check: Callable[[ControlWatcher], None], *,
                      faults: str = "", steps: int = 60, step_delay: float = 0.02, **spec) -> list[dict]:
    """Run the job (``spec`` overrides the defaults below) until it completes; ``check(watch)``
    runs once the generation of three formed. Asserts: the agent exits 0, no worker process
    exited early, every step and sample exactly once, the three finishing replicas
    bit-identical. Returns the ledger's entries."""
    fields = dict(name=job, entrypoint="tests.entrypoints:slow_digits", global_batch_size=64, max_steps=steps,
                  min_workers=2, max_workers=3, heartbeat_interval=0.2, heartbeat_ttl=2.0) | spec
    create_job(r, JobSpec(**fields))
    watch = ControlWatcher(r, job)
    env = {"SHOAL_TEST_STEP_DELAY": str(step_delay), "SHOAL_LEDGER_DIR": str(tmp_path / "ledger"),
           "SHOAL_EXPORT_DIR": str(tmp_path / "final"), "SHOAL_FAULTS": faults}
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        agent = procs.start("agent", "agent", job, "--workers", "3", "--max-restarts", "0",
                            "--run-dir", str(tmp_path / "agent"))
        try:
            # min_workers 2: a generation of two may come first
            watch.wait_for(lambda d: d.world_size == 3, 60)
            check(watch)
            watch.wait_for(lambda d: d.job_state == "completed", 180)
            assert agent.wait(60) == 0
        except BaseException:
            dump_logs(procs, tmp_path / "agent")
            raise
    assert "died with" not in (tmp_path / "logs" / "agent.log").read_text()  # no process exited early
    return exactly_once_and_identical(tmp_path, steps)[0]


def exactly_once_and_identical(run: Path, steps: int, workers: int = 3) -> tuple[list[dict], list[dict]]:
    """The ledger (``run/ledger``) of a finished digits job: every step and sample exactly
    once, ``steps`` steps; the final exports (``run/final``) of its ``workers`` replicas
    bit-identical. Returns (ledger entries, final state dicts)."""
    entries = ledger.read(run / "ledger")
    verdict = ledger.verify(entries, DIGITS)
    assert verdict.ok, verdict.problem
    assert verdict.steps == steps
    finals = [torch.load(p, weights_only=True) for p in sorted((run / "final").glob("final-*.pt"))]
    assert len(finals) == workers and all(torch.equal(finals[0][k], f[k]) for f in finals[1:] for k in finals[0])
    return entries, finals


def pids_by_worker(entries: list[dict]) -> dict[str, set[int]]:
    """Worker id -> the process ids that committed under it."""
    out: dict[str, set[int]] = {}
    for e in entries:
        out.setdefault(e["worker"], set()).add(e["pid"])
    return out


def wait_three_committed_together(ledger_dir: Path, steps: int = 1, timeout: float = 60) -> None:
    """Until ``steps`` steps are committed and each of w0, w1 and w2 has committed one in a
    world of three. The plan naming all three is not enough before a fault: a slow starter
    (busy CI cores) may not have switched to it yet, and a fault on a peer it never shared a
    collective with tests nothing (once on CI: w1 frozen before w2 had switched)."""
    def together() -> bool:
        entries = ledger.read(ledger_dir)
        return len(entries) >= steps and {e["worker"] for e in entries if e["world"] == 3} == {"w0", "w1", "w2"}

    wait_until(together, timeout, f"{steps} committed steps, the three workers' among them")


def slow_down(watch: ControlWatcher, ledger_dir: Path, worker: str = "w1") -> None:
    """Once the three committed together, arm ``worker``'s ``WORKER@usr1:PHASE:ACTION`` fault
    rule (SIGUSR1: it fires at the rule's phase of its next step)."""
    wait_three_committed_together(ledger_dir)
    os.kill(watch.workers()[worker]["pid"], signal.SIGUSR1)
