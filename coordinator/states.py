"""Worker and job state machines, with their allowed moves as explicit tables.

Worker states::

    Syncing --ready--> Active --leave--> Draining --left--> Left
       |                 |                  |
       +---leave-------> Draining           +--(died)--> Failed
       +---(died)------> Failed <--(died)---+ (Active)
       +---left--------> Left   (a joiner told to stop before it synced)

- Syncing: accepted and part of the newest generation; forming the group / receiving state.
- Active: acknowledged the current generation; trains.
- Draining: asked to stop (SIGTERM); excluded from the next generation; finishes its step.
- Left, Failed: terminal. A restarted process joins again and gets a fresh record.

Job states::

    pending --enough workers--> running <--> paused (below min_workers)
    pending|running|paused --> completed | failed | stopped   (terminal)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from enum import Enum

from shoal.events.models import WorkerDoc


class WorkerState(str, Enum):
    SYNCING = "Syncing"
    ACTIVE = "Active"
    DRAINING = "Draining"
    LEFT = "Left"
    FAILED = "Failed"


WORKER_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.SYNCING: frozenset({WorkerState.ACTIVE, WorkerState.DRAINING, WorkerState.FAILED, WorkerState.LEFT}),
    WorkerState.ACTIVE: frozenset({WorkerState.DRAINING, WorkerState.FAILED}),
    WorkerState.DRAINING: frozenset({WorkerState.LEFT, WorkerState.FAILED}),
    WorkerState.LEFT: frozenset(),
    WorkerState.FAILED: frozenset(),
}


class FailureCause(str, Enum):
    """Why a worker ended Failed: what decisions read (the record's ``reason`` is for people).

    Moves: a worker is failed with HEARTBEAT_TIMEOUT, STEP_TIMEOUT or EXITED; a HEARTBEAT_TIMEOUT becomes
    EXITED when the node agent's report of the process's end arrives after it (the report
    names the root cause). Nothing else changes a cause."""

    #: Not failed; or failed in a record written before causes were recorded, or with a
    #: cause this version does not know.
    NONE = ""
    #: The coordinator saw no heartbeat for the heartbeat TTL.
    HEARTBEAT_TIMEOUT = "heartbeat_timeout"
    #: A node agent reported that the process ended (exit code or signal, traceback).
    EXITED = "exited"
    #: Its heartbeat was alive but its step stayed busy (not waiting on peers) longer than
    #: the job's ``step_timeout``: a hung or far too slow step.
    STEP_TIMEOUT = "step_timeout"


def _cause(value: str) -> FailureCause:
    try:
        return FailureCause(value)
    except ValueError:
        return FailureCause.NONE


#: States whose workers are members of the planned generation.
PLANNED = frozenset({WorkerState.SYNCING, WorkerState.ACTIVE})
#: States whose workers still hold a live process we are watching.
LIVE = frozenset({WorkerState.SYNCING, WorkerState.ACTIVE, WorkerState.DRAINING})


class JobState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"


_TERMINAL = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.STOPPED})
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.PAUSED}) | _TERMINAL,
    JobState.RUNNING: frozenset({JobState.PAUSED}) | _TERMINAL,
    JobState.PAUSED: frozenset({JobState.RUNNING}) | _TERMINAL,
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.STOPPED: frozenset(),
}
TERMINAL_JOB_STATES = _TERMINAL


class IllegalTransition(ValueError):
    """A decision tried a move its state table forbids (a bug in the decision code)."""


def check_worker_move(src: WorkerState, dst: WorkerState) -> None:
    if dst != src and dst not in WORKER_TRANSITIONS[src]:
        raise IllegalTransition(f"worker {src.value} -> {dst.value} is not allowed")


def check_job_move(src: JobState, dst: JobState) -> None:
    if dst != src and dst not in JOB_TRANSITIONS[src]:
        raise IllegalTransition(f"job {src.value} -> {dst.value} is not allowed")


@dataclass(frozen=True)
class WorkerRecord:
    """The coordinator's record of one worker (stored in ``keys.workers`` as the JSON of a
    :class:`~shoal.events.models.WorkerDoc`)."""

    worker_id: str
    state: WorkerState
    joined_ms: int
    host: str = ""
    pid: int = 0
    node: str = ""
    #: For people (``shoal status``, logs); no decision reads it.
    reason: str = ""
    changed_ms: int = 0
    restarts: int = 0
    straggler: bool = False
    #: Why it failed (NONE unless Failed).
    cause: FailureCause = FailureCause.NONE
    #: Its rank in the generation it failed in (-1: none, or not failed).
    rank: int = -1
    #: Its placement as its join reported it: backend, model device, the node's name of its
    #: GPU, and why ("" : not reported).
    backend: str = ""
    device: str = ""
    gpu: str = ""
    placement: str = ""

    def moved(self, dst: WorkerState, reason: str, now_ms: int) -> "WorkerRecord":
        check_worker_move(self.state, dst)
        return replace(self, state=dst, reason=reason, changed_ms=now_ms)

    def failed(self, cause: FailureCause, rank: int, reason: str, now_ms: int) -> "WorkerRecord":
        """This worker moved to Failed for ``cause``, holding ``rank`` (-1: none) when it did."""
        return replace(self.moved(WorkerState.FAILED, reason, now_ms), cause=cause, rank=rank)

    def to_json_dict(self) -> dict:
        """The stored fields (a :class:`WorkerDoc`'s), in declaration order, enums as their values."""
        return WorkerDoc(**{**self.__dict__, "state": self.state.value, "cause": self.cause.value}).model_dump()

    def to_json(self) -> str:
        """The stored value (what ``keys.workers`` holds for this worker)."""
        return json.dumps(self.to_json_dict())

    @classmethod
    def from_json(cls, raw: bytes | str) -> "WorkerRecord":
        """Parse a stored value. Missing optional fields take their defaults and unknown ones
        are ignored; an unknown cause reads as NONE. ValueError (pydantic's ValidationError,
        or an unknown state) if it is not a worker record."""
        doc = WorkerDoc.model_validate_json(raw)
        return cls(**{**doc.model_dump(), "state": WorkerState(doc.state), "cause": _cause(doc.cause)})


@dataclass(frozen=True)
class JobStatus:
    """Job-level state of the coordinator (stored in the ``keys.state`` hash).

    ``applied`` is the stream id of the last event applied: a redelivered event whose id is
    not greater is acknowledged and ignored, which makes every handler idempotent.
    """

    state: JobState = JobState.PENDING
    generation: int = 0
    reason: str = "created"
    applied: str = "0-0"
    next_worker: int = 0
    changed_ms: int = 0
    #: The job's first worker failure (its root cause), for people.
    first_failure: str = ""
    #: The worker id of ``first_failure`` ("" : none yet, or state written before the field).
    first_failure_worker: str = ""
    #: What the agent reported of the first failure's process (the tail of its output,
    #: normally the Python traceback); empty for a heartbeat timeout.
    first_failure_traceback: str = ""
    plan_digest: str = ""
    #: Redis ms of the newest join not yet planned (0: none); joins settle before planning.
    pending_join_ms: int = 0
    #: JSON summary reported with the job's completion (final loss, accuracy, digest...).
    summary: str = ""
    #: Step of the newest checkpoint the Redis LATEST pointer names (0: none yet).
    latest_step: int = 0
    #: Redis ms since which the job has had a planned generation and none formed (no member
    #: reported ready); 0: the newest generation formed, or none is planned (pending, paused).
    unformed_since_ms: int = 0
    #: The newest rendezvous failure a member reported (``w1: ...``), for the reason of a job
    #: that fails because no generation forms; cleared when one forms.
    rendezvous_error: str = ""
    #: Generations of the same members (``formation_digest``, the plan digest) that failed
    #: to form in a row, the newest configuration error among them (a ``FormationError``
    #: value; transient failures leave it) and how many generations in a row failed with it;
    #: all cleared when a generation forms or the members change. See
    #: ``coordinator.decide`` (the back-off and the configuration strikes).
    formation_failures: int = 0
    formation_digest: str = ""
    formation_error: str = ""
    formation_strikes: int = 0
    #: The generation whose formation failure was counted last (a second member's report of
    #: the same generation counts nothing), and the Redis ms at which its members get their
    #: next generation (0: none is due: a back-off is not running).
    formation_failed_generation: int = 0
    formation_retry_ms: int = 0
    #: The generation whose configuration error was counted last in ``formation_strikes``.
    formation_strike_generation: int = 0
    #: Redis ms at which a live member reported that a step of the current generation failed
    #: (a peer that died, a partition that outlasted the collective timeout, a member cut off
    #: from Redis that gave its step up); the same members get a
    #: new generation ``SETTLE_MS`` later unless a membership change re-plans first. 0: none.
    step_failed_ms: int = 0
    #: That report, for people: the reason of the generation it leads to.
    step_failure: str = ""
    #: The highest committed step the coordinator has seen reported on the job's current line
    #: of state (sampled heartbeats, a joiner's ``ready``, a checkpoint); 0: none yet. When a
    #: generation resumes below it (every replica holding the newer state was lost), it drops
    #: to the step resumed at: from there the steps are committed again.
    high_step: int = 0
    #: The generation that reported ``high_step`` (a member of the generation that reports a
    #: step below it, in the same generation, is not resuming: it is only late).
    high_step_generation: int = 0
    #: Committed steps committed again because every replica that held them was lost and the
    #: job resumed from a checkpoint or from scratch (a sum over every such resumption). A
    #: lower bound: steps committed after the coordinator's last report of them are not seen.
    steps_redone: int = 0
    #: The newest evaluation rank 0 reported (periodic or final), JSON
    #: ``{"step", "epoch", "generation", "metrics": {name: float}, "worker_id"}``; "" : none yet.
    #: See :func:`shoal.coordinator.decide.last_eval`.
    eval: str = ""
    #: Joins the coordinator refused (the job was at ``max_workers``, or already ended: a
    #: worker that came late), and the newest refusal's reason, for ``shoal status``.
    rejected_joins: int = 0
    last_rejection: str = ""
    #: Shards of the job's streaming dataset as the first worker that reported it said (0: not
    #: a streaming dataset), and the newest table's owners (JSON of ``ShardTable.shard_owners``;
    #: "" : none yet): the next plan starts from them, so owners are sticky.
    num_shards: int = 0
    shard_owners: str = ""

    def to_hash(self) -> dict[str, str]:
        return {
            "state": self.state.value,
            "generation": str(self.generation),
            "reason": self.reason,
            "applied": self.applied,
            "next_worker": str(self.next_worker),
            "changed_ms": str(self.changed_ms),
            "first_failure": self.first_failure,
            "first_failure_worker": self.first_failure_worker,
            "first_failure_traceback": self.first_failure_traceback,
            "plan_digest": self.plan_digest,
            "pending_join_ms": str(self.pending_join_ms),
            "summary": self.summary,
            "latest_step": str(self.latest_step),
            "unformed_since_ms": str(self.unformed_since_ms),
            "rendezvous_error": self.rendezvous_error,
            "formation_failures": str(self.formation_failures),
            "formation_digest": self.formation_digest,
            "formation_error": self.formation_error,
            "formation_strikes": str(self.formation_strikes),
            "formation_failed_generation": str(self.formation_failed_generation),
            "formation_retry_ms": str(self.formation_retry_ms),
            "formation_strike_generation": str(self.formation_strike_generation),
            "step_failed_ms": str(self.step_failed_ms),
            "step_failure": self.step_failure,
            "high_step": str(self.high_step),
            "high_step_generation": str(self.high_step_generation),
            "steps_redone": str(self.steps_redone),
            "eval": self.eval,
            "rejected_joins": str(self.rejected_joins),
            "last_rejection": self.last_rejection,
            "num_shards": str(self.num_shards),
            "shard_owners": self.shard_owners,
        }

    @classmethod
    def from_hash(cls, h: dict) -> "JobStatus":
        g = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in h.items()}
        if not g:
            return cls()
        return cls(
            state=JobState(g.get("state", "pending")),
            generation=int(g.get("generation", 0)),
            reason=g.get("reason", ""),
            applied=g.get("applied", "0-0"),
            next_worker=int(g.get("next_worker", 0)),
            changed_ms=int(g.get("changed_ms", 0)),
            first_failure=g.get("first_failure", ""),
            first_failure_worker=g.get("first_failure_worker", ""),
            first_failure_traceback=g.get("first_failure_traceback", ""),
            plan_digest=g.get("plan_digest", ""),
            pending_join_ms=int(g.get("pending_join_ms", 0)),
            summary=g.get("summary", ""),
            latest_step=int(g.get("latest_step", 0)),
            unformed_since_ms=int(g.get("unformed_since_ms", 0)),
            rendezvous_error=g.get("rendezvous_error", ""),
            formation_failures=int(g.get("formation_failures", 0)),
            formation_digest=g.get("formation_digest", ""),
            formation_error=g.get("formation_error", ""),
            formation_strikes=int(g.get("formation_strikes", 0)),
            formation_failed_generation=int(g.get("formation_failed_generation", 0)),
            formation_retry_ms=int(g.get("formation_retry_ms", 0)),
            formation_strike_generation=int(g.get("formation_strike_generation", 0)),
            step_failed_ms=int(g.get("step_failed_ms", 0)),
            step_failure=g.get("step_failure", ""),
            high_step=int(g.get("high_step", 0)),
            high_step_generation=int(g.get("high_step_generation", 0)),
            steps_redone=int(g.get("steps_redone", 0)),
            eval=g.get("eval", ""),
            rejected_joins=int(g.get("rejected_joins", 0)),
            last_rejection=g.get("last_rejection", ""),
            num_shards=int(g.get("num_shards", 0)),
            shard_owners=g.get("shard_owners", ""),
        )


@dataclass(frozen=True)
class CoordState:
    """Everything a decision needs about one job: status + worker records."""

    status: JobStatus = field(default_factory=JobStatus)
    workers: dict[str, WorkerRecord] = field(default_factory=dict)

    def in_state(self, states: frozenset[WorkerState]) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.state in states]
