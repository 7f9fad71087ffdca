"""The chaos soak's pace steering (ops/chaos/pace.py PaceSteer), on a simulated clock: a job
must not end before its fault window, on a fast machine or a slow one, with stalls."""

from __future__ import annotations

import pytest

from shoal.ops.chaos.pace import PaceSteer

WINDOW, STEPS = 60.0, 1400


def simulate(tmp_path, compute_s: float, stalls: dict[int, float]) -> float:
    """Run a job of STEPS steps whose step costs ``compute_s`` plus the steered pause (and a
    stall of ``stalls[step]`` seconds at some steps, a fault); the time its last step ends."""
    steer = PaceSteer(tmp_path / "pace", STEPS, pace=0.03)
    t, step = 0.0, 0
    while step < STEPS:
        if t < WINDOW:
            steer.update(step, WINDOW, now=t)
        elif steer.pace:
            steer.release()
        t += compute_s + steer.pace + stalls.get(step, 0.0)
        step += 1
    assert 0.0 <= min(steer.history) and max(steer.history) <= steer.max_pace
    assert float((tmp_path / "pace").read_text()) == steer.pace
    return t


FAULTS = {100: 3.0, 500: 2.0, 900: 4.0}
#: a fault every ~3 s for the whole window (the 60 s soak's rhythm), each stalling 0.5-4 s
MANY = {s: 0.5 + (s * 7919 % 35) / 10 for s in range(40, 1400, 60)}


@pytest.mark.parametrize("compute_s", [0.002, 0.01, 0.03, 0.045])
@pytest.mark.parametrize("stalls", [{}, FAULTS, MANY], ids=["steady", "stalls", "many-stalls"])
def test_the_job_outlasts_the_window_without_dragging(tmp_path, compute_s, stalls) -> None:
    end = simulate(tmp_path, compute_s, stalls)
    assert end >= WINDOW, f"ended {WINDOW - end:.1f} s before the window closed"
    fastest = STEPS * compute_s + sum(stalls.values())  # with no pause at all
    assert end <= max(WINDOW, fastest) + 30, f"dragged {end - max(WINDOW, fastest):.1f} s past the window"
