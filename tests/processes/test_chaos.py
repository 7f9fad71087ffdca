"""The chaos soak's 60-second version: every kind of fault, injected at random into real
processes (SIGKILL, SIGSEGV and SIGSTOP past the TTL of workers, a step stalled past the
collective timeout with heartbeats going on (a slow peer), SIGKILL of the leading
coordinator, Redis killed and restarted from its AOF, workers joining), then the end state:
the job completed, every sample exactly once per epoch, replicas bit-identical and close to a
failure-free run, LATEST valid whenever sampled, Redis bounded. ``shoal chaos --duration
3600`` is the hour-long run (docs/reliability.md).

Then one test per local fault kind of the registry (ops/chaos/kinds.py): what the kind does to
real processes, through the local soak's injector, on a job's records in the session's Redis
(``local_injector``). A new local kind adds its test here."""

from __future__ import annotations

import os
import random
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from shoal.events.keys import job_keys
from shoal.events.records import WorkerRecord
from shoal.events.states import WorkerState
from shoal.ops.chaos import ChaosConfig, run_chaos
from shoal.ops.chaos.inject import Injector
from shoal.ops.chaos.kinds import STALL_S, Soak
from shoal.ops.localproc import Proc
from tests.helpers import wait_until


# alone on the 2 cores: "no failure without a fault" must not count a heartbeat thread that
# another test starved of CPU past the TTL (seen with the suite on two xdist workers)
@pytest.mark.slow
@pytest.mark.exclusive
def test_sixty_seconds_of_chaos_leave_a_correct_end_state(tmp_path) -> None:
    lines: list[str] = []
    verdict = run_chaos(ChaosConfig(duration=60, seed=7, run_dir=tmp_path), out=lines.append)
    report = "\n".join(lines)
    assert verdict.ok, report
    for kind in Soak.LOCAL.kinds:  # a shuffled cycle over the kinds: each comes up in 60 s
        injected, survived = verdict.faults.get(kind, (0, 0))
        assert injected >= 1 and survived == injected, (kind, report)
    assert {c.name for c in verdict.checks} >= {"job completed", "samples exactly once per epoch", "parameter digests equal",
                                                "close to a failure-free run", "LATEST valid when sampled",
                                                "Redis memory and streams bounded", "every fault survived",
                                                "no failure without a fault", "faults for the whole window"}


# ---- one test per local fault kind ---------------------------------------------------------


def _state(pid: int) -> str:
    """The process's state letter (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def local_injector(r, job_id):
    """The local soak's :class:`Injector` over real processes: workers ``w0``..``w2`` (``sleep``
    processes, Active in generation 4 of ``job_id``'s records) and ``coord1``, the coordinator
    replica holding the job's lease (one more). ``.procs``: name -> Proc; every one is reaped."""
    keys = job_keys(job_id)
    procs: dict[str, Proc] = {}

    def start(name: str) -> Proc:
        procs[name] = Proc(name, subprocess.Popen(["sleep", "120"]), Path(os.devnull))
        return procs[name]

    try:
        for i in range(3):
            record = WorkerRecord(worker_id=f"w{i}", state=WorkerState.ACTIVE, pid=start(f"w{i}").pid)
            r.hset(keys.workers, f"w{i}", record.to_json())
        r.hset(keys.state, "generation", 4)
        coordinators = {"coord1": start("coord1")}
        r.set(keys.lease, "coord1:1")
        injector = Injector(r, keys, ttl=1.5, max_workers=6, coordinators=coordinators, fail_over=None,
                            new_coordinator=None, new_worker=None)
        yield SimpleNamespace(injector=injector, procs=procs)
    finally:
        for proc in procs.values():
            proc.signal(signal.SIGKILL)
            proc.signal(signal.SIGCONT)
            proc.wait(10)


def test_worker_segv_crashes_one_active_worker_natively(local_injector) -> None:
    injector, procs = local_injector.injector, local_injector.procs
    assert injector.allowed("worker_segv")
    fault = injector.inject("worker_segv", random.Random(1))
    hit = procs[fault.worker]
    assert hit.wait(10) == -signal.SIGSEGV
    assert fault.target == f"{fault.worker} (pid {hit.pid})" and fault.generation == 4 and fault.hold == 0
    assert all(p.popen.poll() is None for name, p in procs.items() if name != fault.worker)
    # the next worker fault waits for the generation to move past the one this one hit
    assert not injector.allowed("worker_kill")


def test_coordinator_stop_stalls_the_leader_with_a_worker_fault_inside(local_injector) -> None:
    injector, procs = local_injector.injector, local_injector.procs
    leader = procs["coord1"]
    assert injector.allowed("coordinator_stop")
    stall = injector.inject("coordinator_stop", random.Random(3))
    assert _state(leader.pid) == "T"
    assert STALL_S[0] <= stall.hold <= STALL_S[1] and stall.healed == stall.t + stall.hold
    # the worker fault inside the stall is recorded as a fault of its own, just after it
    assert [f.kind for f in injector.done][0] == "coordinator_stop" and len(injector.done) == 2
    inner = injector.done[1]
    assert inner.kind in ("worker_kill", "worker_segv", "worker_stop") and stall.t <= inner.t < stall.healed
    assert inner.target.endswith("(inside the stall)") and f"; {inner.kind} of {inner.worker} (pid" in stall.target
    assert not injector.allowed("coordinator_stop")  # the leader is stopped
    injector.let_stops_finish()
    wait_until(lambda: _state(leader.pid) != "T", 5, "the leader to be continued")
