"""fp16 with real workers (issue 17): the LM example trains in fp16, overflow steps are skipped
by every rank alike, and the loss scale survives a full restart (from the checkpoint) and a
join (from a peer's state).

The run: two workers train a tiny configuration of examples/lm.py in fp16 and checkpoint every
10 steps; both are killed (-9); a new worker resumes alone from LATEST and a second one joins
it; they finish. Every worker's ledger records, per committed step, the scale it used, whether
the step was skipped and the scale's state after it, so the test reads the whole story from the
ledgers: a fresh scaler (2^16, tracker 0) anywhere it should not be would show.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.examples import lm
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger
from shoal.worker.precision import LossScale
from shoal.worker.userapi import TrainingSetup
from tests.helpers import ControlWatcher, dump_logs

pytestmark = pytest.mark.slow

#: examples/lm.py, 1 layer of d_model 32 on 16-byte windows of the first 32 KB of the corpus
TINY = {"SHOAL_LM_LAYERS": "1", "SHOAL_LM_D_MODEL": "32", "SHOAL_LM_HEADS": "2", "SHOAL_LM_SEQ_LEN": "16",
        "SHOAL_LM_LR": "1e-2"}
FRESH = LossScale().state_dict()


#: a batch holding a sample whose id is a multiple of this overflows (about one step in six)
POISON_EVERY = 97


class _Overflow(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient by inf: a gradient overflow with
    a finite loss, as fp16 overflows are."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


class _WithIds(torch.utils.data.Dataset):
    def __init__(self, base: torch.utils.data.Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return x, y, i


def tiny_lm() -> TrainingSetup:
    """The LM example whose gradient overflows on the rank that holds a poisoned sample: the
    other ranks' gradients stay finite, the reduced one is not."""
    setup = lm.build(max_bytes=32_000)
    loss_fn = setup.loss_fn
    delay = float(os.environ["SHOAL_TEST_STEP_DELAY"])  # time to restart and join mid-run

    def step_fn(model: torch.nn.Module, batch) -> torch.Tensor:
        x, y, ids = batch
        time.sleep(delay)
        loss = loss_fn(model(x), y)
        return _Overflow.apply(loss) if bool((ids % POISON_EVERY == 0).any()) else loss

    setup.dataset, setup.loss_fn, setup.step_fn = _WithIds(setup.dataset), None, step_fn
    return setup


def _by_step(entries: list[dict]) -> dict[tuple[int, int], list[dict]]:
    """Entries grouped by (generation, step): the killed run and the resumed run each commit
    the steps after the checkpoint, in different generations."""
    out: dict[tuple[int, int], list[dict]] = {}
    for e in entries:
        out.setdefault((e["generation"], e["step"]), []).append(e)
    return out


def test_fp16_lm_skips_overflows_everywhere_and_its_scale_survives_a_restart_and_a_join(
        r, redis_url, tmp_path: Path) -> None:
    job = "fp16-" + tmp_path.name[-8:]
    ckpt = f"file://{tmp_path / 'ckpt'}"
    spec = JobSpec(name=job, entrypoint="tests.processes.test_fp16_processes:tiny_lm", precision="fp16",
                   min_workers=1, max_workers=2, global_batch_size=16, epochs=2, max_steps=150, seed=3,
                   heartbeat_interval=0.2, heartbeat_ttl=1.5, checkpoint_uri=ckpt, checkpoint_interval=10)
    create_job(r, spec)
    watch = ControlWatcher(r, job)
    env = {**TINY, "SHOAL_LEDGER_DIR": str(tmp_path / "ledger"), "SHOAL_EXPORT_DIR": str(tmp_path / "final"),
           "SHOAL_TEST_STEP_DELAY": "0.08"}
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        first = [procs.worker(job, f"p{i}") for i in range(2)]
        try:
            watch.wait_for(lambda d: d.world_size == 2, 120)
            moved = watch.wait_for(lambda d: (d.latest_step or 0) >= 20, 120)
            for p in first:  # a full restart: every worker gone at once
                p.signal(signal.SIGKILL)
            for p in first:
                p.wait(30)
            resumed = procs.worker(job, "r0")
            watch.wait_for(lambda d: d.world_size == 1, 120)
            watch.wait_for(lambda d: d.kind == "ready", 60)
            joiner = procs.worker(job, "r1")
            watch.wait_for(lambda d: d.world_size == 2, 120)
            watch.wait_for(lambda d: d.job_state == "completed", 240)
            codes = {p.name: p.wait(60) for p in (resumed, joiner)}
        except BaseException:
            dump_logs(procs, tmp_path / "no-agent")
            raise
    assert codes == {"r0": 0, "r1": 0}
    checkpoint_step = moved.latest_step
    entries = ledger.read(tmp_path / "ledger")
    assert entries and all("loss_scale" in e and "scale_after" in e for e in entries)

    # every rank of a step agrees on the scale it used, the skip and the scale after it
    steps = _by_step(entries)
    for (gen, step), group in steps.items():
        seen = {(e["loss_scale"], e["skipped"], tuple(sorted(e["scale_after"].items()))) for e in group}
        assert len(seen) == 1, f"generation {gen} step {step}: ranks disagree: {group}"
    skipped = sorted({step for (_, step), g in steps.items() if g[0]["skipped"]})
    assert min(skipped) < checkpoint_step  # so the checkpointed scale is not a fresh scaler's
    # an overflow on one rank only (the other's gradient finite) is skipped by both
    one_rank = [step for (_, step), g in steps.items() if g[0]["skipped"] and len(g) == 2
                and sum(any(i % POISON_EVERY == 0 for i in e["indices"]) for e in g) == 1]
    assert one_rank, f"no step where only one rank overflowed: {skipped}"
    for (_, step), g in steps.items():  # skipped exactly where a poisoned sample was
        assert g[0]["skipped"] == any(i % POISON_EVERY == 0 for i in g[0]["batch"]), (step, g[0])

    # the resume: r0's first step uses the scale the checkpointed step left
    first_pids = {p.pid for p in first}
    killed_run = {e["step"]: e for e in entries if e["pid"] in first_pids}
    at_checkpoint = killed_run[checkpoint_step]["scale_after"]
    assert at_checkpoint != FRESH
    later = [e for e in entries if e["pid"] not in first_pids]
    resumed_first = min(later, key=lambda e: e["step"])
    assert resumed_first["step"] == checkpoint_step + 1, resumed_first
    assert resumed_first["loss_scale"] == at_checkpoint["scale"]
    expected = LossScale(**at_checkpoint)
    expected.update(found_inf=resumed_first["skipped"])
    assert resumed_first["scale_after"] == expected.state_dict()

    # the join: the joiner's first step agrees with r0's (checked above) and is not a fresh scaler's
    joined = [e for e in later if e["world"] == 2]
    assert joined, "no step with the joiner"
    assert len({e["pid"] for e in joined}) == 2
    first_joined = min(e["step"] for e in joined)
    assert [e["scale_after"] for e in joined if e["step"] == first_joined][0] != FRESH

    # the replicas are bit-identical
    finals = [torch.load(f, weights_only=True) for f in sorted((tmp_path / "final").glob("final-*.pt"))]
    assert len(finals) == 2
    for name in finals[0]:
        assert torch.equal(finals[0][name], finals[1][name]), name
