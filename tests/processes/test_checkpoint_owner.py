"""A checkpoint belongs to its job; warm starts are asked for (issue 35), with real processes:

- job A (data parallel) trains to completion with checkpoints;
- job B, another name and A's ``checkpoint_uri``: ``shoal submit`` refuses it with one line
  naming both jobs and the fix, registering nothing; registered anyway (bypassing the
  check), its worker refuses to load A's checkpoint and exits with that line, loading nothing;
- job C, ``init_from: <A's store>``: starts at step 0 with A's final weights (the weights its
  workers' first step starts from equal A's, bit for bit), trains its own steps exactly once,
  and its checkpoints are its own;
- job D, HSDP (shard_size 2), ``init_from`` A's data-parallel checkpoint with its optimizer
  state: starts at step 0 from A's weights; job E, data parallel, ``init_from`` D's sharded
  checkpoint: starts at step 0 from D's final weights.
"""

from __future__ import annotations

import pytest
import torch

from shoal.core.registry import create_job
from shoal.ops.localproc import LocalProcs
from shoal.ops.submit import check_runnable
from shoal.storage.local import LocalStore
from shoal.storage.ownership import Owner, checkpoint_owner
from shoal.storage.verify import read_manifest
from shoal.worker import ledger
from tests.cli.test_bad_input_cli import one_line_error
from tests.helpers import job_spec, run_job
from tests.helpers import run_cli as shoal

pytestmark = pytest.mark.slow

JOB = dict(entrypoint="tests.entrypoints:first_step_digits", global_batch_size=32, min_workers=2, max_workers=2,
           checkpoint_interval=5)
ENV = {"SHOAL_TEST_STEP_DELAY": "0.01"}
A_STEPS, C_STEPS = 12, 6


def _train(r, redis_url, tmp_path, name: str, steps: int, **fields) -> dict[str, torch.Tensor]:
    """Run job ``name`` to completion with 2 workers; its final weights (every worker's equal)."""
    run = tmp_path / name
    spec = job_spec(name, JOB, max_steps=steps, checkpoint_uri=f"file://{run / 'ckpt'}", **fields)
    check_runnable(spec)  # what `shoal submit` checks: passes
    env = {**ENV, "SHOAL_EXPORT_DIR": str(run / "final"), "SHOAL_LEDGER_DIR": str(run / "ledger"),
           "SHOAL_TEST_FIRST_DIR": str(run / "first")}
    watch, _procs, codes = run_job(r, redis_url, run, spec, 2, env)
    assert watch.seen[-1].job_state == "completed" and set(codes.values()) == {0}, codes
    finals = [torch.load(p, weights_only=True) for p in sorted((run / "final").glob("final-*.pt"))]
    assert len(finals) == 2 and all(torch.equal(f[k], finals[0][k]) for f in finals for k in f)
    # its own steps, exactly once, from step 0; its checkpoints are its own
    entries = ledger.read(run / "ledger")
    verdict = ledger.verify(entries, 5000)
    assert verdict.ok and verdict.steps == steps, verdict.problem
    assert min(e["step"] for e in entries) == 1
    assert checkpoint_owner(LocalStore(run / "ckpt")) == Owner(steps, name)
    return finals[0]


def _starts_from(tmp_path, name: str, weights: dict[str, torch.Tensor]) -> None:
    """Every worker of job ``name`` started its first step from ``weights``."""
    firsts = [torch.load(p, weights_only=True) for p in sorted((tmp_path / name / "first").glob("first-*.pt"))]
    assert len(firsts) == 2
    for first in firsts:
        assert first.keys() == weights.keys()
        assert all(torch.equal(first[k], weights[k]) for k in weights), "a worker did not start from those weights"


def test_a_job_resumes_only_its_own_checkpoints_and_init_from_warm_starts(r, redis_url, cli_env, tmp_path,
                                                                           job_id) -> None:
    a, b, c = f"{job_id}-a", f"{job_id}-b", f"{job_id}-c"
    final_a = _train(r, redis_url, tmp_path, a, A_STEPS)
    store_a = f"file://{tmp_path / a / 'ckpt'}"
    assert read_manifest(LocalStore(tmp_path / a / "ckpt"), A_STEPS).job_id == a

    # B reuses A's checkpoint_uri: refused at submit, nothing registered
    spec_b = tmp_path / "b.yaml"
    spec_b.write_text(f"name: {b}\nentrypoint: {JOB['entrypoint']}\ncheckpoint_uri: {store_a}\n")
    line = one_line_error(shoal(cli_env, "submit", str(spec_b)), 2, f"job '{a}'", f"job '{b}'",
                          "its own checkpoint_uri", f"init_from: {store_a}")
    assert not r.exists(f"shoal:{{{b}}}:spec") and "step 12" in line
    # registered anyway: its worker refuses to load A's checkpoint, with the same line
    create_job(r, job_spec(b, JOB, max_steps=A_STEPS + 5, min_workers=1, checkpoint_uri=store_a))
    with LocalProcs(redis_url, tmp_path / b / "logs", extra_env=ENV) as procs:
        procs.coordinator("coord")
        worker = procs.worker(b, "p0")
        assert worker.wait(120) == 2, worker.log_tail(40)
        assert f"job '{a}'" in worker.log_tail(40) and f"job '{b}'" in worker.log_tail(40)
    assert checkpoint_owner(LocalStore(tmp_path / a / "ckpt")) == Owner(A_STEPS, a)  # untouched

    # init_from a store with no checkpoint: refused at submit
    (tmp_path / "empty").mkdir()
    spec_c = tmp_path / "c.yaml"
    spec_c.write_text(f"name: {c}\nentrypoint: {JOB['entrypoint']}\ninit_from: file://{tmp_path / 'empty'}\n")
    one_line_error(shoal(cli_env, "submit", str(spec_c)), 2, "holds no checkpoint to start from")
    # C starts from A's weights at step 0
    _train(r, redis_url, tmp_path, c, C_STEPS, init_from=store_a)
    _starts_from(tmp_path, c, final_a)


def test_warm_starts_between_data_parallel_and_sharded_checkpoints(r, redis_url, tmp_path, job_id) -> None:
    a, d, e = f"{job_id}-a", f"{job_id}-d", f"{job_id}-e"
    final_a = _train(r, redis_url, tmp_path, a, A_STEPS)
    # HSDP from a data-parallel checkpoint, with its optimizer state
    final_d = _train(r, redis_url, tmp_path, d, C_STEPS, shard_size=2, init_from=f"file://{tmp_path / a / 'ckpt'}",
                     init_from_optimizer=True)
    _starts_from(tmp_path, d, final_a)
    assert read_manifest(LocalStore(tmp_path / d / "ckpt"), C_STEPS).shards == 2
    # data parallel from a sharded checkpoint
    _train(r, redis_url, tmp_path, e, C_STEPS, init_from=f"file://{tmp_path / d / 'ckpt'}")
    _starts_from(tmp_path, e, final_d)
