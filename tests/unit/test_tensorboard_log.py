"""Rank 0's TensorBoard writer (shoal.worker.tensorboard) in-process: what it writes, read back
with TensorBoard's own reader; and that an error (the package missing, a directory that cannot
be made) is logged once and stops writing without ever raising into the caller."""

from __future__ import annotations

import logging
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shoal.core.jobspec import JobSpec
from shoal.worker.tensorboard import TensorBoardLog, missing_package


def _read(path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_scalars_metrics_and_text_read_back(tmp_path) -> None:
    tb = TensorBoardLog(f"file://{tmp_path}/tb", interval=1.0)
    tb.scalars(1, 2.5, 1, 1, [0.1], now=100.0)
    tb.scalars(2, 2.4, 1, 1, [0.1], now=100.5)  # within the interval: skipped
    tb.scalars(3, 2.0, 1, 1, [0.1], now=101.0)  # 2 steps in 1 s
    tb.scalars(4, 1.9, 2, 2, [0.05, 0.01], now=101.1)  # a new generation: always written
    tb.metrics(3, {"accuracy": 0.75})
    tb.text(4, "membership", "w1 joined; generation 2: world size 2 (w0, w1)")
    tb.close()
    acc = _read(tmp_path / "tb")
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.5), (3, 2.0), (4, pytest.approx(1.9))]
    # over the window of committed steps: the switch's pause counts (what the job makes)
    assert [(e.step, e.value) for e in acc.Scalars("train/steps_per_s")] == [(3, 2.0), (4, pytest.approx(3 / 1.1))]
    assert [e.value for e in acc.Scalars("train/world_size")] == [1, 1, 2]
    assert [e.value for e in acc.Scalars("train/generation")] == [1, 1, 2]
    assert [e.step for e in acc.Scalars("train/lr")] == [1, 3]
    assert [e.value for e in acc.Scalars("train/lr/group1")] == [pytest.approx(0.01)]  # several groups
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(3, 0.75)]
    (text,) = acc.Tensors("membership/text_summary")
    assert text.step == 4 and text.tensor_proto.string_val[0].decode().startswith("w1 joined")


def test_throughput_scalars_are_over_the_window_with_the_published_figures(tmp_path) -> None:
    """Issue 37: steps/s over the last 30 s of committed steps (a long step moves it by its
    share of the window), and with the FLOP meter's figures samples/s, tokens/s, TFLOP/s and
    MFU (over the peak of world_size devices like this one)."""
    tb = TensorBoardLog(str(tmp_path / "tb"), interval=0.0)
    tb.figures(samples_per_step=64, flops_per_sample=1e9, peak_flops=1e12, tokens_per_sample=128)
    now, step = 0.0, 0
    for i in range(80):  # 10 steps/s, with one step of 1 s (an evaluation before it) at step 50
        now += 1.0 if i == 50 else 0.1
        step += 1
        tb.scalars(step, 1.0, 1, 2, [0.1], now=now)
    tb.close()
    acc = _read(tmp_path / "tb")
    rates = {e.step: e.value for e in acc.Scalars("train/steps_per_s")}
    assert rates[30] == pytest.approx(10.0)
    assert rates[80] == pytest.approx(79 / 8.8, rel=1e-5)  # every point is within the window: 79 steps in 8.8 s
    assert min(rates.values()) > 8.0  # the 1 s step: 1/1.0 = 1 step/s from the last step time, ~9 here
    samples = {e.step: e.value for e in acc.Scalars("train/samples_per_s")}
    assert samples[30] == pytest.approx(640.0)
    assert {e.step: e.value for e in acc.Scalars("train/tokens_per_s")}[30] == pytest.approx(640.0 * 128)
    assert {e.step: e.value for e in acc.Scalars("train/tflops")}[30] == pytest.approx(0.64)
    assert {e.step: e.value for e in acc.Scalars("train/mfu")}[30] == pytest.approx(0.64 / 2)


def test_nothing_is_created_until_rank0_writes(tmp_path) -> None:
    tb = TensorBoardLog(str(tmp_path / "tb"))
    tb.close()  # a worker that never was rank 0
    assert not (tmp_path / "tb").exists()


def test_an_error_is_logged_once_and_writing_stops(tmp_path, caplog) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    tb = TensorBoardLog(str(blocker / "tb"))
    with caplog.at_level(logging.WARNING, "shoal.worker.tensorboard"):
        tb.scalars(1, 1.0, 1, 1, [0.1])
        assert tb.stopped.wait(10)
        for step in range(2, 50):  # never raises, queues nothing more
            tb.scalars(step, 1.0, 1, 1, [0.1], now=float(step))
            tb.text(step, "membership", "x")
        tb.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "training goes on" in warnings[0] and str(blocker) in warnings[0], warnings


def test_a_missing_tensorboard_package_is_named(tmp_path, caplog, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    for name in [n for n in sys.modules if n.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, name)
    assert missing_package() == "tensorboard"
    tb = TensorBoardLog(str(tmp_path / "tb"))
    with caplog.at_level(logging.WARNING, "shoal.worker.tensorboard"):
        tb.scalars(1, 1.0, 1, 1, [0.1])
        assert tb.stopped.wait(10)
        tb.close()
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "the tensorboard package is not installed: pip install 'shoal[tensorboard]'" in msg


def test_a_bad_value_never_raises_into_the_step(tmp_path, caplog) -> None:
    tb = TensorBoardLog(str(tmp_path / "tb"))
    with caplog.at_level(logging.WARNING, "shoal.worker.tensorboard"):
        tb.scalars(1, 1.0, 1, 1, [object()])  # an lr float() cannot take
    assert tb.stopped.is_set() and "step 1" in caplog.records[0].getMessage()
    tb.close()


@pytest.mark.parametrize("value, ok", [
    ("/abs/runs", True), ("file:///abs/runs", True), ("s3://bucket/tb/run1", True),
    ("runs/relative", False), ("s3://", False), ("file://relative", False),
])
def test_spec_field(value: str, ok: bool) -> None:
    if ok:
        assert JobSpec(name="j", tensorboard_dir=value).tensorboard_dir == value
    else:
        with pytest.raises(ValueError, match="tensorboard_dir"):
            JobSpec(name="j", tensorboard_dir=value)
