"""Slices sized by speed with real processes (issue 38, item 7): three workers, one of them a
slower machine (its own work takes 3x as long per sample: ``SHOAL_TEST_SAMPLE_DELAY``), train
the float64 digits model once with equal slices and once with ``batch_split: by_speed``.

By speed, the coordinator measures the members' rates from their heartbeats' work counters
and re-plans (a generation of the same members, a re-slice: the members switch to it in
place, in the process group they have, after the step their all-reduce agrees on) with the
slow member's slice smaller; the
global batch never changes, and since shoal sums the losses and divides by the global count,
the final weights equal those of the equal-slices run up to the order of float additions
(float64: allclose at 1e-10). Both runs: every sample exactly once (the ledger), the three
replicas bit-identical. A second test has a worker join a by-speed job after re-slices: that
plan forms a new group, as every membership change does."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.events.models import ShardTable
from shoal.coordinator.shards import count
from shoal.ops.localproc import LocalProcs
from tests.helpers import ControlWatcher, dump_logs, wait_until
from tests.processes.three_workers import exactly_once_and_identical

pytestmark = pytest.mark.slow

STEPS = 36
FAST, SLOW = "0.001", "0.004"  # seconds per sample of own work


def _start(procs: LocalProcs, job: str):
    """A coordinator, two workers and a third that is a slower machine (its own
    ``SHOAL_TEST_SAMPLE_DELAY``); returns the slow one's process."""
    procs.coordinator("coord")
    procs.worker(job, "p0")
    procs.worker(job, "p1")
    procs.extra_env["SHOAL_TEST_SAMPLE_DELAY"] = SLOW  # this process only: a slower machine
    return procs.worker(job, "p2")


def _run(r, redis_url, tmp: Path, job: str, split: str, **spec: object) -> tuple[dict, list[dict], list[ShardTable], int]:
    """One run of the job (``spec``: more fields); returns the final weights, the ledger, the
    published tables and the slow process's pid."""
    create_job(r, JobSpec(name=job, entrypoint="tests.entrypoints:per_sample_double", global_batch_size=48,
                          max_steps=STEPS, min_workers=3, max_workers=3, heartbeat_interval=0.2, heartbeat_ttl=2.0,
                          batch_split=split, batch_split_every=6, prefetch_steps=0, **spec))
    watch = ControlWatcher(r, job)
    env = {"SHOAL_LEDGER_DIR": str(tmp / "ledger"), "SHOAL_EXPORT_DIR": str(tmp / "final"),
           "SHOAL_TEST_SAMPLE_DELAY": FAST}
    with LocalProcs(redis_url, tmp / "logs", extra_env=env) as procs:
        slow = _start(procs, job)
        try:
            watch.wait_for(lambda d: d.job_state == "completed", 180)
            codes = {p.name: p.wait(60) for p in procs.procs if p.name != "coord"}
        except BaseException:
            dump_logs(procs, tmp / "logs")
            raise
    assert codes == {"p0": 0, "p1": 0, "p2": 0}, codes
    entries, finals = exactly_once_and_identical(tmp, STEPS)
    tables = [ShardTable.model_validate_json(f[b"data"]) for _sid, f in r.xrange(job_keys(job).generations)]
    return finals[0], entries, tables, slow.popen.pid


