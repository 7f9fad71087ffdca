"""Job and worker states with their allowed moves as explicit tables, and the causes of a
worker's failure and of its leaving a generation: the vocabulary every layer uses (the
coordinator decides with it; workers, the CLI, the report, metrics and the HTTP API read it),
so nobody spells a state as a literal.

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
    pending|running|paused --> completed | failed | stopped   (terminal: TERMINAL_JOB_STATES)
"""

from __future__ import annotations

from enum import Enum, StrEnum


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

    Moves: a worker is failed with HEARTBEAT_TIMEOUT, STEP_TIMEOUT, EXITED, REPLICA_GROUP or STUCK; a
    HEARTBEAT_TIMEOUT becomes EXITED when the node agent's report of the process's end arrives
    after it (the report names the root cause). Nothing else changes a cause."""

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
    #: Elastic HSDP: another member of its replica group failed or left, and a replica group
    #: goes whole (its shard group cannot go on without that member); it was alive.
    REPLICA_GROUP = "replica_group"
    #: The progress watchdog: it kept aborting the same step, generation after generation of
    #: the same members, while the job's committed step did not advance; it was alive. Its
    #: process is started again (``WorkerExit.RESTART``, 75), not rejoined with its state.
    STUCK = "stuck"
    #: Elastic HSDP: its replica group spanned nodes and was dissolved so that its members
    #: regroup with node-mates (``coordinator.decide``); it was alive and healthy. Not a
    #: failure: no failure is recorded and its peers do not abort collectives with it; its
    #: process is started again (``WorkerExit.RESTART``, 75) and joins a group on its own node.
    REGROUPED = "regrouped"

    @classmethod
    def parse(cls, value: object) -> "FailureCause":
        """The member named ``value``; NONE for one this version does not know."""
        if isinstance(value, FailureCause):
            return value
        try:
            return cls(value)
        except ValueError:
            return cls.NONE


#: States whose workers are members of the planned generation.
PLANNED = frozenset({WorkerState.SYNCING, WorkerState.ACTIVE})
#: States whose workers still hold a live process we are watching.
LIVE = frozenset({WorkerState.SYNCING, WorkerState.ACTIVE, WorkerState.DRAINING})


class JobState(StrEnum):
    """A job's state (the moves in :data:`JOB_TRANSITIONS`). A ``StrEnum``: equal to its value
    and shown as it (``f"{state}"`` is ``running``), so a state read raw compares as it is."""

    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"


#: The states a job ends in; nothing changes a job once it is in one. The one spelling of
#: them: a member is equal to (and hashes like) its value, so a state read raw as text
#: (``"completed"``) is ``in`` it too; :func:`is_terminal` also takes bytes and None.
TERMINAL_JOB_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.STOPPED})
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.PAUSED}) | TERMINAL_JOB_STATES,
    JobState.RUNNING: frozenset({JobState.PAUSED}) | TERMINAL_JOB_STATES,
    JobState.PAUSED: frozenset({JobState.RUNNING}) | TERMINAL_JOB_STATES,
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.STOPPED: frozenset(),
}


class IllegalTransition(ValueError):
    """A decision tried a move its state table forbids (a bug in the decision code)."""


def check_worker_move(src: WorkerState, dst: WorkerState) -> None:
    if dst != src and dst not in WORKER_TRANSITIONS[src]:
        raise IllegalTransition(f"worker {src.value} -> {dst.value} is not allowed")


def check_job_move(src: JobState, dst: JobState) -> None:
    if dst != src and dst not in JOB_TRANSITIONS[src]:
        raise IllegalTransition(f"job {src.value} -> {dst.value} is not allowed")


class RemovalCause(str, Enum):
    """Why a member of one generation is not a member of the next (a control entry's
    ``causes``): one of the failure causes, or LEFT (it drained or left)."""

    EXITED = "exited"
    HEARTBEAT_TIMEOUT = "heartbeat_timeout"
    STEP_TIMEOUT = "step_timeout"
    #: Its replica group lost another member (elastic HSDP).
    REPLICA_GROUP = "replica_group"
    #: The progress watchdog restarted it: it kept aborting the same step.
    STUCK = "stuck"
    #: Its replica group spanned nodes and was regrouped by node (elastic HSDP; not a failure).
    REGROUPED = "regrouped"
    #: Failed, for a reason this version does not name.
    FAILED = "failed"
    #: It asked to leave (SIGTERM) or left: not a failure.
    LEFT = "left"

    @property
    def failure(self) -> bool:
        return self not in (RemovalCause.LEFT, RemovalCause.REGROUPED)

    @classmethod
    def parse(cls, value: str) -> "RemovalCause":
        """The member named ``value``; FAILED for one this version does not know."""
        try:
            return cls(value)
        except ValueError:
            return cls.FAILED


def is_terminal(state: JobState | str | bytes | None) -> bool:
    """Whether a job state is terminal: a :class:`JobState`, or one as read raw from Redis
    (``HGET ... state``: bytes, str, or None for a pending job)."""
    if isinstance(state, bytes):
        state = state.decode(errors="replace")
    return state in TERMINAL_JOB_STATES
