"""TensorBoard event files of a job (``tensorboard_dir``), read back with TensorBoard's own
reader: real coordinator and worker processes, a second worker joining mid-job. The progress
and log entries those processes wrote are checked against the published wire schema too."""

from __future__ import annotations

import json
import signal

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.events import bus
from shoal.events.keys import job_keys
from shoal.events.models import StopJob
from tests.helpers import ControlWatcher, wait_until
from tests.wire_schema import assert_valid, stream_entries

pytestmark = pytest.mark.slow

SCALARS = {"train/loss", "train/steps_per_s", "train/world_size", "train/generation", "train/lr",
           "eval/accuracy", "eval/loss"}


def _read(path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _worlds(path) -> list[float]:
    acc = _read(path)
    return [e.value for e in acc.Scalars("train/world_size")] if "train/world_size" in acc.Tags()["scalars"] else []


def _step(r, job_id: str, worker: str) -> int:
    raw = r.get(job_keys(job_id).heartbeat(worker))
    return json.loads(raw)["step"] if raw else 0


def test_rank0_writes_scalars_and_membership_changes_that_tensorboard_reads(r, procs, job_id, tmp_path) -> None:
    """Acceptance 4: the event files load in ``EventAccumulator`` with the scalar tags (loss,
    steps/s, world size, generation, lr, the evaluation's metrics) and the second worker's
    join as a text event; world size goes 1 -> 2 at the generation switch. Then rank 0 is
    killed: the survivor, rank 0 of the next generation, goes on in its own event file of the
    same directory (world size 1 again, the failure as text)."""
    tb = tmp_path / "tb"
    spec = JobSpec(name=job_id, entrypoint="tests.entrypoints:slow_digits", epochs=1000, min_workers=1,
                   max_workers=2, global_batch_size=64, heartbeat_interval=0.2, heartbeat_ttl=1.5,
                   eval_every_steps=3, tensorboard_dir=str(tb))
    create_job(r, spec)
    procs.extra_env["SHOAL_TEST_STEP_DELAY"] = "0.02"
    watch = ControlWatcher(r, job_id)
    procs.coordinator("coord")
    first = procs.worker(job_id, "p0")
    watch.wait_for(lambda d: d.world_size == 1, 60)
    wait_until(lambda: _step(r, job_id, "w0") >= 4, 60, "w0 past its first evaluation")
    second = procs.worker(job_id, "p1")
    watch.wait_for(lambda d: d.world_size == 2, 60)
    at_switch = _step(r, job_id, "w0")
    wait_until(lambda: _step(r, job_id, "w0") >= at_switch + 5, 60, "steps in the two-worker generation")
    (w0_file,) = tb.glob("events.out.tfevents.*")  # rank 0 only: w0 (w1 holds rank 1)
    # the two-worker points are on disk (flushed every 2 s) before w0 dies with SIGKILL
    wait_until(lambda: 2 in _worlds(w0_file), 30, "w0's flushed points of the two-worker generation")
    first.signal(signal.SIGKILL)
    watch.wait_for(lambda d: d.world_size == 1, 60)  # (a step-failure generation may come first)
    at_failover = _step(r, job_id, "w1")
    wait_until(lambda: _step(r, job_id, "w1") >= at_failover + 5, 60, "w1's steps as rank 0")
    bus.publish(r, job_keys(job_id).events, StopJob(job_id=job_id))
    assert second.wait(60) == 0 and first.wait(10) == -signal.SIGKILL  # w1 closed its writer on the way out

    files = sorted(tb.glob("events.out.tfevents.*"))
    assert len(files) == 2, f"one event file per rank 0 expected in {tb}: {sorted(tb.iterdir())}"
    acc = _read(tb)
    tags = acc.Tags()
    assert SCALARS <= set(tags["scalars"]), tags["scalars"]
    worlds = [e.value for e in acc.Scalars("train/world_size")]
    assert worlds[0] == 1 and 2 in worlds and worlds[-1] == 1, worlds
    assert all(e.value == pytest.approx(0.1) for e in acc.Scalars("train/lr"))  # digits' SGD lr
    assert all(e.value > 0 for e in acc.Scalars("train/steps_per_s"))
    assert acc.Scalars("train/loss")[-1].step >= at_failover
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("membership/text_summary")]
    # what the real training worker wrote to its streams matches the published schema
    progress = stream_entries(r, job_keys(job_id).progress)
    assert {e.get("kind") for e in progress} == {None, "eval"}
    for entry in progress:
        assert_valid("ProgressEntry", entry)
    for entry in stream_entries(r, job_keys(job_id).logs):
        assert_valid("LogEntry", entry)
    assert "generation 1: world size 1 (w0)" in texts[0], texts
    assert any("w1 joined" in t and "generation 2: world size 2 (w0, w1)" in t for t in texts), texts
    assert "w0" in texts[-1] and "world size 1 (w1)" in texts[-1], texts  # written by w1
