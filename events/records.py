"""The coordinator's two records, defined once for every writer and reader: a job's
``state`` hash (:class:`JobStatus`) and one worker's entry of its ``workers`` hash
(:class:`WorkerRecord`).

Both are frozen dataclasses (decisions derive new ones with ``dataclasses.replace``) read
through pydantic (``TypeAdapter``), so parsing, defaults for missing fields, tolerance of
unknown ones and the published JSON Schema (``docs/schema/``) all come from the one
declaration; writing is generic over the declared fields.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from enum import Enum
from typing import Annotated

from pydantic import BeforeValidator, TypeAdapter

from shoal.events.states import FailureCause, JobState, WorkerState, check_worker_move


def _plain(value: object) -> object:
    return value.value if isinstance(value, Enum) else value


def _text(value: object) -> str:
    """A hash field's value: enums as their value, numbers in decimal, a nested record as
    its JSON."""
    if is_dataclass(value):
        return json.dumps(asdict(value), separators=(",", ":"))
    return str(_plain(value))


def _json_object(value: object) -> object:
    """A nested record's hash value (its JSON) as the dict pydantic validates; an empty or
    unreadable one as its defaults (a record written before the field existed)."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value) if value else {}
        except ValueError:
            return {}
    return value


@dataclass(frozen=True)
class Stall:
    """The progress watchdog's view of a running job (``JobStatus.stall``): a spell in which
    the members keep failing committed ``step`` + 1 and the same members get generation after
    generation, while nothing commits beyond ``step``. Written and read only by
    ``shoal.coordinator.watchdog``; an empty one (``step`` -1) is no spell."""

    #: the committed step whose next step keeps failing (-1: no spell)
    step: int = -1
    #: Redis ms of the spell's first failure
    since_ms: int = 0
    #: generations of the same members planned after a failure of that step, in this round
    generations: int = 0
    #: the generation whose failure was counted last (another member's report of it counts nothing)
    counted_generation: int = 0
    #: worker id -> failures of that step it reported in this spell, and of those, the ones
    #: it gave up itself (``StepFailed.local``: its group aborted here, its fence refused)
    reporters: dict[str, int] = field(default_factory=dict)
    local: dict[str, int] = field(default_factory=dict)
    #: the newest failure's error, one line, for people
    error: str = ""
    #: rounds in which the watchdog already restarted the members that kept failing it
    restarts: int = 0


@dataclass(frozen=True)
class WorkerRecord:
    """The coordinator's record of one worker: the value of one field of a job's ``workers``
    hash (its JSON). Writer: the coordinator. Readers: the coordinator when it takes a job
    over, ``shoal status``, metrics, the chaos soak's checks, a worker checking it is still on
    record. Everything but ``worker_id``, ``state`` and ``joined_ms`` is optional: records
    written before a field existed read with its default; unknown fields are ignored."""

    worker_id: str
    #: Syncing, Active, Draining, Left, Failed (see the module docstring).
    state: WorkerState
    joined_ms: int = 0
    host: str = ""
    pid: int = 0
    node: str = ""
    #: For people (``shoal status``, logs); no decision reads it.
    reason: str = ""
    changed_ms: int = 0
    restarts: int = 0
    straggler: bool = False
    #: Why it failed (NONE unless Failed; a cause this version does not know reads as NONE).
    cause: Annotated[FailureCause, BeforeValidator(FailureCause.parse)] = FailureCause.NONE
    #: Its rank in the generation it failed in (-1: none, or not failed).
    rank: int = -1
    #: Its placement as its join reported it: backend, model device, the node's name of its
    #: GPU, and why ("" : not reported).
    backend: str = ""
    device: str = ""
    gpu: str = ""
    placement: str = ""
    #: The generation that first made it a member (0: never planned yet) and the one that
    #: first left it out once it was no longer planned (0: still planned, or never was): what a
    #: control entry's ``joined`` and ``removed`` are computed from.
    planned_in: int = 0
    dropped_in: int = 0
    #: Elastic HSDP: the replica group it belongs to for its life (``r<n>``; "" : none yet,
    #: or data parallelism) and its shard index in it (-1: none).
    replica_group: str = ""
    shard: int = -1

    def moved(self, dst: WorkerState, reason: str, now_ms: int) -> "WorkerRecord":
        check_worker_move(self.state, dst)
        return replace(self, state=dst, reason=reason, changed_ms=now_ms)

    def failed(self, cause: FailureCause, rank: int, reason: str, now_ms: int) -> "WorkerRecord":
        """This worker moved to Failed for ``cause``, holding ``rank`` (-1: none) when it did."""
        return replace(self.moved(WorkerState.FAILED, reason, now_ms), cause=cause, rank=rank)

    def to_json_dict(self) -> dict:
        """The stored fields in declaration order, enums as their values."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def to_json(self) -> str:
        """The stored value (what ``keys.workers`` holds for this worker)."""
        return json.dumps(self.to_json_dict())

    @classmethod
    def from_json(cls, raw: bytes | str) -> "WorkerRecord":
        """Parse a stored value. Missing optional fields take their defaults and unknown ones
        are ignored; an unknown cause reads as NONE. ValueError (pydantic's ValidationError)
        if it is not a worker record (not JSON, no ``worker_id``, an unknown state)."""
        return _RECORD.validate_json(raw)


@dataclass(frozen=True)
class JobStatus:
    """Job-level state of the coordinator (stored in the ``keys.state`` hash).

    ``applied`` is the stream id of the last event applied: a redelivered event whose id is
    not greater is acknowledged and ignored, which makes every handler idempotent.
    """

    #: pending, running, paused, completed, failed, stopped (see the module docstring).
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
    #: Elastic HSDP: the number of the next replica group formed (its id: ``r<n>``).
    next_replica: int = 0
    #: The progress watchdog's spell (``Stall``; stored as JSON in one field).
    stall: Annotated[Stall, BeforeValidator(_json_object)] = field(default_factory=Stall)
    #: Redis ms at which ``high_step`` last rose (0: not yet): how long the job has gone
    #: without a new committed step, as the coordinator saw it.
    high_step_ms: int = 0
    #: The members' median step time as last sampled, ms (0: not sampled yet): the watchdog's
    #: time bound is a multiple of it.
    step_ms: int = 0
    #: Elastic HSDP: Redis ms at which workers waiting for node-mates (a settle window, or a
    #: cross-node group being regrouped) are planned again (0: none wait).
    regroup_at_ms: int = 0
    #: ... and until when a regroup's restarted members are awaited: meanwhile workers on their
    #: nodes do not form cross-node groups (0: no regroup under way).
    regroup_until_ms: int = 0

    def to_hash(self) -> dict[str, str]:
        """The ``state`` hash's fields: every value a string (integers in decimal)."""
        return {f.name: _text(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_hash(cls, h: dict) -> "JobStatus":
        """Parse an HGETALL reply (bytes or str): missing fields take their defaults, unknown
        ones are ignored (a newer writer's); an empty hash is a ``pending`` job. ValueError
        (pydantic's ValidationError) naming the field when one does not parse."""
        g = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in h.items()}
        known = {k: v for k, v in g.items() if k in _STATUS_FIELDS}
        return _STATUS.validate_python(known) if known else cls()


_RECORD: TypeAdapter[WorkerRecord] = TypeAdapter(WorkerRecord)
_STATUS: TypeAdapter[JobStatus] = TypeAdapter(JobStatus)
_STATUS_FIELDS = frozenset(f.name for f in fields(JobStatus))
