"""Pydantic v2 models of everything that crosses Redis: worker events, shard tables, replies.

Wire rules (evolve only by adding optional fields):
- every event carries ``schema_version``, a unique ``event_id``, ``job_id``, ``worker_id``
  (None on a join request, before the coordinator assigned one, and on the events of senders
  that have none: an operator's stop, a node agent's start failure), ``ts`` (sender's
  unix time, informational; decisions use Redis server time) and a ``kind`` discriminator;
- readers ignore unknown fields, so a newer writer never breaks an older reader;
- everything is JSON a human can read with ``redis-cli``; nothing is pickled.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from shoal.events.validation import first_error

SCHEMA_VERSION = 1
#: Largest accepted ``data`` field of an event stream entry; bigger entries are dead-lettered.
MAX_EVENT_BYTES = 64 * 1024


def new_event_id() -> str:
    return uuid.uuid4().hex


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class EventBase(_Wire):
    """Fields every worker event carries (the JSON in the ``data`` field of an ``events``
    stream entry)."""

    #: Wire format version; a reader refuses an event newer than it knows (1 today).
    schema_version: int = SCHEMA_VERSION
    #: Unique per event, chosen by the sender (shoal sends 32 lowercase hex digits, a UUID4).
    #: Not the stream entry id: a join's reply key is named after this value, so a sender
    #: that wants the reply must set it.
    event_id: Annotated[str, Field(min_length=1, max_length=64)] = Field(default_factory=new_event_id)
    #: The job (must match the stream's job; 1-64 of letters, digits, ``_``, ``.``, ``-``).
    job_id: Annotated[str, Field(min_length=1, max_length=64)]
    #: The sender's worker id as the coordinator assigned it (``w0``, ``w1``, ...); null on a
    #: join request (before it has one), an operator's stop and a start failure.
    worker_id: Annotated[str | None, Field(max_length=64)] = None
    #: The sender's unix time in seconds, informational (decisions use Redis server time).
    ts: float = Field(default_factory=time.time)


class JoinRequest(EventBase):
    """A worker process asks to join. The reply goes to ``keys.join_reply(event_id)``."""

    kind: Literal["join"] = "join"
    #: The joining process's host name (shown by status; the coordinator records it).
    host: Annotated[str, Field(max_length=255)] = ""
    #: Its process id: an agent's exit report about another pid is ignored.
    pid: int = 0
    #: The node agent that started it ("" : none).
    node: Annotated[str, Field(max_length=255)] = ""
    # (``previous_worker_id``, sent by earlier versions, was never used and is ignored: a
    # restarted process joins under a new id; the restart budget is kept by its node agent)
    #: The newest generation this process has been a member of (0: none). A process that
    #: rejoins after Redis lost the job asks the coordinator to number on above it, so a
    #: generation (and its rendezvous prefix) never repeats for a live process.
    last_generation: Annotated[int, Field(ge=0)] = 0
    #: Shards of the job's streaming dataset, as this worker read its index (None: not a
    #: streaming dataset, or a sender that predates the field). The coordinator, which never
    #: reads storage, plans the tables' ``shard_owners`` over this many shards.
    num_shards: Annotated[int, Field(ge=0)] | None = None
    #: The process group backend this worker trains with (``nccl`` or ``gloo``, as its
    #: placement chose: :mod:`shoal.worker.placement`; None: not reported, e.g. a simulated
    #: worker). Members of one generation must agree: the coordinator refuses a joiner whose
    #: backend differs from the planned members'.
    backend: Annotated[str, Field(max_length=16)] | None = None
    #: Where its model lives: ``cpu`` or ``cuda:<index>`` (None: not reported).
    device: Annotated[str, Field(max_length=32)] | None = None
    #: The GPU it uses as its node names it (a ``CUDA_VISIBLE_DEVICES`` entry: an index or a
    #: UUID; None: no GPU). Two workers of one node with the same ``gpu`` share it.
    gpu: Annotated[str, Field(max_length=64)] | None = None
    #: Why its placement is what it is, for people (``shoal status``).
    placement: Annotated[str, Field(max_length=300)] = ""


class Ready(EventBase):
    """The worker has switched to ``generation`` (group formed, state received): Syncing -> Active."""

    kind: Literal["ready"] = "ready"
    generation: Annotated[int, Field(ge=0)]
    #: The committed step this member starts ``generation`` from (after the catch-up: every
    #: member of a generation reports the same one). None: not reported (a sender that
    #: predates the field); the coordinator then infers nothing from it.
    step: Annotated[int, Field(ge=0)] | None = None


class LeaveRequest(EventBase):
    """The worker was asked to stop (SIGTERM): Active/Syncing -> Draining; re-plan without it."""

    kind: Literal["leave"] = "leave"
    reason: Annotated[str, Field(max_length=1000)] = "SIGTERM"


class Left(EventBase):
    """The draining worker finished its last step and is exiting: Draining -> Left."""

    kind: Literal["left"] = "left"


class _ProcessEnded(EventBase):
    """What a node agent reports about a worker process that ended."""

    exit_code: int | None = None
    signal: int | None = None
    #: The last lines of the process's output (its traceback, when it printed one).
    traceback: Annotated[str, Field(max_length=8000)] = ""
    will_restart: bool = False
    #: The agent spent the restart budget on this worker's slot and will not restart it.
    gave_up: bool = False
    restarts: int = 0
    #: The dead process's pid (0: unknown).
    pid: int = 0


class WorkerExited(_ProcessEnded):
    """A node agent saw the worker process die (faster than the heartbeat TTL). A report
    about a pid other than the one the worker id joined with (ids restart after Redis lost a
    job) is ignored."""

    kind: Literal["exited"] = "exited"


class WorkerStartFailed(_ProcessEnded):
    """A worker process a node agent started ended before it joined the job, so it has no
    worker id (the entrypoint could not be imported, the checkpoint store's settings are
    missing, the job spec could not be read...), or that the agent could not start at all
    (``exit_code`` and ``signal`` None, ``pid`` 0: the job's code package is missing or
    corrupt). ``worker_id`` is None; the process is named
    by ``node``, the agent's ``slot`` and ``pid``. The coordinator records it as a failure
    (the job's first failure when it is the first) and fails the job when the agent gave up
    and too few workers remain."""

    kind: Literal["start_failed"] = "start_failed"
    node: Annotated[str, Field(max_length=255)] = ""
    slot: Annotated[int, Field(ge=0)] = 0

    def who(self) -> str:
        """``the worker process on node n1 (slot 0, pid 4242)``."""
        pid = f", pid {self.pid}" if self.pid else ""
        return f"the worker process on node {self.node or '?'} (slot {self.slot}{pid})"


class FormationError(str, Enum):
    """Why a generation's group could not form, as the worker classified its error
    (:func:`shoal.worker.process_group.formation_error`): a *configuration* error fails the
    same way every time for the same members (the coordinator fails the job after
    :data:`~shoal.coordinator.formation.CONFIG_STRIKES` in a row, naming the fix); a
    *transient* one (timeouts, resets, refused connections, a peer that went away) is retried
    with a back-off until ``formation_timeout``. Readers treat a value they do not know as
    transient."""

    TRANSIENT = "transient"
    #: NCCL refused the group (``ncclInvalidUsage``): typically two ranks on one GPU.
    NCCL_INVALID_USAGE = "nccl_invalid_usage"
    #: The interface named for gloo (``--iface``) does not exist or has no IPv4 address.
    NO_INTERFACE_ADDRESS = "no_interface_address"
    #: CUDA ran out of memory while the group or its first transfer was set up.
    CUDA_OUT_OF_MEMORY = "cuda_out_of_memory"
    #: The worker's device does not exist (an invalid CUDA device ordinal, no GPU visible).
    NO_DEVICE = "no_device"

    @classmethod
    def parse(cls, value: str | None) -> "FormationError":
        """The member named ``value``; TRANSIENT for "" , None or a value this reader does not know."""
        try:
            return cls(value or cls.TRANSIENT.value)
        except ValueError:
            return cls.TRANSIENT

    @property
    def configuration(self) -> bool:
        """Whether retrying with the same members and settings cannot help."""
        return self is not FormationError.TRANSIENT


class StepFailed(EventBase):
    """A step's collective failed on this worker (a peer died): informational for the
    coordinator; or (``rendezvous``) the generation's group could not form."""

    kind: Literal["step_failed"] = "step_failed"
    generation: int = 0
    step: int = 0
    error: Annotated[str, Field(max_length=2000)] = ""
    #: the generation's group could not form at all (rendezvous or state catch-up failed):
    #: the coordinator then publishes a new generation of the same members
    rendezvous: bool = False
    #: with ``rendezvous``: a :class:`FormationError` value classifying ``error`` ("" : not
    #: classified, read as transient)
    formation_error: Annotated[str, Field(max_length=64)] = ""
    #: the step was given up by this worker itself (its group was aborted here, its commit
    #: fence refused), not failed by a peer: the progress watchdog restarts such members first
    local: bool = False


class JobCompleted(EventBase):
    """Rank 0 committed the final step of the job."""

    kind: Literal["completed"] = "completed"
    step: int = 0
    summary: dict = Field(default_factory=dict)


class Checkpointed(EventBase):
    """A complete checkpoint of ``step`` exists in ``store`` (manifest and LATEST written);
    the coordinator moves the job's Redis LATEST pointer to it, never backwards."""

    kind: Literal["checkpoint"] = "checkpoint"
    step: Annotated[int, Field(ge=0)]
    store: Annotated[str, Field(max_length=1000)]
    generation: int = 0


#: At most this many metrics per evaluation (the first ones ``eval_fn`` returned are kept).
MAX_EVAL_METRICS = 64
#: Longest metric name kept.
MAX_METRIC_NAME = 100

MetricName = Annotated[str, Field(min_length=1, max_length=MAX_METRIC_NAME)]
#: A metric value: a finite float (JSON holds no NaN or infinity; a reader rejects them).
MetricValue = Annotated[float, Field(allow_inf_nan=False)]


def finite_metrics(raw: object) -> tuple[dict[str, float], list[str]]:
    """What of ``eval_fn``'s result an :class:`EvalReported` (and a completion summary) can
    carry: name -> finite float, at most :data:`MAX_EVAL_METRICS` names of at most
    :data:`MAX_METRIC_NAME` characters. Returns the kept metrics and, for people, one line
    per value left out (not a number, not finite, a bad name, one too many). Never raises;
    ``raw`` that is not a mapping keeps nothing."""
    if not hasattr(raw, "items"):
        return {}, [f"eval_fn returned {type(raw).__name__}, not a dict of name -> number"]
    kept: dict[str, float] = {}
    dropped: list[str] = []
    for name, value in raw.items():
        key = str(name)
        try:
            v = float(value)
        except (TypeError, ValueError):
            dropped.append(f"{key[:MAX_METRIC_NAME]!r}: {type(value).__name__} is not a number")
            continue
        if not math.isfinite(v):
            dropped.append(f"{key[:MAX_METRIC_NAME]!r}: {v} is not finite")
        elif not 0 < len(key) <= MAX_METRIC_NAME:
            dropped.append(f"{key[:MAX_METRIC_NAME]!r}...: the name must have 1 to {MAX_METRIC_NAME} characters")
        elif len(kept) >= MAX_EVAL_METRICS:
            dropped.append(f"{key!r}: more than {MAX_EVAL_METRICS} metrics")
        else:
            kept[key] = v
    return kept, dropped


class EvalReported(EventBase):
    """Rank 0 ran the job's ``eval_fn`` on the model as of committed ``step`` (periodically,
    per ``eval_every_steps``/``eval_every_epochs``, and once at the end, ``final``, before
    :class:`JobCompleted`). Every member evaluates the same step (the replicas are identical);
    only rank 0 reports. The coordinator keeps the newest in the job's ``eval`` field."""

    kind: Literal["eval"] = "eval"
    step: Annotated[int, Field(ge=0)]
    #: The epoch (0-based) the cursor is in after ``step``, as in the heartbeat: an
    #: evaluation at the end of the first epoch says 1 (one epoch complete).
    epoch: Annotated[int, Field(ge=0)] = 0
    #: The generation ``step`` was committed in (0: not known).
    generation: Annotated[int, Field(ge=0)] = 0
    metrics: Annotated[dict[MetricName, MetricValue], Field(max_length=MAX_EVAL_METRICS)] = Field(default_factory=dict)
    #: The evaluation at the end of training (the one the completion summary holds).
    final: bool = False


class StopJob(EventBase):
    """An operator asked the job to stop (``shoal stop``); ``worker_id`` is None."""

    kind: Literal["stop"] = "stop"
    reason: Annotated[str, Field(max_length=1000)] = "stopped by operator"


WorkerEvent = Annotated[
    Union[JoinRequest, Ready, LeaveRequest, Left, WorkerExited, WorkerStartFailed, StepFailed, JobCompleted, StopJob,
          Checkpointed, EvalReported],
    Field(discriminator="kind"),
]
_EVENT_ADAPTER: TypeAdapter = TypeAdapter(WorkerEvent)


class InvalidEvent(ValueError):
    """The stream entry is not a valid event; ``reason`` is a one-line explanation."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def encode_event(event: EventBase) -> dict[str, str]:
    """Stream entry fields for ``event`` (a single ``data`` field holding JSON)."""
    return {"data": event.model_dump_json()}


def decode_event(fields: dict[bytes | str, bytes | str], expected_job: str | None = None) -> EventBase:
    """Parse a stream entry; raises InvalidEvent with a readable reason for anything malformed.

    Checks, in order: a ``data`` field exists, it is not oversized, it is UTF-8 JSON, it
    matches one of the event models, its schema version is one we can read, and its
    ``job_id`` matches the stream it came from.
    """
    norm = {(k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k)): v for k, v in fields.items()}
    raw = norm.get("data")
    if raw is None:
        raise InvalidEvent(f"no 'data' field (fields: {sorted(norm)[:5]})")
    if len(raw) > MAX_EVENT_BYTES:
        raise InvalidEvent(f"oversized: {len(raw)} bytes > {MAX_EVENT_BYTES}")
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
        obj = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidEvent(f"not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise InvalidEvent(f"not a JSON object: {type(obj).__name__}")
    version = obj.get("schema_version", SCHEMA_VERSION)
    if not isinstance(version, int) or version > SCHEMA_VERSION or version < 1:
        raise InvalidEvent(f"unsupported schema_version {version!r} (this reader knows 1..{SCHEMA_VERSION})")
    try:
        event = _EVENT_ADAPTER.validate_python(obj)
    except ValidationError as exc:
        raise InvalidEvent(f"schema: {first_error(exc, root='(event)')} ({exc.error_count()} error(s))") from exc
    if expected_job is not None and event.job_id != expected_job:
        raise InvalidEvent(f"job_id {event.job_id!r} does not match stream's job {expected_job!r}")
    return event


# --------------------------------------------------------------------------------------------
# Coordinator -> worker documents
# --------------------------------------------------------------------------------------------


class Member(_Wire):
    """One member of a generation: its rank in the group and its part of the shard space."""

    #: The worker id the coordinator assigned at join (``w<n>``).
    worker_id: str
    #: Its rank in this generation's process group (0 .. world_size-1).
    rank: int
    #: Half-open ``[start, stop, step]`` ranges over the shard space (see ShardTable).
    ranges: list[tuple[int, int, int]]
    #: Elastic HSDP (the table's ``shard_size`` > 1): the member's replica group (its id, e.g.
    #: ``r3``, for the group's life; its index in this generation, 0..replicas-1) and its
    #: shard index in it (0..shard_size-1). ``rank`` = replica x shard_size + shard.
    group: str = ""
    replica: int = 0
    shard: int = 0


class ShardTable(_Wire):
    """One generation's plan. Ranges of all members are disjoint and cover ``0..num_samples-1``.

    ``num_samples`` is the job's shard space (by default the global batch size: each rank
    takes these positions of every global batch). ``paused`` tables have no members.
    """

    job_id: str
    #: Increases with every plan; a worker switches to the newest generation it sees.
    generation: int
    #: Number of members (ranks) of the generation's process group.
    world_size: int
    #: The job's ``shard_strategy`` (contiguous, round_robin, hash).
    strategy: str
    num_samples: int
    members: list[Member]
    #: Fewer live workers than ``min_workers``: no members, training waits.
    paused: bool = False
    #: Why this generation was planned (who joined, failed or left), for people.
    reason: str = ""
    #: Epoch of the coordinator that wrote it (for debugging fencing).
    epoch: int = 0
    #: Redis server time (ms) when it was planned.
    planned_at_ms: int = 0
    #: Workers this plan drops because they were declared failed (heartbeat timeout, step
    #: timeout, process exited) - not those that left or drained. A member of an older
    #: generation that still shares a group with one of them aborts that group's collectives
    #: at once instead of waiting for a peer that will not come (a hung NCCL or gloo peer).
    evicted: list[str] = Field(default_factory=list)
    #: Workers per replica group (elastic HSDP; 1: data parallelism).
    shard_size: int = 1
    #: Streaming datasets only (None otherwise): which member caches which shards - worker id
    #: -> half-open ``[start, stop]`` ranges of shard numbers; every shard has one owner. Each
    #: rank reads its own shards' samples of a global batch locally (see
    #: ``shoal.worker.stream_order``); planned by ``shoal.coordinator.owners.plan_owners``.
    shard_owners: dict[str, list[tuple[int, int]]] | None = None
    #: None, unless no member of this generation holds the job's state (every member that held
    #: it was lost, e.g. a joiner's catch-up source killed mid-transfer): then the step of the
    #: job's LATEST checkpoint, which the generation starts from - a member whose committed
    #: step is below it loads the newest checkpoint from the store before forming the group
    #: (one at or above it keeps its state; the catch-up takes the most advanced).
    restore_step: int | None = None
    #: A re-slice (slices by speed; 0: not one): the generation right before this one, whose
    #: process group this one keeps - the same members at the same ranks, only the ranges
    #: differ. Its members switch in place, without a new group, after the step whose
    #: all-reduce says one of them saw a newer table; each reads exactly this generation's
    #: table then (``shoal.worker.decide``). A member that is not in that group forms it anew.
    continues: int = 0

    def member(self, worker_id: str) -> Member | None:
        return next((m for m in self.members if m.worker_id == worker_id), None)


class JoinReply(_Wire):
    """The coordinator's answer to a join request, the one element of the LIST
    ``shoal:{J}:join:<event_id>`` (the request's JSON ``event_id``, not its stream entry id),
    which expires after 60 s. A refused worker should exit (shoal's exit with code 4)."""

    #: True: joined; the worker id below is the sender's from now on.
    accepted: bool
    #: The assigned worker id (``w<n>``, unique within the job), when accepted.
    worker_id: str | None = None
    #: Why a join was refused (the job ended, or it is at ``max_workers``).
    reason: str = ""
    generation: int | None = None


class Heartbeat(_Wire):
    """Value of a worker's heartbeat key (also what ``status`` shows per worker)."""

    worker_id: str
    #: Committed steps so far (the step the worker's state is after).
    step: int = 0
    #: The generation it trains in.
    generation: int = 0
    #: Seconds of its last step, wall clock, waits included (None: no step yet).
    step_time: float | None = None
    #: A compiled model (``compile:``): frames dynamo compiled in this process, those compiled
    #: after the warm-up before joining (recompiles: 0 when no shape or guard changed), and the
    #: warm-up's seconds (None: not compiled).
    compiled_frames: int | None = None
    recompiles: int | None = None
    compile_seconds: float | None = None
    #: Seconds from its last committed step to this beat (None: none yet): the beat's
    #: ``last_seen`` score (Redis time) minus this is when it last committed, on Redis's clock.
    since_commit: float | None = None
    #: Loss of its last committed step (None: none yet).
    loss: float | None = None
    #: Digest of its parameters, published at each generation switch and every few steps
    #: (replicas at the same step have the same one; None: not computed yet).
    digest: str | None = None
    pid: int = 0
    #: The job's length in steps (``max_steps``, else epochs x steps per epoch), as the
    #: worker computed it from its dataset (None: not reported).
    total_steps: int | None = None
    #: The epoch (0-based) the worker's cursor is in (None: not reported).
    epoch: int | None = None
    #: Seconds of its last committed step's own work: data, forward, backward (None: not reported).
    compute_time: float | None = None
    #: The worker process's peak resident memory so far, MiB (None: not reported): what a
    #: sharded job (``shard_size``) saves per worker against data parallelism.
    peak_rss_mb: float | None = None
    #: Seconds its last committed step waited on the gradient all-reduces after backward had
    #: returned: the communication NOT hidden by backward (None: not reported).
    exposed_comm_time: float | None = None
    #: Since the process started: samples of its own slices in committed steps, and the
    #: seconds of those steps' own work (the sum of their ``compute_time``s). Two beats give
    #: its rate over the steps between them: what ``batch_split: by_speed`` sizes slices by
    #: (None: not reported). A new process starts from 0 (and has a new worker id).
    work_samples: int | None = None
    work_seconds: float | None = None
    #: Seconds its last committed step waited for its batches (the input pipeline did not
    #: keep ahead; part of ``compute_time``) (None: not reported).
    input_wait_time: float | None = None
    #: Streaming datasets only (None otherwise, or not reported): bytes this worker downloaded
    #: (whole shards and ranged reads), its cache hit rate (0..1), the shards it owns in its
    #: table, samples it read remotely (ranged reads), and its last step's balance error (the
    #: largest minus the smallest rank's sample count).
    bytes_downloaded: int | None = None
    cache_hit_rate: float | None = None
    shards_owned: int | None = None
    remote_reads: int | None = None
    balance_error: int | None = None
    #: FLOPs of one sample's forward and backward: measured on its first committed step
    #: (torch's FLOP counter) or the spec's ``flops_per_sample`` (None: not yet, or none).
    flops_per_sample: float | None = None
    #: Its device's peak FLOP/s at the job's precision: the spec's ``peak_flops``, else a
    #: known GPU's datasheet figure (``shoal.worker.flops``); None: not known (a CPU).
    peak_flops: float | None = None
    #: Tokens in one sample (``TrainingSetup.tokens_per_sample``; None: not a token sequence).
    tokens_per_sample: int | None = None


class LaunchSettings(_Wire):
    """A job's ``launch`` hash (queue-launched jobs only). Writer: ``shoal submit``. Reader:
    the coordinator's launcher."""

    #: Worker processes per launch unit.
    workers: int = 1
    #: Launch units enqueued at submit time.
    units: int = 0

    @classmethod
    def from_hash(cls, h: dict) -> "LaunchSettings":
        """Parse an HGETALL reply (bytes or str); ValidationError (a ValueError) if malformed."""
        return cls.model_validate({(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                                   for k, v in h.items()})


# ---- the LATEST pointer ------------------------------------------------------------------

#: prefix of a checkpoint's folder in a store; the folder of step N is ``step-00000000N``
CHECKPOINT_DIR_PREFIX = "step-"


def checkpoint_dir(step: int) -> str:
    """``step-000000123`` (zero-padded to 9 digits so names sort by step up to 10^9)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{CHECKPOINT_DIR_PREFIX}{step:09d}"


@dataclass(frozen=True)
class LatestPointer:
    """The value of a job's LATEST pointer (Redis key ``latest``, and the store's ``LATEST``
    object): ``{"checkpoint": "step-00000000N", "generation": G, "step": N, "store": URI}``.
    Writers: the coordinator (Redis, moved only forwards) and rank 0's saver (the store).
    ``shoal.storage.latest.LatestPointer`` is the same value whose parse errors are storage
    errors (PointerCorrupt)."""

    step: int
    store: str
    generation: int = 0

    @property
    def checkpoint(self) -> str:
        return checkpoint_dir(self.step)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "checkpoint": self.checkpoint}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> "LatestPointer":
        """Parse a pointer; ValueError naming the problem if it is malformed or inconsistent."""
        try:
            obj = json.loads(raw)
            ptr = cls(step=obj["step"], store=obj["store"], generation=obj.get("generation", 0))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"Redis LATEST pointer is not valid JSON: {exc}") from exc
        ints_ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (ptr.step, ptr.generation))
        if not ints_ok or not isinstance(ptr.store, str) or obj.get("checkpoint") != ptr.checkpoint:
            raise ValueError(f"Redis LATEST pointer is inconsistent: {obj!r}")
        return ptr
