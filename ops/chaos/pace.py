"""The chaos soaks' pace steering: the pause per step that makes a job of fixed length reach its
last step as the fault window closes (tests/unit/test_chaos_pace.py, on a simulated clock)."""

from __future__ import annotations

import os
import time
from pathlib import Path


class PaceSteer:
    """Steers the per-step pause so that the job reaches ``steps`` as the window closes.

    Every ``every`` seconds it estimates a step's own cost - the step time of the last
    interval less the pause it ran with, the smallest of the last few intervals, since a
    fault's stall makes an interval look slow - and sets the pause to the step time still
    needed less that cost (kept within [0, ``max_pace``]). It writes the pause to ``path``
    (atomically); workers re-read it. (It used to move the pause by half the difference
    between the measured and the needed step time: after stalls the job raced, and on a fast
    machine the 60 s soak's job ended 5 s before its window.)"""

    def __init__(self, path: Path, steps: int, pace: float, every: float = 5.0, max_pace: float = 0.5) -> None:
        self.path, self.steps, self.pace, self.every, self.max_pace = path, steps, pace, every, max_pace
        self._last: tuple[float, int] | None = None
        self._costs: list[float] = []  #: a step's own cost (pause excluded), recent intervals
        self.history: list[float] = [pace]
        self._write()

    def due(self, now: float | None = None) -> bool:
        """Whether :meth:`update` would act now (so the caller reads the step only then)."""
        now = time.monotonic() if now is None else now
        return self._last is None or now - self._last[0] >= self.every

    def update(self, step: int, window_end: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._last is None:
            self._last = (now, step)
            return
        t0, s0 = self._last
        if now - t0 < self.every:
            return
        self._last = (now, step)
        if step <= s0:
            return  # nothing committed in the interval (a fault): no evidence of the rate
        measured = (now - t0) / (step - s0)  # seconds per step, pause included
        self._costs = (self._costs + [max(0.0, measured - self.pace)])[-4:]
        left, time_left = self.steps - step, window_end - now
        # aim to commit the last step a little after the window closes, so that the job
        # outlasts the window rather than cutting it short
        needed = (time_left + self.every * 4) / left if left > 0 and time_left > 0 else self.max_pace
        self.pace = min(self.max_pace, max(0.0, needed - min(self._costs)))
        self.history.append(self.pace)
        self._write()

    def release(self) -> None:
        """No pause any more: the steps left after the window run at full speed."""
        self.pace = 0.0
        self.history.append(self.pace)
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{self.pace:.5f}\n")
        os.replace(tmp, self.path)
