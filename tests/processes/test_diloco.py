"""DiLoCo (``sync: diloco``) on real worker processes, real Redis and real gloo collectives:
a job completes exactly once with every member's global weights equal after every round; a
member killed (SIGKILL) mid-round costs the survivors none of their inner steps and the round
still commits exactly once; a worker that joins mid-job joins at a round boundary with the
global weights and outer state of a live member.

Each worker appends its committed rounds to the ledger with the digest of its weights after
the round (``SHOAL_LEDGER_DIGESTS``): equal digests per round are the members' global weights
being bit-identical; equal digests in the rounds after a join mean the joiner's outer
momentum is the others' too (a different one would move its weights elsewhere)."""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from pathlib import Path

import pytest

from shoal.core.registry import create_job
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger
from tests.helpers import ControlWatcher, dump_logs, job_spec, wait_until

DIGITS = 5000
H = 6
BATCH = 48
ROUND = H * BATCH


def _spec(name: str, rounds: int, **fields):
    return job_spec(name, dict(entrypoint="tests.entrypoints:diloco_digits", global_batch_size=BATCH,
                               max_steps=rounds, sync="diloco", diloco={"inner_steps": H},
                               loader_workers=0, prefetch_steps=0), **fields)


def _env(tmp_path: Path, delay: str = "0.02") -> dict[str, str]:
    return {"SHOAL_TEST_STEP_DELAY": delay, "SHOAL_LEDGER_DIR": str(tmp_path / "ledger"),
            "SHOAL_LEDGER_DIGESTS": "1"}


def _entries(tmp_path: Path) -> list[dict]:
    return ledger.read(tmp_path / "ledger") if (tmp_path / "ledger").exists() else []


def _committed_by(tmp_path: Path, step: int) -> set[int]:
    """The pids that committed round ``step``."""
    return {e["pid"] for e in _entries(tmp_path) if e["step"] == step}


def _first_round_of(tmp_path: Path, members: int) -> int:
    """The first round committed by ``members`` members (0: none yet)."""
    by_step: dict[int, set[int]] = defaultdict(set)
    for e in _entries(tmp_path):
        by_step[e["step"]].add(e["pid"])
    return min((step for step, pids in by_step.items() if len(pids) == members), default=0)


def _check_exactly_once_and_equal(tmp_path: Path, rounds: int) -> dict[int, list[dict]]:
    entries = _entries(tmp_path)
    verdict = ledger.verify(entries, DIGITS)
    assert verdict.ok, verdict.problem
    assert verdict.partial_commits == 0
    assert verdict.steps == rounds
    by_step: dict[int, list[dict]] = defaultdict(list)
    for e in entries:
        by_step[e["step"]].append(e)
    for step, group in by_step.items():
        assert len({e["digest"] for e in group}) == 1, f"round {step}: the members' global weights differ"
        # a round of H inner batches (the last of an epoch short)
        assert sum(len(e["indices"]) for e in group) == len(group[0]["batch"]) in (ROUND, DIGITS % ROUND)
    return by_step


def _run(r, redis_url, tmp_path, spec, workers: int, script=None, env: dict | None = None):
    create_job(r, spec)
    watch = ControlWatcher(r, spec.name)
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env or _env(tmp_path)) as procs:
        procs.coordinator("coord")
        ws = [procs.worker(spec.name, f"p{i}") for i in range(workers)]
        try:
            out = script(watch, procs, ws) if script else None
            watch.wait_for(lambda d: d.job_state == "completed", 240)
            codes = {p.name: p.wait(60) for p in procs.procs if p.name != "coord"}
        except BaseException:
            dump_logs(procs, tmp_path / "logs")
            raise
    return out, codes


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_a_diloco_job_completes_exactly_once_with_equal_global_weights(r, redis_url, tmp_path, dtype) -> None:
    """fp32 outer gradients are all-reduced; int8 ones all-gathered and summed in fp32 in rank
    order on every member: either way the members' weights are bit-identical after each round."""
    rounds = 5
    spec = _spec("dl-" + tmp_path.name[-6:], rounds, min_workers=3,
                 diloco={"inner_steps": H, "outer_dtype": dtype, "outer_block": 64})
    _, codes = _run(r, redis_url, tmp_path, spec, 3)
    assert set(codes.values()) == {0}
    by_step = _check_exactly_once_and_equal(tmp_path, rounds)
    assert all(len(group) == 3 for group in by_step.values())  # one generation of 3 throughout


