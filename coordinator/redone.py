"""Redone steps: the committed steps a job commits again because every replica that held
them was lost (issue 36 moved this accounting here from ``coordinator/decide.py``, which
calls it).

The coordinator keeps the highest committed step reported on the job's line of state
(``JobStatus.high_step``: sampled heartbeats, a joiner's ``ready``, a checkpoint). A member
that reports ``ready`` for a generation newer than that report, at a lower step, means every
replica that held the newer state was lost and the generation resumed from a checkpoint or
from scratch: the steps in between, committed before, are committed again. :func:`resumed`
says which, adds them to ``steps_redone`` and restarts the line from the step resumed at. A
normal switch (survivors keep their state, a joiner catches up from them) starts at the
highest step and counts nothing; neither does a failed step, which nobody committed.

Pure: the caller passes the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shoal.coordinator import watchdog
from shoal.events.records import JobStatus


@dataclass(frozen=True)
class StepSeen:
    """A committed ``step`` a member of ``generation`` reported."""

    generation: int
    step: int


def saw_step(status: JobStatus, seen: StepSeen, now_ms: int = 0) -> JobStatus:
    """``status`` once ``seen`` was reported (at ``now_ms``): ``high_step`` rises to a higher
    step reported by a generation no older than the one that reported it, and a watchdog
    spell below it ends. A report from an older generation is stale (a late checkpoint event,
    a heartbeat of a member lost before the job resumed below it) and changes nothing."""
    if seen.generation < status.high_step_generation or seen.step <= status.high_step:
        return status
    return replace(status, high_step=seen.step, high_step_generation=seen.generation,
                   high_step_ms=now_ms or status.high_step_ms, stall=watchdog.committed(status.stall, seen.step))


def resumed(status: JobStatus, generation: int, step: int | None, now_ms: int = 0) -> tuple[JobStatus, str]:
    """A member starts ``generation`` at ``step`` (its ``ready``). When that is below the
    highest step a previous generation committed, every replica of the newer state is gone:
    the steps in between are redone. Returns the new status and the reason ("" : nothing
    redone)."""
    if step is None:
        return status, ""
    if step >= status.high_step or status.high_step_generation >= generation:
        return saw_step(status, StepSeen(generation, step), now_ms), ""
    high = status.high_step
    origin = ("from scratch" if step == 0 else f"from the checkpoint of step {step}" if status.latest_step == step
              else "from a checkpoint")
    if high == step + 1:
        steps = f"step {high}, committed before, is redone (every replica that held it was lost)"
    else:
        steps = f"steps {step + 1}-{high}, committed before, are redone (every replica that held them was lost)"
    reason = f"generation {generation} resumed at step {step} ({origin}): {steps}"
    status = replace(status, high_step=step, high_step_generation=generation,
                     steps_redone=status.steps_redone + high - step, reason=reason)
    return status, reason