def test_slices_by_speed_give_the_slow_member_less_and_the_same_weights_as_equal_slices(r, redis_url, tmp_path) -> None:
    equal, equal_entries, equal_tables, _ = _run(r, redis_url, tmp_path / "equal", "eq-" + tmp_path.name[-6:], "equal")
    # each member trains exactly its slice (batch_split_steal: false, the default): the plan's
    fast, entries, tables, slow_pid = _run(r, redis_url, tmp_path / "speed", "sp-" + tmp_path.name[-6:], "by_speed",
                                           batch_split_steal=False)
    # equal slices: 16 samples each, every step
    assert {len(e["indices"]) for e in equal_entries} == {16}
    assert len(equal_tables) == 1
    # by speed: a generation of the same three re-planned with the slow member's slice smaller
    slow_id = next(e["worker"] for e in entries if e["pid"] == slow_pid)
    resized = [t for t in tables if len({count(m.ranges) for m in t.members}) > 1]
    assert resized, [t.reason for t in tables]
    committed_in = {e["generation"] for e in entries}
    used = [t for t in resized if t.generation in committed_in]  # the last one may come after the last step
    assert used, (committed_in, [t.generation for t in resized])
    sizes = {m.worker_id: count(m.ranges) for m in used[-1].members}
    assert sizes[slow_id] < min(v for w, v in sizes.items() if w != slow_id), sizes
    assert "slices by speed re-planned at step" in resized[0].reason, resized[0].reason
    # every re-plan of the same members was a re-slice, switched to in place: nobody met at a
    # barrier to form a new group for it (the first generation's barrier is there)
    keys = job_keys(tables[0].job_id)
    assert all(t.continues == t.generation - 1 for t in tables[1:]), [(t.generation, t.continues) for t in tables]
    assert r.exists(keys.barrier(tables[0].generation))
    assert not any(r.exists(keys.barrier(t.generation)) for t in tables[1:])
    # ... and every committed slice is its generation's: each member switched at the step
    # all agreed on (the ledger's steps are exactly once, below, so nobody used old ranges)
    by_generation = {t.generation: {m.worker_id: count(m.ranges) for m in t.members} for t in tables}
    assert all(len(e["indices"]) == by_generation[e["generation"]][e["worker"]] for e in entries)
    # the same global batches, the same update: float64 weights allclose
    assert sorted({e["step"]: e["cursor"] for e in entries}.items()) == sorted(
        {e["step"]: e["cursor"] for e in equal_entries}.items())
    diff = max((fast[k].double() - equal[k].double()).abs().max().item() for k in equal)
    assert all(torch.allclose(fast[k].double(), equal[k].double(), rtol=1e-9, atol=1e-10) for k in equal), diff
    print(f"largest difference of a weight, by speed vs equal slices: {diff:.3g}")


