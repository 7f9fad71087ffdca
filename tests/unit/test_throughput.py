"""Issue 37, throughput you can trust: steps/s over a window of committed steps
(``core/throughput.py``) as ``shoal status`` reads it from the ``progress`` stream, samples/s,
tokens/s, FLOP/s and MFU; the FLOP meter (``worker/flops.py``: torch's counter on the first
committed step, the GPU peak table, a declared figure)."""

from __future__ import annotations

import fakeredis
import pytest
import torch

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.core.throughput import WINDOW_S, mfu, rolling_rates, throughput, window_rate
from shoal.events.keys import job_keys
from shoal.events.models import Heartbeat
from shoal.events.records import WorkerRecord
from shoal.events.states import WorkerState
from shoal.events.streams import ProgressEntry
from shoal.ops.status import RECENT_CHUNK, format_status, job_status, median_rate, recent_steps
from shoal.worker.flops import FlopMeter, peak_flops, table_peak
from tests.entrypoints import steady_digits, steady_digits_flops


def steady(seconds: float, every: float = 0.5, steps_per_s: float = 10.0, t0: float = 0.0,
           step0: int = 0) -> list[tuple[float, int]]:
    """Points of a job committing ``steps_per_s``, one point per ``every`` s."""
    n = int(round(seconds / every))
    return [(t0 + i * every, step0 + round(i * every * steps_per_s)) for i in range(n + 1)]


def test_a_long_step_moves_the_windowed_rate_by_its_share_of_the_window_only() -> None:
    """The jump of issue 37: one evaluation of 3 s among steps of 0.1 s. 1 / the last step
    time says 0.33 steps/s right after it, 10 before; the window says 10 x 30 / 33 at worst."""
    before = steady(60)
    after = [(t + 3.0, s + 1) for t, s in steady(40, t0=before[-1][0] + 0.1, step0=before[-1][1])]
    points = before + after
    rates = [window_rate(points[: i + 1]).steps_per_s for i in range(len(before), len(points))]
    assert min(rates) == pytest.approx(10 * 30 / 33, rel=0.02) and max(rates) == pytest.approx(10.0, rel=0.01)
    assert max(rates) / min(rates) < 1.15
    # ... what the last step time said just after the evaluation, and a moment later
    assert median_rate([Heartbeat(worker_id="w0", step_time=3.1)]) < 0.33 < 10 == median_rate(
        [Heartbeat(worker_id="w0", step_time=0.1)])


def test_the_window_is_the_last_30_s_or_the_last_two_points_of_slow_steps() -> None:
    slow_then_fast = steady(100, steps_per_s=1.0) + steady(40, t0=100.5, step0=100, steps_per_s=2.0)
    r = window_rate(slow_then_fast)
    assert r.steps_per_s == pytest.approx(2.0, rel=0.02) and r.span_s == pytest.approx(WINDOW_S)
    very_slow = [(0.0, 0), (60.0, 1), (120.0, 2)]  # a step a minute: its two newest points
    assert window_rate(very_slow).steps_per_s == pytest.approx(1 / 60) and window_rate(very_slow).span_s == 60.0
    assert window_rate([(0.0, 5)]) is None and window_rate([]) is None and window_rate([(1.0, 1), (1.0, 2)]) is None
    assert window_rate(steady(10), window_s=4.0).span_s == 4.0


def test_a_resume_from_an_older_checkpoint_counts_the_steps_made_again_not_a_negative_rate() -> None:
    points = [(0.0, 100), (1.0, 110), (2.0, 80), (3.0, 90)]  # back to step 80, then on
    assert window_rate(points).steps_per_s == pytest.approx(20 / 3)


def test_rolling_rates_are_the_window_rate_at_every_point() -> None:
    pts = steady(50, every=0.37, steps_per_s=7.0) + [(60.0, 400), (61.0, 300), (70.0, 390)]
    got = rolling_rates(pts, window_s=10.0)
    assert got[0] is None
    for i in range(1, len(pts)):
        want = window_rate(pts[: i + 1], window_s=10.0)
        assert got[i] == pytest.approx(want.steps_per_s if want else None)


def test_throughput_and_mfu() -> None:
    t = throughput(2.0, 64, tokens_per_sample=128, flops_per_sample=3e9, peak_flops=1e12)
    assert (t.samples_per_s, t.tokens_per_s, t.flops_per_s) == (128.0, 128.0 * 128, 128 * 3e9)
    assert t.mfu == pytest.approx(128 * 3e9 / 1e12)
    bare = throughput(2.0, 64)
    assert (bare.tokens_per_s, bare.flops_per_s, bare.mfu) == (None, None, None)
    assert throughput(2.0, 64, flops_per_sample=3e9).mfu is None  # no peak known: no MFU
    assert mfu(5e11, 1e12) == 0.5 and mfu(None, 1e12) is None and mfu(5e11, 0.0) is None


# ---- shoal status, from a real stream (fakeredis) -----------------------------------------------


