"""A joiner whose catch-up source is killed (SIGKILL) mid-transfer still joins (issue 38).

Real Redis, real worker processes, real gloo. The source is killed at a deterministic point of
the transfer: ``SHOAL_FAULTS=*@usr1:transfer:kill`` arms, with one SIGUSR1 sent to the source
only, a kill at its next catch-up once the joiner has the state's header and none of its
tensors (``core/faults.py``, phase ``transfer``).
"""

from __future__ import annotations

import signal
from collections import defaultdict
from pathlib import Path

import pytest

from shoal.core.registry import create_job
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger
from tests.helpers import ControlWatcher, dump_logs, job_spec, wait_until

pytestmark = pytest.mark.slow

DIGITS = 5000
H = 6
BATCH = 48
KILL_SOURCE = "*@usr1:transfer:kill"


def _diloco(name: str, rounds: int, **fields):
    return job_spec(name, dict(entrypoint="tests.entrypoints:diloco_digits", global_batch_size=BATCH,
                               max_steps=rounds, sync="diloco", diloco={"inner_steps": H},
                               loader_workers=0, prefetch_steps=0), **fields)


def _entries(tmp_path: Path) -> list[dict]:
    return ledger.read(tmp_path / "ledger") if (tmp_path / "ledger").exists() else []


def _run(r, redis_url, tmp_path, spec, old: int, env: dict) -> tuple[list, int, int, int, ControlWatcher]:
    """``old`` workers train; once the job has a checkpoint, w0 (rank 0: the catch-up's source)
    is armed to die mid-transfer (SIGUSR1) and a joiner starts. Returns the exit codes of the
    other old workers, the joiner's, w0's pid, the joiner's pid and the watcher."""
    create_job(r, spec)
    watch = ControlWatcher(r, spec.name)
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        ws = [procs.worker(spec.name, f"p{i}") for i in range(old)]
        try:
            watch.wait_for(lambda d: d.world_size == old, 120)
            # a checkpoint exists, and every old member trained (its fault plan's handler is set)
            wait_until(lambda: {e["pid"] for e in _entries(tmp_path) if e["step"] >= 2} == {w.pid for w in ws}
                       and list((tmp_path / "ckpt").glob("step-*")), 120, "checkpointed rounds of every member")
            # the catch-up's source: rank 0 of the generation, w0 (lowest id), whichever process it is
            source = next(w for w in ws if w.pid == watch.workers()["w0"]["pid"])
            source.signal(signal.SIGUSR1)  # arms KILL_SOURCE: it dies at its next catch-up, mid-transfer
            joiner = procs.worker(spec.name, "joiner")
            assert source.wait(120) == -signal.SIGKILL
            watch.wait_for(lambda d: d.job_state == "completed", 180)
            codes = [w.wait(60) for w in ws if w is not source]
            code = joiner.wait(60)
        except BaseException:
            dump_logs(procs, tmp_path / "logs")
            raise
    return codes, code, source.pid, joiner.pid, watch


def test_diloco_joiner_whose_only_source_dies_mid_transfer_resumes_from_the_newest_checkpoint(
        r, redis_url, tmp_path) -> None:
    """Shape (b): one member and a joiner; the member dies while the joiner receives its state.
    No live member holds the job's state: the coordinator plans the joiner's generation from
    the LATEST checkpoint (typed ``restored_from`` on the control entry, ``restore_step`` on the
    table), the joiner - still the same process - loads it (a newer one than it loaded when it
    started: checkpoints every round) and finishes the job. The rounds the dead member committed
    after that checkpoint are redone: rolled back, the ledger is exactly once."""
    rounds = 30
    spec = _diloco("jl-" + tmp_path.name[-6:], rounds, min_workers=1, max_workers=2, epochs=2,
                   checkpoint_uri=f"file://{tmp_path / 'ckpt'}", checkpoint_interval=1, checkpoint_keep=3)
    env = {"SHOAL_TEST_STEP_DELAY": "0.05", "SHOAL_LEDGER_DIR": str(tmp_path / "ledger"), "SHOAL_LEDGER_DIGESTS": "1",
           "SHOAL_FAULTS": KILL_SOURCE}
    (), code, source, joiner, watch = _run(r, redis_url, tmp_path, spec, 1, env)
    assert code == 0

    # the coordinator's decision: the joiner alone, from the checkpoint LATEST named then
    restored = [d for d in watch.seen if d.restored_from is not None]
    assert len(restored) == 1, [d.reason for d in watch.seen]
    d = restored[0]
    at = d.restored_from
    assert d.world_size == 1 and "w0" in d.failed and f"starts from the checkpoint of step {at}" in d.reason
    latest = [int(x.reason.split("checkpoint of step ")[1].split()[0]) for x in watch.seen[:watch.seen.index(d)]
              if x.kind == "checkpoint" and x.reason.startswith("LATEST -> ")]
    assert at == max(latest) > 0

    entries = _entries(tmp_path)
    by_pid: dict[int, list[dict]] = defaultdict(list)
    for e in entries:
        by_pid[e["pid"]].append(e)
    assert set(by_pid) == {source, joiner}  # the joiner's process trained on: it did not restart
    # it joined at the checkpoint: its rounds are the ones after it, to the end
    assert sorted(e["step"] for e in by_pid[joiner]) == list(range(at + 1, rounds + 1))
    # the source's rounds after the checkpoint were rolled back and redone by the joiner, on
    # the same batches, to the same weights (one member each time, the same starting state)
    rolled = {e["step"]: e for e in by_pid[source] if e["step"] > at}
    redone = {e["step"]: e for e in by_pid[joiner]}
    for step, e in rolled.items():
        assert (e["cursor"], e["batch"], e["digest"]) == (redone[step]["cursor"], redone[step]["batch"],
                                                          redone[step]["digest"]), step
    kept = [e for e in entries if not (e["pid"] == source and e["step"] > at)]
    verdict = ledger.verify(kept, DIGITS)
    assert verdict.ok, verdict.problem
    assert verdict.steps == rounds and verdict.partial_commits == 0
    print(f"restored from step {at}; {len(rolled)} round(s) rolled back and redone")


def test_diloco_joiner_whose_source_dies_mid_transfer_joins_from_another_live_member(r, redis_url, tmp_path) -> None:
    """Shape (a): two members and a joiner; the source (rank 0) dies while the joiner receives
    its state. The other member holds the job's state: the next generation catches the joiner
    up from it - no checkpoint, nothing redone - and the ledger is exactly once as it is."""
    rounds = 30
    spec = _diloco("ja-" + tmp_path.name[-6:], rounds, min_workers=1, max_workers=3, epochs=2,
                   checkpoint_uri=f"file://{tmp_path / 'ckpt'}", checkpoint_interval=1, checkpoint_keep=3)
    env = {"SHOAL_TEST_STEP_DELAY": "0.05", "SHOAL_LEDGER_DIR": str(tmp_path / "ledger"), "SHOAL_LEDGER_DIGESTS": "1",
           "SHOAL_FAULTS": KILL_SOURCE}
    (other,), code, source, joiner, watch = _run(r, redis_url, tmp_path, spec, 2, env)
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