@pytest.mark.parametrize("steal", [False, True], ids=["slices", "steal"])
def test_a_join_after_re_slices_forms_a_new_group_and_every_sample_is_trained_once(r, redis_url, tmp_path,
                                                                                   steal) -> None:
    """A by-speed job of two members re-slices in place; a third worker then joins: that plan
    is no re-slice, so both members leave their group and form the new one with the joiner
    (the switch that reads the next table first, then leaves). The ledger is exactly once and
    the three replicas end bit-identical. Without balancing within the step, every committed
    slice is its generation's; with it (``steal``), the first step of the group formed with
    the joiner behind - the others split its batch by themselves - is not balanced (every rank
    on the split it was told), the others may be."""
    job = "spj-" + tmp_path.name[-6:]
    steps = 800  # long enough for the joiner to start (seconds on a busy box)
    create_job(r, JobSpec(name=job, entrypoint="tests.entrypoints:per_sample_double", global_batch_size=48,
                          max_steps=steps, epochs=10, min_workers=2, max_workers=3, heartbeat_interval=0.2,
                          heartbeat_ttl=2.0,
                          batch_split="by_speed", batch_split_every=6, prefetch_steps=0, batch_split_steal=steal))
    watch = ControlWatcher(r, job)
    env = {"SHOAL_LEDGER_DIR": str(tmp_path / "ledger"), "SHOAL_EXPORT_DIR": str(tmp_path / "final"),
           "SHOAL_TEST_SAMPLE_DELAY": FAST}
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        procs.worker(job, "p0")
        procs.extra_env["SHOAL_TEST_SAMPLE_DELAY"] = SLOW
        procs.worker(job, "p1")
        try:
            first = watch.wait_for(lambda d: d.world_size == 2, 120).generation
            watch.wait_for(lambda d: d.generation > first, 120)  # a re-slice of the two
            procs.extra_env["SHOAL_TEST_SAMPLE_DELAY"] = FAST
            procs.worker(job, "p2")
            watch.wait_for(lambda d: d.world_size == 3, 120)
            watch.wait_for(lambda d: d.job_state == "completed", 180)
            codes = {p.name: p.wait(60) for p in procs.procs if p.name != "coord"}
        except BaseException:
            dump_logs(procs, tmp_path / "logs")
            raise
    assert codes == {"p0": 0, "p1": 0, "p2": 0}, codes
    entries, finals = exactly_once_and_identical(tmp_path, steps)
    tables = {t.generation: t for t in (ShardTable.model_validate_json(f[b"data"])
                                        for _sid, f in r.xrange(job_keys(job).generations))}
    keys = job_keys(job)
    resliced = [t for t in tables.values() if t.continues]
    joined = [t for t in tables.values() if t.world_size == 3]
    assert resliced and joined and joined[0].continues == 0
    # a re-slice keeps its predecessor's members and ranks and forms no group; the join's does
    for t in resliced:
        assert [(m.worker_id, m.rank) for m in t.members] == [(m.worker_id, m.rank) for m in tables[t.continues].members]
        assert not r.exists(keys.barrier(t.generation))
    assert r.exists(keys.barrier(joined[0].generation))
    # every committed slice is its generation's, but for the first step of a group formed with a
    # joiner behind (it takes no samples while it receives the state; the others split the batch)
    by_generation = {g: {m.worker_id: m.ranges for m in t.members} for g, t in tables.items()}

    def size(e) -> int:  # its ranges' positions in its batch (an epoch's last batch is short)
        return sum(len(range(a, min(b, e["count"]), s)) for a, b, s in by_generation[e["generation"]][e["worker"]])

    first = {}
    for e in entries:
        first[e["generation"]] = min(first.get(e["generation"], e["step"]), e["step"])
    checked = [e for e in entries if tables[e["generation"]].continues or e["step"] != first[e["generation"]]]
    if not steal:
        assert all(len(e["indices"]) == size(e) for e in checked)
        assert {e["generation"] for e in checked} == set(first)
        return
    # the joined group's first step: the two up to date split the batch in halves, the joiner none
    g = joined[0].generation
    firsts = sorted((e["worker"], len(e["indices"])) for e in entries if e["generation"] == g and e["step"] == first[g])
    assert sorted(n for _w, n in firsts) in ([0, 24, 24], [24, 24]), firsts
    # ... and the slow member (p1) trained less than its slices in some step: the others took chunks
    assert any(len(e["indices"]) < size(e) for e in checked), [(e["step"], len(e["indices"]), size(e)) for e in checked]


def test_members_done_with_their_slice_take_chunks_of_the_slow_ones_within_the_step(r, redis_url, tmp_path) -> None:
    """Slices by speed evened out within each step (``batch_split_steal: true``): every
    slice is cut in chunks of 8 samples claimed in the generation's store, and a member done
    with its own takes the chunks still untaken of the others'. The slow member (4x slower per
    sample) then trains fewer samples than its slice - on equal slices (the first generation,
    before any rate is known) and after re-plans - and the others more; every sample is still
    trained exactly once (the ledger), the replicas are bit-identical after every step, and the
    weights equal those of equal slices (float64, allclose)."""
    equal, equal_entries, _, _ = _run(r, redis_url, tmp_path / "equal", "eq-" + tmp_path.name[-6:], "equal")
    stolen, entries, tables, slow_pid = _run(r, redis_url, tmp_path / "steal", "st-" + tmp_path.name[-6:], "by_speed",
                                             batch_split_steal=True)
    slow_id = next(e["worker"] for e in entries if e["pid"] == slow_pid)
    planned = {t.generation: {m.worker_id: count(m.ranges) for m in t.members} for t in tables}
    slow = [e for e in entries if e["worker"] == slow_id]
    short = [e["step"] for e in slow if len(e["indices"]) < planned[e["generation"]][slow_id]]
    assert short, [(e["step"], len(e["indices"]), planned[e["generation"]][slow_id]) for e in slow]
    # what the slow member did not train of its slice, the others did, in the same step
    for step in short:
        others = [e for e in entries if e["step"] == step and e["worker"] != slow_id]
        assert sum(len(e["indices"]) for e in others) > sum(planned[e["generation"]][e["worker"]] for e in others)
    # equal slices' first generation, where the slow member's slice is as large as the others'
    assert any(e["generation"] == tables[0].generation for e in slow if e["step"] in short), short
    assert sorted({e["step"]: e["cursor"] for e in entries}.items()) == sorted(
        {e["step"]: e["cursor"] for e in equal_entries}.items())
    diff = max((stolen[k].double() - equal[k].double()).abs().max().item() for k in equal)
    assert all(torch.allclose(stolen[k].double(), equal[k].double(), rtol=1e-9, atol=1e-10) for k in equal), diff


