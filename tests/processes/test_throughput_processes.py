"""Issue 37, throughput you can trust: a real job (coordinator, two workers, gloo) that evaluates
every 20 steps (each evaluation a pause of 0.4 s, ~7 step times) and checkpoints every 15 -
what moved ``shoal status``'s steps/s by minutes of ETA when it was 1 / the median member's
last step time. Readings of ``shoal status`` taken as the job goes on differ by at most 15 %;
the job's ``params`` reach ``build`` (the model's width shows in the FLOPs torch's counter
measured on the first step); tokens/s and MFU (CPU: ``peak_flops`` in the spec) are shown in
the text, the JSON, TensorBoard and the report."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.events.models import Heartbeat
from shoal.ops.jobs import stop_job
from shoal.ops.report import load_history, mean_throughput
from shoal.ops.status import format_status, job_status, median_rate, recent_steps
from tests.entrypoints import steady_digits_flops
from tests.helpers import ControlWatcher, wait_until

pytestmark = pytest.mark.slow

#: the window of these readings (shoal status's default is 30 s; shorter keeps the test short)
WINDOW_S = 12.0
READINGS = 6
PEAK = 2e10  # per worker: a made-up CPU peak, as a user would declare it
WIDTH = 48


def _step(r, job_id: str) -> int:
    return max((json.loads(raw)["step"] for raw in r.mget([job_keys(job_id).heartbeat(w) for w in ("w0", "w1")])
                if raw), default=0)


def test_status_steps_per_second_stay_within_15_percent_with_evaluations_and_checkpoints(r, procs, job_id,
                                                                                        tmp_path) -> None:
    tb = tmp_path / "tb"
    spec = JobSpec(name=job_id, entrypoint="tests.entrypoints:steady_digits", epochs=1000, min_workers=2,
                   max_workers=2, heartbeat_interval=0.2, heartbeat_ttl=1.5, eval_every_steps=20,
                   checkpoint_uri=f"file://{tmp_path / 'ckpt'}", checkpoint_interval=15, peak_flops=PEAK,
                   tensorboard_dir=str(tb),
                   params={"width": WIDTH, "pace": 0.03, "eval_pause": 0.4, "tokens_per_sample": 64})
    create_job(r, spec)
    watch = ControlWatcher(r, job_id)
    procs.coordinator("coord")
    workers = [procs.worker(job_id, f"p{i}") for i in range(2)]
    try:
        watch.wait_for(lambda d: d.world_size == 2, 90)

        def history_s() -> float:
            points, _ = recent_steps(r, job_keys(job_id), WINDOW_S)
            return points[-1][0] - points[0][0] if len(points) > 1 else 0.0

        wait_until(lambda: history_s() >= WINDOW_S, 120, "a window of committed steps")
        readings, old = [], []
        for _ in range(READINGS):  # a reading every 40 committed steps (two evaluations, ~3 checkpoints)
            at = _step(r, job_id)
            wait_until(lambda: _step(r, job_id) >= at + 40, 60, "40 more committed steps")
            s = job_status(r, job_id, window_s=WINDOW_S)
            readings.append(s)
            beats = [Heartbeat.model_validate_json(raw) for raw in
                     r.mget([job_keys(job_id).heartbeat(w) for w in ("w0", "w1")]) if raw]
            old.append(median_rate(beats))  # what status showed before issue 37, at the same moment
        rates = [s["progress"]["steps_per_s"] for s in readings]
        spread = max(rates) / min(rates) - 1
        print(f"steps/s readings over {WINDOW_S:g} s: {rates} (spread {spread:.1%}); "
              f"1 / the median last step time at the same moments: {[round(x, 2) for x in old]}")
        assert spread <= 0.15, rates

        last = readings[-1]
        p, f = last["progress"], last["throughput"]
        assert last["params"] == spec.params
        assert f["flops_per_sample"] == steady_digits_flops(WIDTH)  # params reached build; the counter measured it
        assert f["tokens_per_sample"] == 64 and f["peak_flops"] == 2 * PEAK and f["samples_per_step"] == 64
        assert p["samples_per_s"] == pytest.approx(p["steps_per_s"] * 64, rel=0.01)
        assert p["tokens_per_s"] == pytest.approx(p["samples_per_s"] * 64, rel=0.01)
        assert p["mfu"] == pytest.approx(p["samples_per_s"] * steady_digits_flops(WIDTH) / (2 * PEAK), rel=0.01)
        text = format_status(last)
        assert "samples/s" in text and "tokens/s" in text and f"MFU {p['mfu'] * 100:.3g} %" in text
        assert f"params: width={WIDTH}" in text
        pids = {str(w["pid"]) for w in last["workers"]}
        assert pids == {str(w.popen.pid) for w in workers}
        rows = text.splitlines()[-2:]
        assert {row.split()[6] for row in rows} == pids  # the text table's pid column
    finally:
        stop_job(r, job_id, "enough")
    assert all(w.wait(60) == 0 for w in workers)

    # rank 0's progress entries carried the figures: the report has them after the job
    mean = mean_throughput(load_history(r, job_id))
    assert mean["tokens_per_s"] == pytest.approx(mean["samples_per_s"] * 64)
    assert mean["mfu"] == pytest.approx(mean["flops_per_s"] / (2 * PEAK), rel=0.05)
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    assert {"train/samples_per_s", "train/tokens_per_s", "train/tflops", "train/mfu"} <= set(acc.Tags()["scalars"])
    assert all(0 < e.value < 1 for e in acc.Scalars("train/mfu"))
