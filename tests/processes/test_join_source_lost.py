"""A joiner whose catch-up source dies mid-transfer still joins, and the job completes
exactly once (issue 38). Real Redis, real worker processes, real gloo, real signals.

The source dies at a deterministic point of the transfer: ``SHOAL_FAULTS=*@usr1:transfer:...``
arms, with one SIGUSR1 sent to the source only, a fault at its next catch-up once the joiner
has the state's header and none of its tensors (``core/faults.py``, phase ``transfer``):

* ``kill``: the process is gone, its sockets reset - the joiner's receive fails at once;
* ``stop``: it is frozen (a dead host, a cut cable: no reset, no heartbeat) - the coordinator
  declares it failed after the heartbeat TTL and the joiner's watcher aborts the receive then,
  not after the transfer's own 30 s bound.

Then either another member holds the job's state (the joiner catches up from it), or none does
(two-worker job: the source and the joiner): the coordinator plans the joiner's generation from
the LATEST checkpoint (``restored_from`` on the control entry, ``restore_step`` on the table),
the joiner loads it - the same process: it joins, it does not restart - and the rounds the dead
member committed after that checkpoint are redone: rolled back, the ledger is exactly once.
"""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from pathlib import Path

import pytest

from shoal.core.registry import create_job
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger, transfer
from tests.helpers import ControlWatcher, dump_logs, job_spec, wait_until

pytestmark = pytest.mark.slow

DIGITS = 5000
H = 6
BATCH = 48


def _diloco(name: str, rounds: int, **fields):
    return job_spec(name, dict(entrypoint="tests.entrypoints:diloco_digits", global_batch_size=BATCH,
                               max_steps=rounds, sync="diloco", diloco={"inner_steps": H},
                               loader_workers=0, prefetch_steps=0), **fields)


def _entries(tmp_path: Path) -> list[dict]:
    return ledger.read(tmp_path / "ledger") if (tmp_path / "ledger").exists() else []


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _kill_stopped(source) -> None:
    """SIGKILL a source frozen by the ``stop`` fault, and the helper it started to send it
    SIGCONT later (it would outlive the test)."""
    helpers = _children(source.pid)
    source.signal(signal.SIGKILL)
    for pid in helpers:
        os.kill(pid, signal.SIGKILL)


def _run(r, redis_url, tmp_path, spec, old: int, env: dict, hung: bool = False
         ) -> tuple[list, int, int, int, ControlWatcher]:
    """``old`` workers train; once the job has a checkpoint, w0 (rank 0: the catch-up's source)
    is armed to die mid-transfer (SIGUSR1) and a joiner starts. Returns the exit codes of the
    other old workers, the joiner's, w0's pid, the joiner's pid and the watcher."""
    create_job(r, spec)
    watch = ControlWatcher(r, spec.name)
    hold = tmp_path / "hold"
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env | {"SHOAL_TEST_HOLD_FILE": str(hold)}) as procs:
        procs.coordinator("coord")
        ws = [procs.worker(spec.name, f"p{i}") for i in range(old)]
        source = None
        try:
            watch.wait_for(lambda d: d.world_size == old, 120)
            # a checkpoint exists, and every old member trained (its fault plan's handler is set)
            wait_until(lambda: {e["pid"] for e in _entries(tmp_path) if e["step"] >= 2} == {w.pid for w in ws}
                       and list((tmp_path / "ckpt").glob("step-*")), 120, "checkpointed rounds of every member")
            # the catch-up's source: rank 0 of the generation, w0 (lowest id), whichever process it is
            source = next(w for w in ws if w.pid == watch.workers()["w0"]["pid"])
            source.signal(signal.SIGUSR1)  # arms the fault: at its next catch-up, mid-transfer
            # the old members wait at their next step until the joiner has joined: the job cannot
            # end before it, however long the joiner's process takes to start
            hold.touch()
            joiner = procs.worker(spec.name, "joiner")
            watch.wait_for(lambda d: d.planned and d.world_size == old + 1, 120)
            hold.unlink()
            if hung:  # stopped mid-transfer: no connection reset, no heartbeat; gone once replaced
                watch.wait_for(lambda d: "w0" in d.removed, 120)
                _kill_stopped(source)
            assert source.wait(120) == -signal.SIGKILL
            watch.wait_for(lambda d: d.job_state == "completed", 180)
            codes = [w.wait(60) for w in ws if w is not source]
            code = joiner.wait(60)
        except BaseException:
            hold.unlink(missing_ok=True)
            if hung and source is not None and source.popen.poll() is None:
                _kill_stopped(source)
            dump_logs(procs, tmp_path / "logs")
            raise
    return codes, code, source.pid, joiner.pid, watch


