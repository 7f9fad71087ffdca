"""Sharded checkpoints with real processes (issue 28): a job of 2 replica groups x shard_size 2
checkpoints its shards (each member of one replica group writes its own, through
``torch.distributed.checkpoint``'s layout), is stopped, and resumes under another layout: one
replica group of shard_size 4, and data parallelism (shard_size 1). A data-parallel job's
checkpoint resumes under HSDP. In every case the continued trajectory ends (float64) where a
run without the stop ends.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from shoal.core.registry import delete_job

from shoal.storage.uri import open_store
from shoal.storage.verify import read_manifest, verify_checkpoint
from shoal.storage.latest_object import read_latest_step
from shoal.worker import ledger
from tests.helpers import job_spec, run_job

pytestmark = pytest.mark.slow

JOB = dict(entrypoint="shoal.examples.digits:build_double_paced", global_batch_size=48, epochs=10, seed=1,
           max_workers=4)
STOP, END = 12, 24
ENV = {"SHOAL_STEP_PACE": "0"}


def _finals(path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(p, weights_only=True) for p in sorted(path.glob("final-*.pt"))]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _job(r, redis_url, run_dir, name: str, workers: int, shard_size: int, steps: int, ckpt,
         first: int = 1, **fields) -> list[dict]:
    """Run a job to ``steps``; its workers' final states. ``first``: the step it must start
    with (its ledger says so: a resumed job trains no step before its checkpoint). A job of
    that name run before is deleted from Redis first: resuming is the same job starting again
    from its checkpoint store (a checkpoint belongs to its job, storage/ownership.py)."""
    delete_job(r, name)
    spec = job_spec(name, JOB, shard_size=shard_size, min_workers=workers, max_steps=steps,
                    checkpoint_uri=f"file://{ckpt}", checkpoint_interval=STOP, **fields)
    env = {**ENV, "SHOAL_EXPORT_DIR": str(run_dir / "final"), "SHOAL_LEDGER_DIR": str(run_dir / "ledger")}
    watch, _procs, codes = run_job(r, redis_url, run_dir, spec, workers, env)
    assert set(codes.values()) == {0}, codes
    trained = {e["step"] for e in ledger.read(run_dir / "ledger")}
    assert trained == set(range(first, steps + 1))
    finals = _finals(run_dir / "final")
    assert len(finals) == workers
    return finals


def test_a_sharded_checkpoint_resumes_under_another_shard_size_and_as_data_parallelism(
        r, redis_url, tmp_path, job_id) -> None:
    # the run without a stop: one replica group of 2, END steps
    ref = _job(r, redis_url, tmp_path / "ref", job_id + "-ref", 2, 2, END, tmp_path / "ref-ckpt")[0]

    # 2 replica groups x 2 shards, stopped at STOP: its last checkpoint is sharded over 2
    saved = tmp_path / "ckpt"
    _job(r, redis_url, tmp_path / "a", job_id + "-a", 4, 2, STOP, saved)
    store = open_store(str(saved))
    assert read_latest_step(store) == STOP
    manifest = verify_checkpoint(store, STOP)  # every file's size and sha256
    assert manifest.shards == 2
    assert {"shard-0-of-2.bin", "shard-1-of-2.bin", "shard-0-of-2.json", "shard-1-of-2.json"} <= set(manifest.files)
    assert not any(name.endswith(".metadata") or name == "model.pt" for name in manifest.files)

    for name, workers, shard_size in (("s4", 4, 4), ("dp", 2, 1)):
        ckpt = tmp_path / f"ckpt-{name}"
        shutil.copytree(saved, ckpt)
        finals = _job(r, redis_url, tmp_path / name, job_id + "-a", workers, shard_size, END, ckpt, first=STOP + 1)
        for final in finals:
            assert _max_diff(final, ref) < 1e-12, name
        after = open_store(str(ckpt))
        assert read_latest_step(after) == END
        assert read_manifest(after, END).shards == (shard_size if shard_size > 1 else None)


def test_a_data_parallel_checkpoint_resumes_under_hsdp(r, redis_url, tmp_path, job_id) -> None:
    saved = tmp_path / "ckpt"
    ref = _job(r, redis_url, tmp_path / "dp", job_id + "-dp", 2, 1, END, tmp_path / "ref-ckpt")[0]
    _job(r, redis_url, tmp_path / "a", job_id + "-a", 2, 1, STOP, saved)
    assert read_manifest(open_store(str(saved)), STOP).shards is None
    finals = _job(r, redis_url, tmp_path / "b", job_id + "-a", 4, 2, END, saved, first=STOP + 1)
    for final in finals:
        assert _max_diff(final, ref) < 1e-12
    assert read_manifest(open_store(str(saved)), END).shards == 2


def test_a_compiled_jobs_checkpoint_resumes_uncompiled_and_the_other_way_round(r, redis_url, tmp_path, job_id) -> None:
    """``compile: true`` keeps the model's own names (its forward is compiled in place, no
    ``_orig_mod.`` prefix): a compiled HSDP job's sharded checkpoint resumes as an uncompiled
    data-parallel job, and an uncompiled job's checkpoint resumes compiled under HSDP (each
    shard unit compiled before it is sharded). Both end where a run without a stop ends."""
    ref = _job(r, redis_url, tmp_path / "ref", job_id + "-ref", 2, 1, END, tmp_path / "ref-ckpt")[0]
    saved = tmp_path / "ckpt"
    _job(r, redis_url, tmp_path / "a", job_id + "-a", 2, 2, STOP, saved, compile=True)  # compiled HSDP
    assert read_manifest(open_store(str(saved)), STOP).shards == 2
    for final in _job(r, redis_url, tmp_path / "b", job_id + "-a", 2, 1, END, saved, first=STOP + 1):  # eager DP
        assert _max_diff(final, ref) < 1e-9
    again = tmp_path / "ckpt-dp"
    _job(r, redis_url, tmp_path / "c", job_id + "-c", 2, 1, STOP, again)  # eager DP
    for final in _job(r, redis_url, tmp_path / "d", job_id + "-c", 2, 2, END, again, first=STOP + 1, compile=True):
        assert _max_diff(final, ref) < 1e-9
