"""One network fault at a time during training, across hosts (issue 13, acceptance 3).

Every test runs the float64 digits job (``build_double_paced``) on two worker nodes, each its
own host (network namespace) under ``shoal agent --max-restarts 0`` (a restarted worker would
fail the job), with Redis on a host of its own and two coordinator replicas on two more hosts.
Once training is under way (a committed step read from Redis, not a sleep) one fault is
injected, held for its duration, and healed. Then the end state is checked:

- the job completes, both agents exit 0, both coordinators are still running;
- the ledger holds every step exactly once, each worker with one PID throughout (nobody
  restarted);
- the two replicas' final parameters are bit-identical, and within ``REL_L2`` (relative L2)
  of a failure-free single-process run of the same steps (``ops/chaos``'s reference).

Each test prints its recovery time from the ledger timestamps: fault start -> first step
committed after it, heal -> first step committed after the heal, and the longest gap between
two commits from the fault on.

Faults (see :mod:`shoal.ops.chaos.netns`): a two-way peer partition (n1 <-> n2, Redis still
reachable) of 5 s and (soak) 40 s; a Redis blackhole (every frame to and from Redis dropped,
nothing refused) of 10 s and (soak) 90 s; a one-way partition (n1 -> n2) of 5 s; 20 ms delay
and 5 % loss on n1's link for 5 s; and the leading coordinator cut off from Redis for 5 s (and
at least until the standby has taken the job's lease and steps have committed under it; the
standby must then decide the completion). Partitions and the blackhole must stop commits for
most of their hold: evidence that the fault bit.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.ops.chaos.run import BATCH, reference_parameters
from shoal.ops.chaos.verdict import compare_to_reference
from shoal.worker import ledger
from shoal.ops.chaos.netns import Net
from tests.helpers import ControlWatcher, wait_until

# the faults are nftables rules (.ci/run installs nftables; without it they cannot be made)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("nft") is None, reason="fault injection needs nftables ('nft')")]

DIGITS = 5000
SEED = 7
TTL = 1.5
#: steps committed before the fault is injected
UNDER_WAY = 20
#: per-step pause of the paced entrypoint (s): the job runs long enough to hold a fault in it
PACE = "0.03"
NODES = ("n1", "n2")
STALLED = 0.8


@dataclass
class Fault:
    """``inject(net, client, job)`` starts the fault (and returns what ``until`` needs); it is
    healed after ``hold`` seconds, or (when ``until`` is given) once
    ``until(client, job, ledger_dir, t_fault, injected)`` returns."""

    inject: Callable
    hold: float = 0.0
    until: Callable | None = None
    steps: int = 400
    #: ``check(net, injected)``: more end-state checks of this fault
    check: Callable | None = None
    #: the fault cuts what a commit needs (peers or Redis): evidence that it bit is a spell
    #: without commits of at least ``STALLED`` of its hold
    stalls: bool = False


def _leader(client, job: str) -> str:
    token = client.get(job_keys(job).lease)
    return token.decode().split(":")[0] if token else ""


def _committed(ledger_dir) -> int:
    """The last step a worker recorded as committed in its ledger (0 before any)."""
    return max((e["step"] for e in ledger.read(ledger_dir)), default=0)


def _cut_leader(net: Net, client, job: str) -> str:
    """Partition the replica leading ``job`` from Redis (both ways); its name."""
    leader = _leader(client, job)
    net.partition(net.hosts[leader], net.hosts["redis"])
    return leader


def _standby_leads_and_commits(client, job: str, ledger_dir, t_fault: float, old: str) -> None:
    wait_until(lambda: _leader(client, job) not in ("", old), 30, f"the standby to take the lease from {old}")
    took = time.time()
    print(f"standby took the lease {took - t_fault:.2f} s after the leader {old} was cut off from Redis")
    step = _committed(ledger_dir)
    wait_until(lambda: _committed(ledger_dir) >= step + 5, 30, "steps to commit under the new leader")


def _standby_decided(net: Net, old: str) -> None:
    """The standby took the lease with a new fencing epoch and made the job's last decision."""
    logs = {h: (net.log_dir / f"{h}.log").read_text(errors="replace") for h in ("coord", "coord2")}
    new = "coord2" if old == "coord" else "coord"
    assert "leading with epoch 1 " in logs[old] and "leading with epoch 2 " in logs[new]
    assert "[completed]: completed at step" in logs[new]


FAULTS = {
    "partition-5s": Fault(lambda net, _r, _j: net.partition(net.hosts["n1"], net.hosts["n2"]), hold=5, stalls=True),
    "redis-blackhole-10s": Fault(lambda net, _r, _j: net.loss(net.hosts["redis"], 100), hold=10, stalls=True),
    "oneway-partition-5s": Fault(lambda net, _r, _j: net.partition(net.hosts["n1"], net.hosts["n2"], oneway=True), hold=5, stalls=True),
    "delay-20ms": Fault(lambda net, _r, _j: net.delay(net.hosts["n1"], 20), hold=5),
    "loss-5pct": Fault(lambda net, _r, _j: net.loss(net.hosts["n1"], 5), hold=5),
    "leader-coordinator-cut-off": Fault(_cut_leader, hold=5, until=_standby_leads_and_commits,
                                        check=_standby_decided),
}
SOAK = {
    "partition-40s": Fault(lambda net, _r, _j: net.partition(net.hosts["n1"], net.hosts["n2"]), hold=40, stalls=True),
    "redis-blackhole-90s": Fault(lambda net, _r, _j: net.loss(net.hosts["redis"], 100), hold=90, stalls=True),
}


