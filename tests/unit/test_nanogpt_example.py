"""``examples/nanogpt.py``: its job file reads with every issue-37 field, its ``params`` reach
``build``'s keyword arguments, and the model trains (its loss falls over a few local steps) and
evaluates through the distributed evaluation's sums."""

from __future__ import annotations

from shoal.core.jobspec import load_spec
from shoal.worker.engine import StepEngine
from shoal.worker.userapi import load_entrypoint
from tests.helpers import ROOT


def test_the_job_file_holds_compile_params_evaluation_and_the_best_checkpoint_policy() -> None:
    spec = load_spec(ROOT / "examples" / "nanogpt.yaml")
    assert spec.compile_options is not None and spec.params["n_layer"] == 4 and spec.params["lr"] == 1e-3
    assert spec.checkpoint_keep_best.metric == "val_loss" and spec.eval_every_steps == 100


def test_params_reach_build_and_a_few_local_steps_lower_the_loss() -> None:
    setup = load_entrypoint("shoal.examples.nanogpt:build", 0,
                            params={"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 16, "max_bytes": 20_000})
    assert len(setup.model.blocks) == 1 and setup.dataset.block_size == 16
    engine = StepEngine.from_setup(setup, require_group=False)
    losses = [engine.step(list(range(8 * i, 8 * i + 8)), 8, 0).loss for i in range(12)]
    assert losses[-1] < losses[0]
    names, total = engine.eval_sums(setup.eval_dataset, setup.eval_sums, 16, range(len(setup.eval_dataset)), 4)
    assert names == ["loss"] and total[0] == min(64, len(setup.eval_dataset)) and total[1] > 0