def test_a_member_killed_mid_step_while_others_take_its_chunks_costs_one_redone_step(r, redis_url, tmp_path) -> None:
    """Slices by speed evened out within the step, three members, the slow one killed with
    SIGKILL while the job runs (most of a step is its members' work, so the kill lands inside
    one, where the others may hold claims on the dead member's chunks): that step fails in the
    group, nothing applied; the coordinator re-plans without it and the two survivors redo the
    step under another key (a new generation) and finish the job. Every sample exactly once
    (the ledger, with the dead member's committed steps), the survivors bit-identical."""
    from shoal.worker import ledger

    job = "spk-" + tmp_path.name[-6:]
    steps = 120
    create_job(r, JobSpec(name=job, entrypoint="tests.entrypoints:per_sample_double", global_batch_size=48,
                          max_steps=steps, epochs=10, min_workers=2, max_workers=3, heartbeat_interval=0.2,
                          heartbeat_ttl=2.0, batch_split="by_speed", batch_split_every=6, prefetch_steps=0,
                          batch_split_steal=True))
    watch = ControlWatcher(r, job)
    run = tmp_path / "run"
    env = {"SHOAL_LEDGER_DIR": str(run / "ledger"), "SHOAL_EXPORT_DIR": str(run / "final"),
           "SHOAL_TEST_SAMPLE_DELAY": FAST}
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        slow = _start(procs, job)
        try:
            three = watch.wait_for(lambda d: d.world_size == 3, 120).generation
            # ten steps committed by the three (the slow one's chunks taken by the others in some)
            wait_until(lambda: len({e["step"] for e in ledger.read(run / "ledger") if e["generation"] >= three}) >= 10,
                       120, "ten steps of the generation of three")
            os.kill(slow.popen.pid, signal.SIGKILL)
            after = watch.wait_for(lambda d: d.world_size == 2 and d.generation > three, 60)
            watch.wait_for(lambda d: d.job_state == "completed", 180)
            codes = {p.name: p.wait(60) for p in procs.procs if p.name in ("p0", "p1")}
        except BaseException:
            dump_logs(procs, tmp_path / "logs")
            raise
    assert codes == {"p0": 0, "p1": 0}, codes
    entries, _finals = exactly_once_and_identical(run, steps, workers=2)
    slow_id = next(e["worker"] for e in entries if e["pid"] == slow.popen.pid)
    killed_at = max(e["step"] for e in entries if e["worker"] == slow_id)
    # the survivors went on in the generation of two from the step after the dead member's
    # last (or the one after it, when its ledger line of that last step was cut by the kill)
    resumed = min(e["step"] for e in entries if e["generation"] >= after.generation)
    assert resumed in (killed_at + 1, killed_at + 2), (killed_at, resumed)
    assert all(e["worker"] != slow_id for e in entries if e["step"] > killed_at)
    planned = {t.generation: {m.worker_id: count(m.ranges) for m in t.members}
               for t in (ShardTable.model_validate_json(f[b"data"]) for _sid, f in r.xrange(job_keys(job).generations))}
    stole = [e["step"] for e in entries if e["generation"] >= three and e["worker"] == slow_id
             and len(e["indices"]) < planned[e["generation"]][slow_id]]
    assert stole, "the others never took a chunk of the slow member's slice"
