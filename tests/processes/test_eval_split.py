"""A distributed evaluation (issue 37): ``TrainingSetup.eval_dataset`` is split across the
members like the training data and its sums are all-reduced, so the metrics do not depend on
the world size - one worker and three report the same ``val_loss`` and ``val_accuracy`` (float64,
allclose) for the same steps - and each member evaluates a third of it."""

from __future__ import annotations

import pytest

from shoal.events.keys import job_keys
from shoal.events.records import JobStatus
from tests.helpers import job_spec, run_job

pytestmark = pytest.mark.slow

JOB = dict(entrypoint="tests.entrypoints:digits_split_eval", global_batch_size=48, epochs=10, max_steps=40, seed=1,
           eval_every_steps=20, max_workers=3)


def _evaluations(r, redis_url, run_dir, name: str, workers: int) -> tuple[dict, list[str]]:
    spec = job_spec(name, JOB, min_workers=workers)
    _watch, procs, codes = run_job(r, redis_url, run_dir, spec, workers, {"SHOAL_STEP_PACE": "0"})
    assert set(codes.values()) == {0}, codes
    status = JobStatus.from_hash(r.hgetall(job_keys(name).state))
    logs = [p.log_tail(200) for p in procs.procs if p.name != "coord"]
    return status.eval.metrics, logs


def test_a_distributed_evaluation_gives_the_same_metrics_at_any_world_size(r, redis_url, tmp_path, job_id) -> None:
    one, _ = _evaluations(r, redis_url, tmp_path / "one", job_id + "-1", 1)
    three, logs = _evaluations(r, redis_url, tmp_path / "three", job_id + "-3", 3)
    assert set(one) == {"val_loss", "val_accuracy"} and set(three) == set(one)
    for name in one:
        assert three[name] == pytest.approx(one[name], rel=1e-12), name
    assert 0.0 < one["val_accuracy"] <= 1.0 and one["val_loss"] > 0
    # every member evaluated (the periodic ones and the final one), none reported a failure
    assert all(log.count("evaluated step 20") == 1 for log in logs), logs
    print(f"world 1: {one}; world 3: {three}")