def _dump(net: Net, tmp_path) -> None:
    print(net.dump(40))
    for f in sorted(tmp_path.glob("agent-n*/slot-*.log")):
        print(f"===== {f.parent.name}/{f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-40:]))


def _recovery(entries: list[dict], t_fault: float, t_heal: float) -> tuple[float, str]:
    """The longest spell without a commit from the fault on, and the recovery times, from the
    ledger's commit timestamps (the test's clock is theirs: namespaces share the machine's
    clock)."""
    times = sorted({e["t"] for e in entries})
    after_fault = [t for t in times if t >= t_fault]
    after_heal = [t for t in times if t >= t_heal]
    if not after_fault:
        return 0.0, "no step committed after the fault"
    gaps = [(b - a, b) for a, b in zip([t_fault, *after_fault], after_fault)]
    stall, resumed = max(gaps)
    healed = f"{after_heal[0] - t_heal:.2f} s" if after_heal else "never"
    return stall, (f"fault start -> first commit {after_fault[0] - t_fault:.2f} s; longest stall from the fault on "
                   f"{stall:.2f} s, ending {resumed - t_fault:.2f} s after the fault start (first commit after it); "
                   f"heal -> first commit {healed}")


def _train_through_fault(cluster: Net, tmp_path, name: str, fault: Fault) -> None:
    """A 2-node job under two coordinator replicas, ``fault`` injected once it is under way and
    healed after its hold, then checked on its end state: completed by the same two worker
    processes, every sample once, the final weights those of a run without a fault."""
    net = cluster
    net.add_host("coord2")
    r = net.client()
    job = "mh-" + name[:20]
    steps = fault.steps
    create_job(r, JobSpec(name=job, entrypoint="shoal.examples.digits:build_double_paced", global_batch_size=BATCH,
                          seed=SEED, epochs=100, max_steps=steps, min_workers=2, max_workers=2,
                          heartbeat_interval=0.2, heartbeat_ttl=TTL))
    watch = ControlWatcher(r, job)
    ledger_dir = tmp_path / "ledger"
    env = {"SHOAL_STEP_PACE": PACE, "SHOAL_LEDGER_DIR": str(ledger_dir),
           "SHOAL_EXPORT_DIR": str(tmp_path / "final"), "SHOAL_HOME": str(tmp_path / "home")}
    started = time.monotonic()
    coords = [net.hosts[h].shoal(h, "coordinator", "--id", h, "--no-launcher", "--lease-ttl", "1", env=env)
              for h in ("coord", "coord2")]
    agents = [net.hosts[n].shoal(f"agent-{n}", "agent", job, "--workers", "1", "--max-restarts", "0",
                                 "--run-dir", str(tmp_path / f"agent-{n}"), env=env) for n in NODES]
    try:
        watch.wait_for(lambda d: (d.generation == 1 and d.world_size == 2), 60)
        wait_until(lambda: _committed(ledger_dir) >= UNDER_WAY, 60, f"step {UNDER_WAY} to commit")
        at_step = _committed(ledger_dir)
        t_fault = time.time()
        injected = fault.inject(net, r, job)
        if fault.until is not None:
            fault.until(r, job, ledger_dir, t_fault, injected)
        time.sleep(max(0.0, t_fault + fault.hold - time.time()))  # the fault's own duration
        t_heal = time.time()
        net.heal()
        print(f"{name}: injected at step {at_step}, healed {t_heal - t_fault:.1f} s later at step {_committed(ledger_dir)}")
        end = watch.wait_for(lambda d: d.job_state in ("completed", "failed"), 120 + fault.hold)
        assert end.job_state == "completed", end.reason
        assert [a.wait(60) for a in agents] == [0, 0]
    except BaseException:
        _dump(net, tmp_path)
        for d in watch.seen[-30:]:
            print("decision:", d.get("job_state"), d.reason[:300])
        raise
    finally:
        print(f"{name}: test body took {time.monotonic() - started:.1f} s")
    assert all(c.popen.poll() is None for c in coords), "a coordinator exited"
    reasons = [d.reason for d in watch.seen]
    print("\n".join(f"decision: {x[:200]}" for x in reasons))
    entries = ledger.read(ledger_dir)
    stall, recovery = _recovery(entries, t_fault, t_heal)
    print(f"{name}: recovery: {recovery}")
    if fault.stalls:  # the fault was real: nothing could commit through it
        assert stall >= STALLED * fault.hold, f"commits went on through the fault: {recovery}"
    agent_logs = "".join(f.read_text(errors="replace") for f in tmp_path.glob("agent-n*/*.log"))
    agent_logs += "".join(a.log_path.read_text(errors="replace") for a in agents)
    assert "died with" not in agent_logs
    workers = {e["worker"] for e in entries}
    assert len(workers) == 2
    assert len({e["pid"] for e in entries}) == 2, "a worker process was replaced"
    verdict = ledger.verify(entries, DIGITS)
    assert verdict.ok, verdict.problem
    assert verdict.steps == steps
    finals = {p.stem: torch.load(p, weights_only=True) for p in sorted((tmp_path / "final").glob("final-*.pt"))}
    assert len(finals) == 2
    equal, close, eq_detail, close_detail = compare_to_reference(finals, reference_parameters(steps, SEED))
    print(f"{name}: {eq_detail}; {close_detail}")
    assert equal, eq_detail
    assert close, close_detail
    if fault.check is not None:
        fault.check(net, injected)


@pytest.mark.parametrize("name", list(FAULTS))
def test_one_fault_during_training_is_ridden_out_exactly_once(cluster, tmp_path, name) -> None:
    _train_through_fault(cluster, tmp_path, name, FAULTS[name])


@pytest.mark.soak
@pytest.mark.parametrize("name", list(SOAK))
def test_one_long_fault_during_training_is_ridden_out_exactly_once(cluster, tmp_path, name) -> None:
    _train_through_fault(cluster, tmp_path, name, SOAK[name])
