"""The progress watchdog: a running job whose committed step does not advance while its
generations churn is a failure of its own kind (issue 34).

A failed step is normally cheap: the members report it, the same members get a new generation
a moment later and redo it. A member that fails the same step in every generation - a process
whose groups are broken in a way no new generation mends, a peer that keeps aborting its part
- turned that into a loop at 5e93599: 300 generations in 4 minutes, nothing committed, and
``shoal status`` showing a rate and an ETA. The watchdog counts, per committed step, the
generations of the *same members* that were planned because a step after it failed (a
generation that changed the membership - a crash, a join - is explained and does not count),
and who reported each failure:

- ``STALL_GENERATIONS`` such generations in a row, spanning at least :func:`stall_bound_ms`
  (``STALL_STEPS`` median step times, at least ``STALL_FLOOR_MS``), and the members that kept
  reporting the failure are restarted: failed with cause ``stuck`` (their agents start them
  again; in HSDP their replica groups go whole and heal from the others);
- the same again after that, and the job fails with a reason naming the step, the members,
  how often each reported it and the last error.

A committed step beyond the spell's ends it. Everything here is pure: the caller passes the
clock (``coordinator.decide``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shoal.events.records import JobStatus, Stall

#: Generations of the same members, in a row, re-planned after a failure of the same step
#: before the watchdog acts.
STALL_GENERATIONS = 4
#: ... and the spell must have lasted this many median step times, at least STALL_FLOOR_MS.
STALL_STEPS = 20
STALL_FLOOR_MS = 3000
#: Rounds of restarts before the job fails (1: restart once, then fail).
STALL_RESTARTS = 1
#: The longest error kept for the reason.
ERROR_CHARS = 200


def stall_bound_ms(status: JobStatus) -> int:
    """How long a spell must last before the watchdog acts, ms."""
    return max(STALL_FLOOR_MS, STALL_STEPS * status.step_ms)


def step_failed(stall: Stall, step: int, worker_id: str, error: str, now_ms: int, *, local: bool = False) -> Stall:
    """``worker_id`` reports that the step after committed ``step`` failed (``error``;
    ``local``: it gave the step up itself). A failure beyond the spell's step starts a new
    spell (the job advanced); one at or below it (a job resumed from a checkpoint below it)
    belongs to the same spell."""
    if stall.step < 0 or step > stall.step:
        stall = Stall(step=step, since_ms=now_ms)
    reporters = dict(stall.reporters)
    reporters[worker_id] = reporters.get(worker_id, 0) + 1
    own = dict(stall.local)
    if local:
        own[worker_id] = own.get(worker_id, 0) + 1
    # the repeated cause is what a member that gave the step up itself said (its peers only
    # saw the connection go); a peer's error only until such a member reported
    said = " ".join(error.split())[:ERROR_CHARS] if local or not stall.local else stall.error
    return replace(stall, reporters=reporters, local=own, error=said)


def committed(stall: Stall, high_step: int) -> Stall:
    """The job committed ``high_step``: a spell below it is over."""
    return Stall() if stall.step >= 0 and high_step > stall.step else stall


def same_members_again(stall: Stall, generation: int) -> Stall:
    """The failure of ``generation`` (a generation of the spell) gets the same members a new
    generation: one more counted, once per failed generation."""
    if stall.step < 0 or stall.counted_generation >= generation:
        return stall
    return replace(stall, generations=stall.generations + 1, counted_generation=generation)


@dataclass(frozen=True)
class Verdict:
    """What the watchdog decided: restart ``stuck`` (worker ids), or fail the job
    (``fail``); ``reason`` for people."""

    stuck: tuple[str, ...] = ()
    fail: bool = False
    reason: str = ""


def judge(status: JobStatus, planned: set[str], now_ms: int) -> Verdict | None:
    """The watchdog's verdict on ``status.stall`` (``planned``: the workers the next generation
    would have), or None while the spell is within its bounds."""
    stall = status.stall
    if stall.step < 0 or stall.generations < STALL_GENERATIONS:
        return None
    took = now_ms - stall.since_ms
    if took < stall_bound_ms(status):
        return None
    counts = sorted(stall.reporters.items(), key=lambda kv: (-kv[1], kv[0]))
    said = ", ".join(f"{w} {n}x" for w, n in counts)
    own = ", ".join(f"{w} {n}x" for w, n in sorted(stall.local.items(), key=lambda kv: (-kv[1], kv[0])))
    spell = (f"no progress: step {stall.step} failed in {stall.generations} generations in a row of the same "
             f"members over {took / 1000:.1f} s (reported by {said}" + (f"; given up by {own} itself" if own else "")
             + f"; cause: {stall.error})")
    if stall.restarts >= STALL_RESTARTS:
        return Verdict(fail=True, reason=f"job failed: {spell}; restarting the members that kept failing it did not help")
    # who to restart: the members that gave the step up themselves, repeatedly (a broken
    # group, a fence that keeps refusing), else those that kept reporting it, else every
    # reporter still planned (their peers failed with them, and are not the cause)
    own = [w for w, n in sorted(stall.local.items()) if w in planned and n >= 2]
    repeat = [w for w, n in counts if w in planned and n >= 2]
    live = [w for w, _n in counts if w in planned]
    stuck = tuple(own or repeat or live)
    if not stuck:  # the reporters are gone already: their removal re-plans on its own
        return None
    return Verdict(stuck=stuck, reason=f"{spell}; restarting {', '.join(stuck)} (stuck)")


def restarted(stall: Stall, now_ms: int) -> Stall:
    """A round of restarts was decided: counting starts over, the spell goes on."""
    return replace(stall, generations=0, reporters={}, local={}, since_ms=now_ms, restarts=stall.restarts + 1)