@pytest.mark.slow
def test_a_member_killed_mid_round_costs_the_survivors_no_inner_step(r, redis_url, tmp_path) -> None:
    rounds = 12
    spec = _spec("dk-" + tmp_path.name[-6:], rounds, min_workers=2)

    def kill_mid_round(watch, procs, ws):
        # the first round committed by all three (two may have trained a few rounds alone first):
        # every member is now inside the next round's inner steps
        full = wait_until(lambda: _first_round_of(tmp_path, 3), 120, "a round committed by all three members")
        assert full < rounds - 1, "the job ended before a round of three could be interrupted"
        victim = next(w for w in ws if w.popen.pid in _committed_by(tmp_path, full))
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(30) == -signal.SIGKILL
        return victim.pid, full + 1

    (victim, killed_in), codes = _run(r, redis_url, tmp_path, spec, 3, kill_mid_round, env=_env(tmp_path, "0.05"))
    assert sorted(codes.values()) == [-signal.SIGKILL, 0, 0]
    by_step = _check_exactly_once_and_equal(tmp_path, rounds)
    redone = by_step[killed_in]
    assert victim not in {e["pid"] for e in redone}, "the victim committed the round it was killed in"
    assert len(redone) == 2
    batch = redone[0]["batch"]
    thirds = [set(batch[k * ROUND // 3:(k + 1) * ROUND // 3]) for k in range(3)]
    # each survivor's round holds a whole third of the batch - its own slice of the generation of
    # three, trained before the kill and kept - plus half of the victim's third
    kept = [next(k for k, third in enumerate(thirds) if third <= set(e["indices"])) for e in redone]
    assert len(set(kept)) == 2, kept
    assert all(len(e["indices"]) == ROUND // 2 for e in redone)


@pytest.mark.slow
def test_a_joiner_joins_at_a_round_boundary_with_the_global_state(r, redis_url, tmp_path) -> None:
    rounds = 40  # ~0.4 s a round: time for a process to start and join (3 epochs of the digits)
    spec = _spec("dj-" + tmp_path.name[-6:], rounds, min_workers=2, epochs=3)

    hold = tmp_path / "hold"

    def join_later(watch, procs, ws):
        wait_until(lambda: len(_committed_by(tmp_path, 2)) == 2, 120, "round 2 committed by both members")
        # the members wait inside their next inner step until the joiner is in the plan: on a
        # loaded machine its start-up outlasted the other 38 rounds ("join rejected: job is completed")
        hold.touch()
        try:
            joiner = procs.worker(spec.name, "p2")
            watch.wait_for(lambda d: d.world_size == 3, 90)
        finally:
            hold.unlink()
        return joiner.pid

    env = {**_env(tmp_path, "0.05"), "SHOAL_TEST_HOLD_FILE": str(hold)}
    joiner, codes = _run(r, redis_url, tmp_path, spec, 2, join_later, env=env)
    assert set(codes.values()) == {0}
    by_step = _check_exactly_once_and_equal(tmp_path, rounds)
    joined = [step for step, group in sorted(by_step.items()) if joiner in {e["pid"] for e in group}]
    assert joined and joined[0] > 2 and joined == list(range(joined[0], rounds + 1))
    # from its first round on, its weights after each round are the others' (same digests,
    # checked above): it started from their global weights and outer momentum, not its own init
    assert all(len(by_step[s]) == 3 for s in joined[1:])
