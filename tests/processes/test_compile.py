"""A compiled model through a kill, a join and a graceful leave (issue 37), with real processes.

``compile: true``: each worker compiles the model's forward on the job's fixed micro-batch
(16 = ceil(48 / max_workers 3)) before it joins - from the compile cache in the checkpoint
store when the first worker to compile left one there (HMAC-signed) - and trains every slice
in micro-batches of that shape, the short one padded. Each worker here has a cache directory of
its own (as on separate nodes), so the joiner can only be warm through the store.

Checked: the job completes, every sample exactly once; no worker compiles again after its
warm-up (dynamo's frames, logged and published with the heartbeat) - not at the kill, the join
or the leave, though the slices changed from 24 to 16 samples; the joiner loaded the store's
compile cache; and the final parameters match a failure-free, uncompiled single-process run
(float64; inductor may order a sum differently: allclose). The pause the join costs the
survivors, compiled against uncompiled, and the cold/warm compile times are figures of
``bench/compile_elastic.py``, not timed assertions here.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.events.records import WorkerRecord
from shoal.events.states import WorkerState
from shoal.ops.chaos.soak import reference_parameters
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger
from tests.helpers import ControlWatcher, wait_until

pytestmark = pytest.mark.slow

DIGITS = 5000
STEPS = 400
BATCH = 48
JOB = dict(entrypoint="shoal.examples.digits:build_double_paced", global_batch_size=BATCH, min_workers=2,
           max_workers=3, heartbeat_interval=0.2, heartbeat_ttl=1.5, seed=1, epochs=10, max_steps=STEPS,
           compile=True, checkpoint_interval=1000)


def _active(r, job: str) -> list[WorkerRecord]:
    recs = (WorkerRecord.from_json(v) for v in r.hgetall(job_keys(job).workers).values())
    return sorted((x for x in recs if x.state == WorkerState.ACTIVE), key=lambda x: x.worker_id)


def _high(r, job: str) -> int:
    return int(r.hget(job_keys(job).state, "high_step") or 0)


def test_a_compiled_job_never_recompiles_through_a_kill_a_join_and_a_leave(r, redis_url, tmp_path, job_id) -> None:
    create_job(r, JobSpec(name=job_id, checkpoint_uri=f"file://{tmp_path / 'ckpt'}", **JOB))
    watch = ControlWatcher(r, job_id)
    pace = tmp_path / "pace"  # the paced example re-reads it every second
    pace.write_text("0.15")  # slow while the faults come: the job must outlast a joiner's start
    base = {"SHOAL_LEDGER_DIR": str(tmp_path / "ledger"), "SHOAL_EXPORT_DIR": str(tmp_path / "final"),
            "SHOAL_STEP_PACE": "0.15", "SHOAL_STEP_PACE_FILE": str(pace),
            "SHOAL_CHECKPOINT_HMAC_KEY": "compile-cache-test-key"}

    def node(name: str) -> LocalProcs:
        """Processes of one 'node': an inductor cache directory of its own."""
        return LocalProcs(redis_url, tmp_path / "logs", extra_env={**base, "TORCHINDUCTOR_CACHE_DIR":
                                                                   str(tmp_path / f"inductor-{name}")})

    nodes = {name: node(name) for name in ("coord", "a", "b", "c", "d")}
    procs = {}
    try:
        nodes["coord"].coordinator("coord")
        for name in ("a", "b", "c"):
            procs[name] = nodes[name].worker(job_id, f"worker-{name}")
        watch.wait_for(lambda d: d.world_size == 3, 240)
        wait_until(lambda: _high(r, job_id) >= 20, 120, "step 20 with 3 members")
        victim = _active(r, job_id)[-1]
        os.kill(victim.pid, signal.SIGKILL)
        watch.wait_for(lambda d: victim.worker_id in d.failed, 30)
        procs["d"] = nodes["d"].worker(job_id, "worker-d")  # a joiner, with a cold local cache
        watch.wait_for(lambda d: d.world_size == 3 and d.joined, 240)
        before = _high(r, job_id)
        wait_until(lambda: _high(r, job_id) >= before + 10, 120, "ten steps with the joiner")
        leaver = next(x for x in _active(r, job_id) if x.pid != procs["d"].pid)
        os.kill(leaver.pid, signal.SIGTERM)  # a graceful leave
        watch.wait_for(lambda d: d.left, 60)
        pace.write_text("0")  # the faults are over: the rest at full speed
        end = watch.wait_for(lambda d: d.job_state in ("completed", "failed"), 240)
        assert end.job_state == "completed", end.reason
    finally:
        for ps in nodes.values():
            ps.stop_all()
    logs = {name: (tmp_path / "logs" / f"worker-{name}.log").read_text() for name in ("a", "b", "c", "d")}
    for name, text in logs.items():
        assert "compiled for micro-batches of 16" in text, (name, text[-2000:])
        assert "recompiled" not in text, (name, [ln for ln in text.splitlines() if "recompiled" in ln])
    assert "compile cache: loaded" in logs["d"], logs["d"][-3000:]  # from the store: its own directory was empty
    verdict = ledger.verify(ledger.read(tmp_path / "ledger"), DIGITS)
    assert verdict.ok, verdict.problem
    assert verdict.steps == STEPS
    reference = reference_parameters(STEPS, 1, BATCH)
    finals = [torch.load(p, weights_only=True) for p in sorted((tmp_path / "final").glob("final-*.pt"))]
    assert finals
    for f in finals:
        assert all(torch.equal(f[k], finals[0][k]) for k in f)  # replicas bit-identical
        diff = max((f[k].double() - reference[k].double()).abs().max().item() for k in reference)
        print(f"compiled vs a failure-free, uncompiled run: max |diff| {diff:.1e}")
        assert diff < 1e-9
