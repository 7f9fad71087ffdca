"""The formation policy: what the coordinator does while a job's planned generations do not
form (issue 36 moved it here from ``coordinator/decide.py``, which dispatches to it).

- a generation that could not form (a member reported its rendezvous failed) gets a new
  one of the same members after a back-off: :data:`FORMATION_BACKOFF_MS` doubling up to
  :data:`FORMATION_BACKOFF_MAX_MS` per failure in a row of the same members (a membership
  change re-plans at once and starts the count over), so a group that cannot form costs at
  most about ten generations a minute, never a tight loop;
- a *configuration* error (the workers classify their error: NCCL invalid usage, an
  interface without an address, CUDA out of memory, a missing device;
  ``events.models.FormationError``) cannot go away by retrying: the same members failing
  with the same one :data:`CONFIG_STRIKES` generations in a row fail the job, with the error
  and its fix as the reason (transient failures in between neither count nor reset);
- a running job that has planned generations for ``formation_timeout`` without any of them
  forming (no member reported ready: every rendezvous failed) fails, naming the last
  rendezvous error, instead of planning new generations forever.

Its state is ``JobStatus.formation`` (:class:`~shoal.events.records.Formation`). Everything
here is pure: the caller passes the clock; each function returns the job's new status, and
the ones that decide something a reason for people.
"""

from __future__ import annotations

from dataclasses import replace

from shoal.coordinator.states import CoordState
from shoal.core.jobspec import JobSpec
from shoal.events.models import FormationError, StepFailed
from shoal.events.records import Formation, JobStatus, WorkerRecord
from shoal.events.states import PLANNED, JobState

#: The back-off before the same members get a new generation after theirs could not form:
#: this, doubled per failure in a row, at most FORMATION_BACKOFF_MAX_MS.
FORMATION_BACKOFF_MS = 500
FORMATION_BACKOFF_MAX_MS = 10_000
#: Generations in a row of the same members that failed with the same configuration error
#: before the job fails with it.
CONFIG_STRIKES = 3
#: How much of a rendezvous error the job status keeps (the formation failure's reason).
RENDEZVOUS_ERROR_CHARS = 400


def formation_backoff_ms(failures: int) -> int:
    """The wait before the same members' next generation after ``failures`` (>= 1) in a row
    could not form: FORMATION_BACKOFF_MS doubling, at most FORMATION_BACKOFF_MAX_MS."""
    return min(FORMATION_BACKOFF_MAX_MS, FORMATION_BACKOFF_MS * 2 ** min(max(failures, 1) - 1, 20))


def planned(status: JobStatus, now_ms: int, paused: bool) -> Formation:
    """The formation state once a new generation is planned at ``now_ms``: its clock runs from
    the first generation planned since one last formed (a paused one stops it), and no
    back-off is due any more."""
    unformed = 0 if paused else (status.formation.unformed_since_ms or now_ms)
    return replace(status.formation, unformed_since_ms=unformed, retry_ms=0)


def forming(status: JobStatus) -> bool:
    """Whether the formation clock runs (or an error or back-off of a formation is recorded)."""
    f = status.formation
    return bool(f.unformed_since_ms or f.rendezvous_error or f.failures)


def formed(status: JobStatus) -> JobStatus:
    """``status`` once a generation formed: the formation clock, error, back-off and strikes
    end (``status`` itself when none of them ran)."""
    return replace(status, formation=Formation()) if forming(status) else status


def expired(status: JobStatus, spec: JobSpec, now_ms: int) -> bool:
    """A running job whose planned generations have not formed for ``formation_timeout``."""
    since = status.formation.unformed_since_ms
    return status.state == JobState.RUNNING and since > 0 and now_ms - since >= spec.formation_timeout * 1000


def timed_out(status: JobStatus, spec: JobSpec, now_ms: int) -> tuple[JobStatus, str]:
    """The job failed: no generation formed in ``formation_timeout`` (see :func:`expired`).
    Returns its status and the reason, naming the last rendezvous error."""
    waited = (now_ms - status.formation.unformed_since_ms) / 1000
    reason = (f"job failed: no generation formed in {waited:.1f} s (formation_timeout {spec.formation_timeout:g} s, "
              f"last generation {status.generation}); last rendezvous error: "
              f"{status.formation.rendezvous_error or 'none reported'}")
    return replace(status.moved(JobState.FAILED, now_ms), reason=reason), reason


def retry_due(status: JobStatus, now_ms: int) -> bool:
    """Whether the back-off of a generation that could not form has passed: its members get
    a new generation now."""
    retry = status.formation.retry_ms
    return bool(retry) and now_ms >= retry


