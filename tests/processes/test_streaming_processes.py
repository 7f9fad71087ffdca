"""Streaming datasets with real workers (issue 15): the shard-aware order and the split of each
global batch by shard owner, through joins, kills and leaves mid-epoch.

Checked on the end state: the ledgers (every sample exactly once per epoch, each step's slices
partitioning its batch), the global batches step by step against a run with another, fixed
world size, and the shard owners in the tables (sticky: only a leaver's shards move).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from shoal.coordinator.owners import from_ranges
from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.events.models import ShardTable
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger
from tests.helpers import ControlWatcher, wait_until

pytestmark = pytest.mark.slow

NUM_SAMPLES = 5000


def _spec(job: str, **kw) -> JobSpec:
    base = dict(name=job, entrypoint="tests.entrypoints:stream_digits", min_workers=1, max_workers=3,
                global_batch_size=64, epochs=2, heartbeat_interval=0.2, heartbeat_ttl=1.5, seed=11,
                loader_workers=1, prefetch_steps=2)
    return JobSpec(**(base | kw))


def _run(r, redis_url, tmp: Path, spec: JobSpec, workers: int, script=None, delay: str = "0.03"):
    create_job(r, spec)
    watch = ControlWatcher(r, spec.name)
    env = {"SHOAL_LEDGER_DIR": str(tmp / "ledger"), "SHOAL_TEST_STEP_DELAY": delay,
           "SHOAL_TEST_STREAM_STATS": str(tmp / "stats")}
    with LocalProcs(redis_url, tmp / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        ws = [procs.worker(spec.name, f"p{i}") for i in range(workers)]
        try:
            if script:
                script(watch, procs, ws)
            watch.wait_for(lambda d: d["job_state"] == "completed", 240)
            codes = {p.name: p.wait(60) for p in procs.procs if p.name != "coord"}
        except BaseException:
            for p in procs.procs:
                print(f"===== {p.name}\n{p.log_tail(30)}")
            raise
    return watch, procs, codes


def _tables(r, job: str) -> list[ShardTable]:
    return [ShardTable.model_validate_json(f[b"data"]) for _id, f in r.xrange(job_keys(job).generations)]


def test_kill_join_and_leave_mid_epoch_exactly_once_and_same_batches_as_a_fixed_world(r, redis_url, tmp_path):
    job = "stream-" + tmp_path.name[-8:]

    def script(watch, procs, ws):
        watch.wait_for(lambda d: "world size 2" in d["reason"], 120)
        joiner = procs.worker(job, "joiner")  # a join mid-epoch
        watch.wait_for(lambda d: "world size 3" in d["reason"], 60)
        watch.wait_for(lambda d: d["kind"] == "ready" and "w2 active" in d["reason"], 60)
        wait_until(lambda: any(e["world"] == 3 for e in ledger.read(tmp_path / "elastic" / "ledger")), 60,
                   "a step committed by three workers")
        joiner.signal(signal.SIGKILL)  # a failure
        watch.wait_for(lambda d: "w2 failed" in d["reason"], 60)
        ws[0].signal(signal.SIGTERM)  # a graceful leave
        watch.wait_for(lambda d: " left" in d["reason"], 60)

    _, _, codes = _run(r, redis_url, tmp_path / "elastic", _spec(job), 2, script)
    assert codes["p0"] == 0 and codes["p1"] == 0
    entries = ledger.read(tmp_path / "elastic" / "ledger")
    verdict = ledger.verify(entries, NUM_SAMPLES)
    assert verdict.ok, verdict.problem
    assert verdict.epochs_complete == 2 and verdict.steps == 2 * 79
    assert {e["world"] for e in entries} >= {2, 3, 1}  # trained at three world sizes

    # owners: every table covers each shard once, and membership changes move only what they must
    tables = [t for t in _tables(r, job) if not t.paused]
    assert all(t.shard_owners is not None for t in tables)
    for t in tables:
        shards = sorted(s for ranges in t.shard_owners.values() for s in from_ranges(ranges))
        assert shards == list(range(100))
    for before, after in zip(tables, tables[1:]):
        left = set(before.shard_owners) - set(after.shard_owners)
        joined = set(after.shard_owners) - set(before.shard_owners)
        if left and not joined:  # survivors keep all theirs
            for w in after.shard_owners:
                assert set(from_ranges(before.shard_owners[w])) <= set(from_ranges(after.shard_owners[w]))

    # the same job with one worker, no membership change: identical global batches step by step
    fixed = job + "-w1"
    _run(r, redis_url, tmp_path / "fixed", _spec(fixed, max_workers=1), 1, delay="0")
    ref = {e["step"]: e["batch"] for e in ledger.read(tmp_path / "fixed" / "ledger")}
    got = {e["step"]: e["batch"] for e in entries}
    assert len(ref) == len(got) == 2 * 79
    assert got == ref
