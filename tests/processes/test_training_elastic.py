"""Acceptance of the elastic training runtime: real processes, real gloo collectives, real Redis.

The model is the digits example; faults are injected by (worker, step, phase) through
``SHOAL_FAULTS`` and checked on the end state: ledgers of committed steps, final weights.
"""

from __future__ import annotations

import json
import signal
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.core.jobspec import JobSpec
from shoal.ops.localproc import LocalProcs
from shoal.ops.status import format_status, job_status
from tests.helpers import ControlWatcher, job_spec, run_job, wait_until
from shoal.worker import ledger

pytestmark = pytest.mark.slow
BATCH = 64


#: the digits example's job (job_spec: over the tests' common defaults)
DIGITS_JOB = dict(entrypoint="shoal.examples.digits:build", min_workers=1, global_batch_size=BATCH, seed=3)


def _final(d: Path) -> dict[str, dict]:
    return {f.stem.removeprefix("final-"): torch.load(f, weights_only=True) for f in d.glob("final-*.pt")}


def _train(r, redis_url, tmp: Path, spec: JobSpec, workers: int, faults: str = "", script=None):
    """:func:`run_job` to completion with the ledger in ``tmp/ledger``, the final weights in
    ``tmp/final`` and ``faults`` injected."""
    env = {"SHOAL_LEDGER_DIR": str(tmp / "ledger"), "SHOAL_EXPORT_DIR": str(tmp / "final"), "SHOAL_FAULTS": faults}
    return run_job(r, redis_url, tmp, spec, workers, env, script)


def test_kill_mid_step_survivors_continue_and_match_a_failure_free_run(r, redis_url, tmp_path) -> None:
    """Also periodic evaluation across the kill: every member evaluates every 5th step (which
    leaves the weights alone: they still match the run without a failure), rank 0 reports
    each once, and the job's record and status show the final one."""
    steps = 24
    # reference: one worker, no failure, same global batch and seed
    ref_dir = tmp_path / "ref"
    _train(r, redis_url, ref_dir, job_spec("ref-" + tmp_path.name[-8:], DIGITS_JOB, max_steps=steps, min_workers=1,
                                           max_workers=1, eval_every_steps=5), 1)
    (ref,) = _final(ref_dir / "final").values()

    job = "kill-" + tmp_path.name[-8:]
    run_dir = tmp_path / "run"

    def script(watch, procs, ws):
        watch.wait_for(lambda d: d.world_size == 3, 120)
        watch.wait_for(lambda d: d.world_size == 2, 60)

    watch, procs, codes = _train(r, redis_url, run_dir, job_spec(job, DIGITS_JOB, max_steps=steps, min_workers=2,
                                                                 eval_every_steps=5), 3,
                                 faults="w1@10:mid_step:kill", script=script)
    records = watch.workers()
    assert records["w1"]["state"] == "Failed"
    survivors = {w: rec["pid"] for w, rec in records.items() if w != "w1"}
    entries = ledger.read(run_dir / "ledger")
    for wid, pid in survivors.items():
        mine = [e for e in entries if e["worker"] == wid]
        assert {e["pid"] for e in mine} == {pid}  # same process all along
        # every step committed once, in order, from the one it joined at (on a loaded
        # machine the third worker may join after the first steps): nothing redone
        mine_steps = [e["step"] for e in mine]
        assert mine_steps == list(range(mine_steps[0], steps + 1)), mine_steps
    assert min(e["step"] for e in entries if e["worker"] in survivors) == 1
    assert sorted(codes.values()) == [-signal.SIGKILL, 0, 0]
    finals = _final(run_dir / "final")
    assert set(finals) == set(survivors)
    a, b = finals.values()
    for name in ref:
        assert torch.equal(a[name], b[name])  # replicas bit-identical
        assert torch.allclose(a[name], ref[name], rtol=1e-4, atol=1e-6), name
    # evaluations: each due step reported once by rank 0 (w0 throughout), then the final one
    evals = [d for d in watch.seen if d.kind == "eval"]
    assert [d.reason.split(" (")[0] for d in evals] == [f"w0 evaluated step {k}" for k in (5, 10, 15, 20, 24)], evals
    assert "final" in evals[-1].reason and all(d.job_state == "running" for d in evals)
    history = [f for _id, f in r.xrange(job_keys(job).progress) if f.get(b"kind") == b"eval"]
    assert [int(f[b"step"]) for f in history] == [5, 10, 15, 20, 24]
    s = job_status(r, job)
    summary = json.loads(r.hget(job_keys(job).state, "summary"))
    assert s["eval"]["step"] == 24 and s["eval"]["worker_id"] == "w0"
    assert s["eval"]["metrics"] == {"accuracy": summary["accuracy"], "loss": summary["loss"]}
    assert "last evaluation: step 24 (0 epochs done): accuracy=" in format_status(s)
    # both survivors evaluated the steps after the kill, the one that does not report too
    for wid, pid in survivors.items():
        log_text = next(p for p in procs.procs if p.popen.pid == pid).log_tail(2000)
        assert "evaluated step 15 " in log_text and "evaluated step 20 " in log_text, (wid, log_text[-2000:])