def _job(r, *, workers=("w0", "w1"), step_time=0.1, since=0.05, **figures) -> str:
    create_job(r, JobSpec(name="p", entrypoint="simulate", global_batch_size=32, heartbeat_interval=0.5))
    keys = job_keys("p")
    sec, usec = r.time()
    now = int(sec) * 1000 + int(usec) // 1000
    for w in workers:
        r.hset(keys.workers, w, WorkerRecord(w, WorkerState.ACTIVE, pid=5).to_json())
        r.zadd(keys.last_seen, {w: now})
        r.set(keys.heartbeat(w), Heartbeat(worker_id=w, step=400, step_time=step_time, total_steps=1000,
                                           since_commit=since, **figures).model_dump_json())
    r.hset(keys.state, mapping={"state": "running", "generation": "1"})
    return now


def _write(r, now_ms: int, points, at: int = 0, **fields) -> None:
    """``points`` as rank 0's entries, the newest at ``now_ms``; ``fields`` on entry ``at``."""
    newest = points[-1][0]
    for i, (t, step) in enumerate(points):
        entry = ProgressEntry(step=step, generation=1, world_size=2, t=t, **(fields if i == at % len(points) else {}))
        r.xadd(job_keys("p").progress, entry.to_fields(), id=f"{now_ms - int((newest - t) * 1000)}-0")


def test_status_rates_come_from_the_window_of_the_progress_stream() -> None:
    r = fakeredis.FakeRedis()
    now = _job(r, step_time=3.1)  # the members' last step took 3.1 s (an evaluation before it)
    points = steady(60, steps_per_s=4.0)
    _write(r, now - 1000, points, at=-20, flops_per_sample=2e6, peak_flops=1e9, tokens_per_sample=16)
    r.xadd(job_keys("p").progress, ProgressEntry(kind="eval", step=240, metrics={"a": 1.0}).to_fields(),
           id=f"{now}-0")  # the newest entry, an evaluation: not a step
    s = job_status(r, "p")
    p = s["progress"]
    assert p["steps_per_s"] == pytest.approx(4.0) and p["rate_window_s"] == pytest.approx(30.0)
    assert p["eta_s"] == pytest.approx(600 / 4.0) and p["samples_per_s"] == pytest.approx(128.0)
    # the figures: from the members' heartbeats when they have them, else rank 0's entry
    assert s["throughput"] == {"samples_per_step": 32, "tokens_per_sample": 16, "flops_per_sample": 2e6,
                               "peak_flops": None, "window_s": WINDOW_S}
    assert p["tokens_per_s"] == pytest.approx(2048.0) and p["flops_per_s"] == pytest.approx(2.56e8)
    assert p["mfu"] is None  # the members publish no peak: a partial figure would be wrong
    text = format_status(s)
    assert "4 steps/s  128 samples/s  2.05k tokens/s  ETA 2m30s  (over 30 s)" in text
    assert "compute: 2 MFLOP/sample  256 MFLOP/s  (MFU: no peak FLOP/s known" in text


def test_mfu_is_over_the_members_peaks_summed_and_a_stall_hides_every_rate() -> None:
    r = fakeredis.FakeRedis()
    now = _job(r, flops_per_sample=2e6, peak_flops=1e9, tokens_per_sample=16)
    _write(r, now, steady(60, steps_per_s=4.0))
    s = job_status(r, "p")
    assert s["throughput"]["peak_flops"] == 2e9  # w0's and w1's
    assert s["progress"]["mfu"] == pytest.approx(2.56e8 / 2e9)
    assert "MFU 12.8 % of 2 GFLOP/s peak" in format_status(s)
    for w in ("w0", "w1"):  # nothing committed for a minute: no rate, no ETA, none of the rest
        hb = Heartbeat.model_validate_json(r.get(job_keys("p").heartbeat(w)))
        r.set(job_keys("p").heartbeat(w), hb.model_copy(update={"since_commit": 60.0}).model_dump_json())
    p = job_status(r, "p")["progress"]
    assert [p[k] for k in ("steps_per_s", "eta_s", "samples_per_s", "tokens_per_s", "flops_per_s", "mfu")] == [None] * 6


def test_without_a_progress_history_status_falls_back_to_the_members_step_times() -> None:
    r = fakeredis.FakeRedis()
    _job(r, step_time=0.25)  # a simulated job writes no progress entries
    p = job_status(r, "p")["progress"]
    assert p["steps_per_s"] == 4.0 and p["rate_window_s"] is None


def test_recent_steps_reads_back_across_chunks_to_the_start_of_the_window() -> None:
    r = fakeredis.FakeRedis()
    now = _job(r)
    points = steady(30, every=0.05, steps_per_s=20.0)  # 601 entries: several chunks
    assert len(points) > 3 * RECENT_CHUNK
    _write(r, now, points, peak_flops=5.0)
    got, figures = recent_steps(r, job_keys("p"), window_s=20.0)
    assert got[-1][1] == points[-1][1] and got[-1][0] - got[0][0] == pytest.approx(20.0)
    assert figures is None  # the only entry with figures is older than the window
    got, figures = recent_steps(r, job_keys("p"), window_s=100.0)  # more than there is: all of it
    assert len(got) == len(points) and figures.peak_flops == 5.0