JOBS = {
    # ~0.3 s a round, a checkpoint every round
    "diloco": dict(entrypoint="tests.entrypoints:diloco_digits", global_batch_size=BATCH, max_steps=15,
                   sync="diloco", diloco={"inner_steps": H}, checkpoint_interval=1),
    # ~0.1 s a step, a checkpoint every 2 steps
    "dp": dict(entrypoint="tests.entrypoints:slow_digits", global_batch_size=64, max_steps=40, checkpoint_interval=2),
}


def _alone(sync: str, name: str, tmp_path: Path):
    """A job for one member and a joiner, checkpointed often."""
    return job_spec(name, JOBS[sync], dict(min_workers=1, max_workers=2, loader_workers=0, prefetch_steps=0,
                                           checkpoint_uri=f"file://{tmp_path / 'ckpt'}", checkpoint_keep=3))


def _env(tmp_path: Path, fault: str) -> dict[str, str]:
    return {"SHOAL_TEST_STEP_DELAY": "0.05", "SHOAL_LEDGER_DIR": str(tmp_path / "ledger"), "SHOAL_LEDGER_DIGESTS": "1",
            "SHOAL_FAULTS": f"*@usr1:transfer:{fault}"}


def _check_resumed_from_newest_checkpoint(tmp_path: Path, watch: ControlWatcher, spec, source: int,
                                          joiner: int) -> tuple[int, int]:
    """The coordinator planned the joiner alone from the newest checkpoint; the joiner's process
    trained every step after it; the source's steps after it were rolled back and redone on the
    same batches to the same weights; the rest is exactly once. Returns (the checkpoint's step,
    the steps redone)."""
    restored = [d for d in watch.seen if d.restored_from is not None]
    assert len(restored) == 1, [d.reason for d in watch.seen]
    d = restored[0]
    at = d.restored_from
    assert d.world_size == 1 and "w0" in d.failed and f"starts from the checkpoint of step {at}" in d.reason
    # the newest checkpoint then: the last one the coordinator moved LATEST to before
    moved = [x for x in watch.seen[:watch.seen.index(d)] if x.kind == "checkpoint"]
    assert moved and moved[-1].latest_step == at, moved[-1].reason
    entries = _entries(tmp_path)
    by_pid: dict[int, list[dict]] = defaultdict(list)
    for e in entries:
        by_pid[e["pid"]].append(e)
    assert set(by_pid) == {source, joiner}  # the joiner's process trained on: it did not restart
    # it joined at the checkpoint: its steps are the ones after it, to the end
    assert sorted(e["step"] for e in by_pid[joiner]) == list(range(at + 1, spec.max_steps + 1))
    # the source's steps after the checkpoint were rolled back and redone by the joiner, on the
    # same batches, to the same weights (one member each time, from the same state)
    rolled = {e["step"]: e for e in by_pid[source] if e["step"] > at}
    redone = {e["step"]: e for e in by_pid[joiner]}
    for step, e in rolled.items():
        again = redone[step]
        assert (e["cursor"], e["batch"], e["digest"]) == (again["cursor"], again["batch"], again["digest"]), step
    kept = [e for e in entries if not (e["pid"] == source and e["step"] > at)]
    verdict = ledger.verify(kept, DIGITS)
    assert verdict.ok, verdict.problem
    assert verdict.steps == spec.max_steps and verdict.partial_commits == 0
    return at, len(rolled)