def test_join_kill_and_leave_mid_epoch_use_every_sample_exactly_once(r, redis_url, tmp_path) -> None:
    job = "ledger-" + tmp_path.name[-8:]
    spec = job_spec(job, DIGITS_JOB, entrypoint="tests.entrypoints:slow_digits", epochs=2, global_batch_size=32,
                    min_workers=1, max_workers=3)
    pids = {}

    def script(watch, procs, ws):
        watch.wait_for(lambda d: d.world_size == 2, 120)
        pids.update({w: rec["pid"] for w, rec in watch.workers().items()})
        joiner = procs.worker(job, "joiner")  # a join mid-epoch
        watch.wait_for(lambda d: d.world_size == 3, 60)
        watch.wait_for(lambda d: d.kind == "ready" and "w2 active" in d.reason, 60)
        joiner.signal(signal.SIGKILL)  # a failure
        watch.wait_for(lambda d: "w2" in d.failed, 60)
        ws[0].signal(signal.SIGTERM)  # a graceful leave
        watch.wait_for(lambda d: d.kind == "left", 60)

    watch, procs, codes = _train(r, redis_url, tmp_path, spec, 2, script=script)
    records = watch.workers()
    assert sorted(rec["state"] for rec in records.values()) == ["Active", "Failed", "Left"]
    assert all(records[w]["pid"] == pid for w, pid in pids.items())  # survivors never restarted
    verdict = ledger.verify(ledger.read(tmp_path / "ledger"), 5000)
    assert verdict.ok, verdict.problem
    assert verdict.epochs_complete == 2 and verdict.steps == 2 * 157
    # every member of a generation started it from the same step and parameter digest,
    # including the joiner before its first step
    by_gen = defaultdict(list)
    for p in procs.procs:
        for line in p.log_tail(1000).splitlines():
            if "digest" in line and " generation " in line and "switch" in line:
                gen = line.split("generation ")[1].split(":")[0]
                by_gen[gen].append((p.name, line.split("step ")[1].split(",")[0], line.split("digest ")[1].split()[0]))
    assert all(len({(s, d) for _, s, d in v}) == 1 for v in by_gen.values()), by_gen
    with_joiner = [v for v in by_gen.values() if "joiner" in {name for name, _, _ in v}]
    assert len(with_joiner) == 1 and len(with_joiner[0]) == 3 and with_joiner[0][0][1] != "0"
    assert codes["p0"] == 0  # the SIGTERM'd worker finished its step and left cleanly


def test_crash_loop_backs_off_gives_up_and_reports_root_cause(r, redis_url, tmp_path, job_id) -> None:
    """A worker that always fails: restarts with backoff, the budget outlives a coordinator
    restart, the job fails naming the first failure's worker, rank, exit code and traceback."""
    import redis as redis_mod

    from shoal.ops.status import format_status, job_status
    from shoal.worker.agent import NodeAgent

    job, keys = job_id, job_keys(job_id)
    create_job(r, job_spec(job, DIGITS_JOB, min_workers=1, max_workers=1, max_restarts=3))
    watch = ControlWatcher(r, job)
    with LocalProcs(redis_url, tmp_path / "logs") as procs:
        coord = procs.coordinator("coord")
        agent = NodeAgent(redis_mod.Redis.from_url(redis_url), redis_url, job, 1, run_dir=tmp_path / "agent",
                          max_restarts=3, backoff=0.2, extra_env={"SHOAL_FAULTS": "*@0:before_step:raise"})

        def agent_done() -> bool:
            if not agent.run_once(timeout=1.0):
                return True
            if len(agent.slots[0].exits) == 1 and coord.popen.poll() is None:
                coord.signal(signal.SIGKILL)  # the coordinator dies mid-loop; another takes over
                coord.wait(10)
                procs.coordinator("coord2")
            return False

        wait_until(agent_done, 180, lambda: f"the agent to give up; slot exits so far: {len(agent.slots[0].exits)}",
                   interval=0)
        slot = agent.slots[0]
        assert slot.gave_up and slot.restarts == 3 and len(slot.spawns) == 4
        assert slot.delays == [0.2, 0.4, 0.8]  # exponential backoff
        for exited, delay, respawned in zip(slot.exits, slot.delays, slot.spawns[1:]):
            assert respawned - exited >= delay
        d = watch.wait_for(lambda d: d.job_state == "failed", 30)
        assert "gave up after 3 restarts" in d.reason
        status = r.hgetall(keys.state)
        assert b"InjectedFault" in status[b"first_failure"]
        # the root cause names the rank and the exit code, and keeps the whole traceback
        s = job_status(r, job)
        assert " failed (rank 0): process ended with exit code 1 " in s["first_failure"], s["first_failure"]
        assert s["first_failure_traceback"].startswith("Traceback (most recent call last):")
        assert "InjectedFault" in s["first_failure_traceback"].splitlines()[-1]
        assert f"\n    {s['first_failure_traceback'].splitlines()[-1]}" in format_status(s)
        # every failed process is in the failures stream, with its exit code
        history = r.xrange(keys.failures)
        exits = [h for _, h in history if h.get(b"exit_code") == b"1"]
        assert len(exits) == 4 and all(h[b"rank"] == b"0" and b"InjectedFault" in h[b"traceback"] for h in exits)
        assert s["failures"] == len(history)
        assert int(r.get(keys.epoch)) >= 2  # decided by the replica that took over