def retry_reason(status: JobStatus) -> str:
    """Why the same members get a new generation once the back-off passed, for people."""
    f = status.formation
    return (f"generation {status.generation} could not form ({f.rendezvous_error[:200]}); "
            f"same members after a {formation_backoff_ms(f.failures) / 1000:g} s back-off ({f.failures} failed in a row)")


def failed(state: CoordState, ev: StepFailed, now_ms: int, spec: JobSpec) -> tuple[JobStatus, str]:
    """A member of the current generation reports that its group could not form. The members
    cannot retry a generation (its rendezvous prefix is spent): the same members get a new
    one once the back-off passed (the tick plans it: :func:`retry_due`; a member that is really
    gone is removed by its agent's report or its heartbeat, and that re-plans at once). Each
    failed generation counts once, whichever members report it; a configuration error counts
    a strike, and the ``CONFIG_STRIKES``-th in a row with the same error fails the job; so does
    ``formation_timeout``. Returns the job's status and the reason."""
    wid = ev.worker_id or "?"
    kind = FormationError.parse(ev.formation_error)
    error = " ".join(ev.error.split())[:RENDEZVOUS_ERROR_CHARS]  # one line
    f = replace(state.status.formation, rendezvous_error=f"{wid}: {error}")
    status = replace(state.status, formation=f)
    if expired(status, spec, now_ms):
        return timed_out(status, spec, now_ms)
    if f.digest != status.plan_digest:  # other members than the failures counted: start over
        f = Formation(unformed_since_ms=f.unformed_since_ms, rendezvous_error=f.rendezvous_error,
                      digest=status.plan_digest)
    said = f"generation {ev.generation} could not form ({wid}: {error[:200]})"
    if kind.configuration and f.strike_generation != ev.generation:
        strikes = f.strikes + 1 if f.config_error == kind.value else 1
        f = replace(f, config_error=kind.value, strikes=strikes, strike_generation=ev.generation)
        if strikes >= CONFIG_STRIKES:
            return _configuration_failed(replace(status, formation=f), kind, wid, error, state.in_state(PLANNED),
                                         now_ms)
    if f.failed_generation == ev.generation:  # another member's report of the same failure
        return (replace(status, formation=f),
                f"{said}; already counted: the same members get a new generation at {f.retry_ms} ms")
    failures = f.failures + 1
    delay = formation_backoff_ms(failures)
    strike = (f"; configuration error {kind.value} ({f.strikes} of {CONFIG_STRIKES} in a row fail the job)"
              if kind.configuration else "")
    reason = (f"{said}{strike}; the same members get a new generation in {delay / 1000:g} s "
              f"({failures} failed in a row)")
    f = replace(f, failures=failures, failed_generation=ev.generation, retry_ms=now_ms + delay)
    return replace(status, formation=f, reason=reason), reason


def configuration_fix(kind: FormationError, members: list[WorkerRecord]) -> str:
    """How to fix a configuration error, in a few words, for the reason of the job it failed
    (``members``: the generation's planned members, whose records say where they run)."""
    if kind == FormationError.NCCL_INVALID_USAGE:
        by_gpu: dict[tuple[str, str], int] = {}
        for rec in members:
            if rec.backend == "nccl" and rec.gpu:
                where = (rec.node or rec.host, rec.gpu)
                by_gpu[where] = by_gpu.get(where, 0) + 1
        shared = sorted((n, where) for where, n in by_gpu.items() if n > 1)
        if shared:
            n, (node, gpu) = shared[-1]
            return (f"{n} NCCL workers share GPU {gpu}" + (f" on {node}" if node else "") +
                    ": one worker per GPU (--workers gpu) or backend: gloo")
        return "NCCL needs one GPU per worker: one worker per GPU (--workers gpu) or backend: gloo"
    if kind == FormationError.NO_INTERFACE_ADDRESS:
        return "name an interface that has an IPv4 address here with --iface (or leave it out: the one that reaches Redis)"
    if kind == FormationError.CUDA_OUT_OF_MEMORY:
        return "free GPU memory: fewer workers per GPU, a smaller model or micro-batch, or device: cpu"
    if kind == FormationError.NO_DEVICE:
        return "check CUDA_VISIBLE_DEVICES and the GPU driver on the workers' nodes, or use device: cpu"
    return "see the error"


def _configuration_failed(status: JobStatus, kind: FormationError, wid: str, error: str,
                          members: list[WorkerRecord], now_ms: int) -> tuple[JobStatus, str]:
    fix = configuration_fix(kind, members)
    reason = (f"job failed: generation {status.generation} could not form, {status.formation.strikes} generations "
              f"in a row of the same members with the same configuration error ({kind.value}): {wid}: {error}; "
              f"fix: {fix}")
    status = replace(status.moved(JobState.FAILED, now_ms), reason=reason,
                     formation=replace(status.formation, retry_ms=0))
    return status, reason