@pytest.mark.parametrize("sync", ["diloco", "dp"])
def test_a_joiner_whose_only_source_is_killed_mid_transfer_resumes_from_the_newest_checkpoint(
        r, redis_url, tmp_path, sync) -> None:
    """Shape (b), the source killed: no live member holds the job's state."""
    spec = _alone(sync, f"jk{sync[:2]}-" + tmp_path.name[-6:], tmp_path)
    (), code, source, joiner, watch = _run(r, redis_url, tmp_path, spec, 1, _env(tmp_path, "kill"))
    assert code == 0
    at, redone = _check_resumed_from_newest_checkpoint(tmp_path, watch, spec, source, joiner)
    print(f"{sync}: resumed from the checkpoint of step {at}; {redone} step(s) rolled back and redone")


def test_a_joiner_whose_only_source_hangs_mid_transfer_is_released_by_its_eviction(r, redis_url, tmp_path) -> None:
    """Shape (b), the source frozen mid-transfer (SIGSTOP: no reset, no heartbeat): the joiner's
    receive ends when the coordinator declares the source failed (heartbeat TTL), not after
    the transfer's own bound; then as above."""
    spec = _alone("diloco", "jh-" + tmp_path.name[-6:], tmp_path)
    (), code, source, joiner, watch = _run(r, redis_url, tmp_path, spec, 1, _env(tmp_path, "stop=60"), hung=True)
    assert code == 0
    _check_resumed_from_newest_checkpoint(tmp_path, watch, spec, source, joiner)
    (d,) = [d for d in watch.seen if d.restored_from is not None]
    assert d.removed == ("w0",) and d.causes == ("heartbeat_timeout",)
    # the joiner was waiting for the frozen source's tensors: its receive was aborted when the
    # table that evicted the source came (its `ready` for that generation follows it), well
    # within the transfer's own bound it would otherwise have waited out
    formed = next(x for x in watch.seen if x.kind == "ready" and x.generation == d.generation)
    stuck_since = next(x for x in watch.seen if x.planned and x.world_size == 2)
    assert formed.ts_ms - stuck_since.ts_ms < transfer.TRANSFER_BASE_S * 1000


def test_a_diloco_joiner_whose_source_is_killed_mid_transfer_joins_from_another_live_member(
        r, redis_url, tmp_path) -> None:
    """Shape (a): two members and a joiner; the source (rank 0) is killed while the joiner
    receives its state. The other member holds the job's state: the next generation catches the
    joiner up from it - no checkpoint, nothing redone - and the ledger is exactly once as it is."""
    rounds = 15
    spec = _diloco("ja-" + tmp_path.name[-6:], rounds, min_workers=1, max_workers=3,
                   checkpoint_uri=f"file://{tmp_path / 'ckpt'}", checkpoint_interval=1, checkpoint_keep=3)
    (other,), code, source, joiner, watch = _run(r, redis_url, tmp_path, spec, 2, _env(tmp_path, "kill"))
    assert other == 0 and code == 0
    assert all(d.restored_from is None for d in watch.seen), [d.reason for d in watch.seen]
    entries = _entries(tmp_path)
    verdict = ledger.verify(entries, DIGITS)
    assert verdict.ok, verdict.problem
    assert verdict.steps == rounds
    joined = sorted(e["step"] for e in entries if e["pid"] == joiner)
    assert joined and joined == list(range(joined[0], rounds + 1))
    # from its first round on, its global weights are the other member's (it caught up from it)
    digests = defaultdict(set)
    for e in entries:
        digests[e["step"]].add(e["digest"])
    assert all(len(digests[s]) == 1 for s in joined)