# ---- the FLOP meter -------------------------------------------------------------------------------


class _Sink:
    def __init__(self):
        self.got: list[dict] = []

    def update(self, **kw):  # a heartbeat
        self.got.append(kw)

    figures = update  # a progress recorder, a TensorBoard log


def test_the_meter_counts_the_first_step_with_samples_once_and_publishes_once() -> None:
    setup = steady_digits(32, tokens_per_sample=64)
    meter = FlopMeter(JobSpec(name="f", global_batch_size=16, peak_flops=2e9), "cpu")
    hb, progress, tb = _Sink(), _Sink(), _Sink()
    x, y = setup.dataset.x[:16], setup.dataset.y[:16]

    def step(n: int, fail: bool = False) -> None:
        with meter.measure(n, setup, hb, progress, tb):
            setup.loss_fn(setup.model(x[:max(n, 1)]), y[:max(n, 1)]).backward()
            if fail:
                raise RuntimeError("collective failed")

    step(0)  # a joiner's first step: no samples of its own, nothing counted
    assert meter.pending and hb.got[-1] == {"flops_per_sample": None, "peak_flops": 2e9, "tokens_per_sample": 64}
    with pytest.raises(RuntimeError):
        step(8, fail=True)  # an aborted step is not counted
    assert meter.pending
    step(8)
    assert not meter.pending and meter.flops_per_sample == steady_digits_flops(32)
    step(16)  # counted once: the next steps run without the counter
    assert meter.flops_per_sample == steady_digits_flops(32)
    assert len(hb.got) == len(progress.got) == len(tb.got) == 2  # the peak first, then the measured figure
    assert progress.got[-1] == {"flops_per_sample": steady_digits_flops(32), "peak_flops": 2e9, "tokens_per_sample": 64}
    assert tb.got[-1]["samples_per_step"] == 16
    rejoined = _Sink()  # evicted and rejoined: a new heartbeat, which gets the figures too
    with meter.measure(16, setup, rejoined, progress, tb):
        pass
    assert rejoined.got == [progress.got[-1]]
    declared = FlopMeter(JobSpec(name="f", flops_per_sample=123.0), "cpu")
    assert not declared.pending and declared.figures(setup)["flops_per_sample"] == 123.0


def test_the_gpu_peak_table_and_what_a_cpu_has() -> None:
    tera = 1e12
    assert table_peak("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4 * tera)
    assert table_peak("NVIDIA H100 PCIe", "bf16") == pytest.approx(756 * tera)
    assert table_peak("NVIDIA H100 NVL", "fp32") == pytest.approx(60 * tera)
    assert table_peak("NVIDIA H200", "bf16") == pytest.approx(989.4 * tera)
    assert table_peak("NVIDIA A100-SXM4-80GB", "tf32") == pytest.approx(156 * tera)
    assert table_peak("NVIDIA A100 80GB PCIe", "fp32") == pytest.approx(19.5 * tera)
    assert table_peak("NVIDIA L40S", "bf16") == pytest.approx(366.5 * tera)
    assert table_peak("NVIDIA L40", "bf16") == pytest.approx(181 * tera)
    assert table_peak("NVIDIA L4", "bf16") == pytest.approx(121 * tera)
    assert table_peak("NVIDIA A10", "fp32") == pytest.approx(31.2 * tera)
    assert table_peak("NVIDIA A10G", "bf16") is None  # not a datasheet figure: give peak_flops
    assert table_peak("Tesla T4", "bf16") is None and table_peak("Tesla T4", "fp16") == pytest.approx(65 * tera)
    assert table_peak("NVIDIA GeForce RTX 4090", "bf16") == pytest.approx(165.2 * tera)
    assert peak_flops("cpu", "fp32") is None and peak_flops("cpu", "bf16", declared=3e11) == 3e11
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 allowed: fp32 reads the TF32 column
        from shoal.worker.flops import _matmul_precision

        assert _matmul_precision("fp32") == "tf32" and _matmul_precision("bf16") == "bf16"
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_setup_declares_tokens_per_sample_as_a_positive_int() -> None:
    from shoal.worker.errors import EntrypointError
    from shoal.worker.userapi import load_entrypoint

    assert load_entrypoint("tests.entrypoints:steady_digits", 0, {"width": 4, "tokens_per_sample": 64}
                           ).tokens_per_sample == 64
    for bad in (0, -3, 2.5, True):
        with pytest.raises(EntrypointError, match="tokens_per_sample must be a positive int"):
            load_entrypoint("tests.entrypoints:steady_digits", 0, {"width": 4, "tokens_per_sample": bad})
