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
from typing import Annotated, Any

from pydantic import BeforeValidator, TypeAdapter, ValidationError

from shoal.events.states import FailureCause, JobState, WorkerState, check_job_move, check_worker_move


def _plain(value: object) -> object:
    return value.value if isinstance(value, Enum) else value


def _text(value: object) -> str:
    """A hash field's value: enums as their value, numbers in decimal, a nested record or a
    mapping as its JSON; None and an empty mapping as "" (none)."""
    if is_dataclass(value):
        return json.dumps(asdict(value), separators=(",", ":"))
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":")) if value else ""
    if value is None:
        return ""
    return str(_plain(value))


def _json_object(value: object) -> object:
    """A nested record's (or a mapping's) hash value, its JSON, as the dict pydantic
    validates; an empty or unreadable one, or JSON that is not an object, as its defaults (a
    record written before the field existed)."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value) if value else {}
        except ValueError:
            return {}
    return value if isinstance(value, dict) or is_dataclass(value) else {}


def _optional(kind: object):
    """A validator of an optional JSON field of the hash: its value (JSON text, or the parsed
    value) as ``kind``; None when it is empty, does not parse or is not a ``kind`` (a field
    written before it existed, or damaged: one bad field never loses the job's record)."""
    adapter = TypeAdapter(kind)

    def parse(value: object) -> object:
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        if value is None or value == "":
            return None
        try:
            return adapter.validate_json(value) if isinstance(value, str) else adapter.validate_python(value)
        except ValidationError:
            return None

    return BeforeValidator(parse)


@dataclass(frozen=True)
class Formation:
    """Whether a running job's planned generations form (``JobStatus.formation``; stored as
    JSON in one field): since when none has, the newest rendezvous error, the back-off of the
    same members' generations that could not form and the configuration strikes. Written and
    read by the coordinator's formation policy (``coordinator/formation.py``); all cleared (this
    record's defaults) once a generation forms."""

    #: Redis ms since which the job has had a planned generation and none formed (no member
    #: reported ready); 0: the newest generation formed, or none is planned (pending, paused).
    unformed_since_ms: int = 0
    #: The newest rendezvous failure a member reported (``w1: ...``), for the reason of a job
    #: that fails because no generation forms.
    rendezvous_error: str = ""
    #: Generations of the same members (``digest``, their plan digest) that failed to form in
    #: a row; the members changing starts the count over.
    failures: int = 0
    digest: str = ""
    #: The generation whose failure was counted last (a second member's report of the same
    #: generation counts nothing), and the Redis ms at which its members get their next
    #: generation (0: none is due: a back-off is not running).
    failed_generation: int = 0
    retry_ms: int = 0
    #: The newest configuration error among those failures (a ``FormationError`` value;
    #: transient failures leave it), how many generations in a row failed with it, and the
    #: generation counted last in ``strikes``.
    config_error: str = ""
    strikes: int = 0
    strike_generation: int = 0


#: The fields :class:`Formation` held as fields of the hash itself before it was one record
#: (read from a hash an older coordinator wrote): hash field -> the record's field.
_FLAT_FORMATION = {
    "unformed_since_ms": "unformed_since_ms", "rendezvous_error": "rendezvous_error",
    "formation_failures": "failures", "formation_digest": "digest",
    "formation_failed_generation": "failed_generation", "formation_retry_ms": "retry_ms",
    "formation_error": "config_error", "formation_strikes": "strikes",
    "formation_strike_generation": "strike_generation",
}


@dataclass(frozen=True)
class Evaluation:
    """The newest evaluation rank 0 reported, periodic or final (``JobStatus.eval``; stored
    as JSON in one field): its committed ``step``, the epochs complete after it, the
    generation it was committed in, its metrics and who reported it."""

    step: int = 0
    epoch: int = 0
    generation: int = 0
    #: name -> finite number
    metrics: dict[str, float] = field(default_factory=dict)
    worker_id: str = ""


#: A streaming dataset's shard owners: worker id -> its shards as half-open ``[start, stop]``
#: ranges (the wire form of ``ShardTable.shard_owners``).
ShardOwners = dict[str, list[tuple[int, int]]]


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
class Split:
    """Slices by speed (``batch_split: by_speed``; ``JobStatus.split``): what the coordinator
    measured of each live worker's speed and how it split the current generation's batch.
    Written and read only by ``shoal.coordinator.slices``; an empty one: nothing measured."""

    #: worker id -> its smoothed rate of own work, samples per second
    rates: dict[str, float] = field(default_factory=dict)
    #: worker id -> its heartbeat's ``[work_samples, work_seconds]`` at the last look (the
    #: next look's rate is over the steps in between)
    seen: dict[str, list[float]] = field(default_factory=dict)
    #: worker id -> its samples of a full global batch in the newest generation planned by
    #: speed (empty: that generation's slices are equal)
    sizes: dict[str, int] = field(default_factory=dict)
    #: that generation, and the committed step (``JobStatus.high_step``) when it was planned:
    #: the next look at re-planning comes ``batch_split_every`` steps later
    generation: int = 0
    step: int = 0


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

    ``applied`` is the stream id of the newest event applied. An event is applied and
    acknowledged in one fenced script, so a pending (reclaimed) one is applied whatever its
    id; a first delivery whose id is not greater (a consumer group created anew over an old
    stream) is acknowledged and ignored.
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
    #: The summary rank 0 reported with the job's completion (its ``step``, ``cursor``,
    #: ``digest`` and final metrics; the coordinator adds ``steps_redone``), stored as JSON in
    #: one field; {} : none yet.
    summary: Annotated[dict[str, Any], BeforeValidator(_json_object)] = field(default_factory=dict)
    #: Step of the newest checkpoint the Redis LATEST pointer names (0: none yet).
    latest_step: int = 0
    #: Whether the planned generations form: the formation clock, the newest rendezvous
    #: error, the back-off and the configuration strikes (``Formation``; stored as JSON in one
    #: field).
    formation: Annotated[Formation, BeforeValidator(_json_object)] = field(default_factory=Formation)
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
    #: The newest evaluation rank 0 reported (``Evaluation``; stored as JSON in one field);
    #: None ("" in the hash): none yet.
    eval: Annotated[Evaluation | None, _optional(Evaluation)] = None
    #: Joins the coordinator refused (the job was at ``max_workers``, or already ended: a
    #: worker that came late), and the newest refusal's reason, for ``shoal status``.
    rejected_joins: int = 0
    last_rejection: str = ""
    #: Shards of the job's streaming dataset as the first worker that reported it said (0: not
    #: a streaming dataset), and the newest table's owners (``ShardTable.shard_owners``, stored
    #: as JSON in one field; None, "" in the hash: none yet): the next plan starts from them, so
    #: owners are sticky.
    num_shards: int = 0
    shard_owners: Annotated[ShardOwners | None, _optional(ShardOwners)] = None
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
    #: Slices by speed: the measured rates and the current split (``Split``; stored as JSON
    #: in one field).
    split: Annotated[Split, BeforeValidator(_json_object)] = field(default_factory=Split)

    def moved(self, dst: JobState, now_ms: int) -> "JobStatus":
        """This status in state ``dst``, changed at ``now_ms``; itself when it is in ``dst``
        already. IllegalTransition when ``JOB_TRANSITIONS`` forbids the move (a bug)."""
        if dst == self.state:
            return self
        check_job_move(self.state, dst)
        return replace(self, state=dst, changed_ms=now_ms)

    def to_hash(self) -> dict[str, str]:
        """The ``state`` hash's fields: every value a string (integers in decimal)."""
        return {f.name: _text(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_hash(cls, h: dict) -> "JobStatus":
        """Parse an HGETALL reply (bytes or str): missing fields take their defaults, unknown
        ones are ignored (a newer writer's); an empty hash is a ``pending`` job; the formation
        fields of a hash written before ``formation`` was one record are read into it. An
        ``eval`` or ``shard_owners`` that does not parse reads as None. ValueError (pydantic's
        ValidationError) naming the field when another one does not parse."""
        g = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in h.items()}
        known = {k: v for k, v in g.items() if k in _STATUS_FIELDS}
        if "formation" not in g and _FLAT_FORMATION.keys() & g.keys():  # written before it was one record
            known["formation"] = {ours: g[flat] for flat, ours in _FLAT_FORMATION.items() if flat in g}
        return _STATUS.validate_python(known) if known else cls()


_RECORD: TypeAdapter[WorkerRecord] = TypeAdapter(WorkerRecord)
_STATUS: TypeAdapter[JobStatus] = TypeAdapter(JobStatus)
_STATUS_FIELDS = frozenset(f.name for f in fields(JobStatus))
