"""DiLoCo over a slow link (issue 38): an outer exchange that takes longer than the job's
``step_timeout`` and its collective timeout - longer than 100 s at 10 Mbit/s in the extended
tier - is a slow link, not a failure: no member is declared failed, stuck or evicted, no step
fails, and the job completes exactly once. A member frozen (SIGSTOP) in the middle of such an
exchange is still evicted within its heartbeat TTL, and the survivor completes the job.

Two worker hosts (network namespaces) whose links are paced (TBF, both ways), Redis and the
coordinator on hosts of their own; the workers' Redis traffic shares the paced links with the
exchange, as it would on a real slow link. The link is measured before the run
(:meth:`Net.check_link`): a machine that cannot carry the rate refuses the run instead of
testing something else. The model carries a ballast parameter
(``tests.entrypoints:diloco_ballast``) that sets the bytes of the outer exchange; every round's
exposed exchange time, read from the ledger, must exceed the bound the test is about - the
evidence that the slow exchange happened."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from shoal.core.registry import create_job
from shoal.ops.chaos.netns import Net
from shoal.worker import ledger
from shoal.worker.runner import collective_timeout
from tests.helpers import ControlWatcher, job_spec, wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tc") is None, reason="a link's rate needs tc (Debian package iproute2)")]

DIGITS = 5000
H = 4
BATCH = 32
NODES = ("n1", "n2")


def _spec(name: str, rounds: int, **fields):
    return job_spec(name, dict(entrypoint="tests.entrypoints:diloco_ballast", global_batch_size=BATCH,
                               max_steps=rounds, sync="diloco", min_workers=2, max_workers=2,
                               loader_workers=0, prefetch_steps=0), **fields)


def _start(net: Net, tmp_path: Path, spec, mbit: float, ballast: int) -> tuple[ControlWatcher, list, Path]:
    """Pace both worker hosts' links to ``mbit`` (measured first), register ``spec`` and start
    its coordinator and one worker on each worker host."""
    for name in NODES:
        net.set_link(net.hosts[name], mbit)
    net.check_link(net.hosts["n1"], net.hosts["n2"], mbit, seconds=2.0, warm=1.0)
    client = net.client()
    create_job(client, spec)
    watch = ControlWatcher(client, spec.name)
    lg = tmp_path / "ledger"
    env = {"SHOAL_LEDGER_DIR": str(lg), "SHOAL_LEDGER_DIGESTS": "1", "SHOAL_HOME": str(tmp_path / "home"),
           "SHOAL_TEST_BALLAST": str(ballast), "SHOAL_TEST_STEP_DELAY": "0.01"}
    net.hosts["coord"].shoal("coord", "coordinator", "--id", "coord", "--no-launcher", env=env)
    workers = [net.hosts[name].shoal(f"w-{name}", "worker", spec.name, env=env) for name in NODES]
    return watch, workers, lg


def _no_failure_at_all(watch: ControlWatcher) -> None:
    """Every decision of the job: one generation of both members, nobody removed, no step
    failed; every worker record without a failure."""
    planned = watch.planned()
    assert [d.world_size for d in planned] == [2], [d.reason for d in planned]
    assert not [d.reason for d in watch.seen if d.removed or d.kind == "step_failed"]
    records = watch.workers()
    assert len(records) == 2
    for wid, rec in records.items():
        assert rec["state"] != "Failed" and rec.get("cause", "none") in ("", "none"), (wid, rec)


def _exactly_once(lg: Path, rounds: int) -> list[dict]:
    entries = ledger.read(lg)
    verdict = ledger.verify(entries, DIGITS)
    assert verdict.ok, verdict.problem
    assert verdict.steps == rounds and verdict.partial_commits == 0
    by_round: dict[int, list[dict]] = {}
    for e in entries:
        by_round.setdefault(e["step"], []).append(e)
    for step, group in by_round.items():
        assert len(group) == 2, f"round {step} committed by {len(group)} member(s)"
        assert len({e["digest"] for e in group}) == 1, f"round {step}: the members' global weights differ"
    return entries


def _run_slow(net: Net, tmp_path: Path, spec, mbit: float, ballast: int, bound: float, timeout: float) -> None:
    watch, workers, lg = _start(net, tmp_path, spec, mbit, ballast)
    try:
        end = watch.wait_for(lambda d: d.job_state in ("completed", "failed"), timeout)
        assert end.job_state == "completed", end.reason
        for w in workers:
            assert w.wait(60) == 0, w.log_tail(40)
        _no_failure_at_all(watch)
        entries = _exactly_once(lg, spec.max_steps)
    except BaseException:
        print(net.dump(60))
        raise
    exchanges = sorted(e["comm"] for e in entries)
    print(f"outer exchanges at {mbit:g} Mbit/s, {ballast} ballast parameters ({spec.diloco.outer_dtype}): "
          f"{', '.join(f'{s:.1f}' for s in exchanges)} s; bound {bound:g} s")
    # the evidence: every round's exchange outlasted the bound the test is about
    assert exchanges[0] > bound, exchanges


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_an_outer_exchange_longer_than_the_collective_timeout_evicts_nobody(cluster, tmp_path, dtype) -> None:
    """2 Mbit/s, step_timeout 2 s (a 7 s collective timeout); each round's exchange ~9 s: the
    fp32 all-reduce and the int8 all-gather (one message per member)."""
    spec = _spec("sl-" + dtype, 2, step_timeout=2.0, diloco={"inner_steps": H, "outer_dtype": dtype})
    ballast = 500_000 if dtype == "fp32" else 2_000_000  # ~2 MB either way
    _run_slow(cluster, tmp_path, spec, 2.0, ballast, collective_timeout(spec), 120)


def test_at_10_mbit_an_outer_exchange_longer_than_100_s_evicts_nobody(cluster, tmp_path) -> None:
    """The acceptance figure: 10 Mbit/s, the default step_timeout (60 s), a 150 MB fp32
    outer gradient per member: each round's exchange takes more than 100 s."""
    spec = _spec("sl-10mbit", 2, diloco={"inner_steps": H}, step_timeout=60.0)
    _run_slow(cluster, tmp_path, spec, 10.0, 37_500_000, 100.0, 900)
