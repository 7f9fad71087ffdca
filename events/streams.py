"""The flat stream entries: the informational streams whose entries are field maps (every
value a string, as XADD takes and XRANGE returns them), not one JSON ``data`` field like
``events`` and ``generations``.

One model per stream, used by every writer (``to_fields``) and every reader
(``from_fields``): ``control`` (:class:`ControlEntry`, the coordinator's decisions, with the
membership change of each new generation as typed fields), ``failures``
(:class:`FailureEntry`), ``progress`` (:class:`ProgressEntry`), ``logs`` (:class:`LogEntry`)
and ``dead`` (:class:`DeadLetter`). The published JSON Schema (``docs/schema/``) is generated
from these models, in their wire form (``shoal.ops.schema``). Like every wire model they
evolve only by adding optional fields.

Encoding: integers in decimal, floats as Python writes them (``nan`` where there is none),
booleans ``1``/``0``, lists of ids comma-separated, a mapping as JSON; a field that is None (or
an empty list) is not written. Decoding never raises: unknown fields are ignored and a field whose value does
not parse reads as its default, so one bad field never loses an entry.
"""

from __future__ import annotations

import json
import math
from enum import StrEnum
from typing import Annotated, Any, Self

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from shoal.events.states import JobState


def _split(value: object) -> object:
    """A list field from its wire form (``w1,w2``; empty: none)."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if isinstance(value, str):
        return tuple(part for part in value.split(",") if part)
    return value


def _json_object(value: object) -> object:
    """A mapping field from its wire form (JSON text)."""
    if isinstance(value, (str, bytes)):
        return json.loads(value or "{}")
    return value


#: Worker ids (``w0,w3``), or any list of names without commas.
Names = Annotated[tuple[str, ...], BeforeValidator(_split)]


class ControlKind(StrEnum):
    """What a control entry applied: a worker event (its ``kind``; every kind of
    ``events.models.WorkerEvent`` is one, tests/unit/test_events.py checks it), a timer, or a
    dead letter. On the wire as its value; a value this version does not know reads as that
    text (a newer coordinator's), never as an error."""

    JOIN = "join"
    READY = "ready"
    LEAVE = "leave"
    LEFT = "left"
    EXITED = "exited"
    START_FAILED = "start_failed"
    STEP_FAILED = "step_failed"
    COMPLETED = "completed"
    STOP = "stop"
    CHECKPOINT = "checkpoint"
    EVAL = "eval"
    #: A timer: heartbeat and step timeouts, settling joins, a formation back-off ending.
    TICK = "tick"
    #: An event the coordinator could not apply (it went to the ``dead`` stream).
    DEAD_LETTER = "dead_letter"


class ProgressKind(StrEnum):
    """A progress entry's kind other than a committed step (which has none)."""

    EVAL = "eval"


def _open() -> Any:
    """Of a field typed ``SomeEnum | str``: its values are read as the enum's members first, and
    any other text as that text (an entry of a newer writer), never as an error."""
    return Field(union_mode="left_to_right")


def _wire(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    if hasattr(value, "value"):  # an enum
        return str(value.value)
    return str(value)


class FlatEntry(BaseModel):
    """Base of the flat stream entries: see the module docstring."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    def to_fields(self) -> dict[str, str]:
        """The entry's fields for XADD (None fields and empty lists left out)."""
        return {name: _wire(value) for name, value in self if value is not None and value != ()}

    @classmethod
    def from_fields(cls, fields: dict) -> Self:
        """Parse an XRANGE/XREAD entry's fields (bytes or str). Never raises."""
        data = {(k.decode(errors="replace") if isinstance(k, bytes) else str(k)):
                (v.decode(errors="replace") if isinstance(v, bytes) else v) for k, v in fields.items()}
        for _ in range(len(data) + 1):
            try:
                return cls.model_validate(data)
            except ValidationError as exc:
                bad = {str(err["loc"][0]) for err in exc.errors() if err["loc"]}
                if not bad & data.keys():
                    break
                data = {k: v for k, v in data.items() if k not in bad}
        return cls()


class ControlEntry(FlatEntry):
    """One coordinator decision that changed the job (``shoal:{J}:control``, ``shoal events``):
    what it applied and why. Written in the same fenced transaction as the state it made. A
    decision that planned a new generation also says, as typed fields, what changed: the
    world size, who joined, who was removed and why (``causes``, one per ``removed`` id:
    ``exited``, ``heartbeat_timeout``, ``step_timeout``, ``left``). Readers (``shoal report``,
    the dashboard, tests) use these; ``reason`` is for people only."""

    #: Redis server time (ms) of the decision.
    ts_ms: int = 0
    #: Fencing epoch of the coordinator replica that decided it.
    epoch: int = 0
    #: That replica's instance id (``shoal coordinator --id``): each epoch belongs to one.
    coordinator: str = ""
    #: What it applied (:class:`ControlKind`): a worker event's ``kind`` (join, ready, leave,
    #: left, exited, start_failed, step_failed, completed, stop, checkpoint, eval), ``tick`` (a
    #: timer: heartbeat and step timeouts, settling joins), or ``dead_letter``. "" : not written.
    kind: Annotated[ControlKind | str, _open()] = ""
    #: The stream entry id of the event applied (``tick`` for a timer).
    source_id: str = ""
    #: The job's state after the decision (:class:`~shoal.events.states.JobState`: pending,
    #: running, paused, completed, failed, stopped). "" : not written.
    job_state: Annotated[JobState | str, _open()] = ""
    #: The job's generation after the decision.
    generation: int = 0
    #: Why, for people (no reader decides or draws anything from it).
    reason: str = ""
    #: Only on a decision that planned a generation (None otherwise): its world size (0 when
    #: paused).
    world_size: int | None = None
    #: With ``world_size``: whether the planned generation is a paused one (fewer live workers
    #: than ``min_workers``).
    paused: bool | None = None
    #: Workers that are members for the first time in this generation.
    joined: Names = ()
    #: Members of earlier generations that this one leaves out for good.
    removed: Names = ()
    #: Why each of ``removed`` was removed (same order): a ``RemovalCause`` value.
    causes: Names = ()
    #: Only on a decision that planned a generation no member of which holds the job's state
    #: (every member that held it was lost): the step of the checkpoint it starts from
    #: (:attr:`~shoal.events.models.ShardTable.restore_step`). None otherwise.
    restored_from: int | None = None
    #: Only on a decision that moved the job's LATEST pointer (a checkpoint event): the step
    #: of the checkpoint it now names. None otherwise.
    latest_step: int | None = None

    @property
    def planned(self) -> bool:
        """Whether this decision planned a new generation (a membership change)."""
        return self.world_size is not None

    def removed_by(self, *, failure: bool) -> tuple[str, ...]:
        """The removed workers that failed (``failure=True``) or left."""
        from shoal.events.states import RemovalCause

        return tuple(w for w, c in zip(self.removed, self.causes) if RemovalCause.parse(c).failure == failure)

    @property
    def failed(self) -> tuple[str, ...]:
        return self.removed_by(failure=True)

    @property
    def left(self) -> tuple[str, ...]:
        return self.removed_by(failure=False)


class FailureEntry(FlatEntry):
    """One worker failure as the coordinator decided it (``shoal:{J}:failures``), fenced with
    the decision that failed the worker."""

    ts_ms: int = 0
    #: The worker id, or ``<node>/slot<n>`` for a process that failed before it joined.
    worker: str = ""
    #: The rank it held in its generation (-1: none).
    rank: int = -1
    reason: str = ""
    #: What its node agent reported of its output (empty for a heartbeat timeout).
    traceback: str = ""
    #: Its exit code, when it exited.
    exit_code: int | None = None
    #: The signal that killed it, when one did.
    signal: int | None = None


class ProgressEntry(FlatEntry):
    """One entry of ``shoal:{J}:progress``, written by rank 0: a committed step (no ``kind``;
    at most one per 0.5 s plus the first step of each generation) or an evaluation
    (``kind`` = ``eval``). The entry id is Redis server time (what charts plot against)."""

    #: Absent: a committed step; ``eval`` (:class:`ProgressKind`): an evaluation (readers skip
    #: kinds they do not know, which read as their text).
    kind: Annotated[ProgressKind | str | None, _open()] = None
    step: int = 0
    #: A step's loss; NaN when there was none.
    loss: float | None = None
    generation: int = 0
    #: A step's world size.
    world_size: int | None = None
    #: The worker's unix time, seconds.
    t: float = 0.0
    #: Seconds of rank 0's step spent waiting for its batches (part of ``compute``).
    input_wait: Annotated[float | None, Field(ge=0, allow_inf_nan=False)] = None
    #: Seconds of its own work: data, forward, backward.
    compute: Annotated[float | None, Field(ge=0, allow_inf_nan=False)] = None
    #: Seconds waiting on the gradient all-reduce after backward returned.
    exposed_comm: Annotated[float | None, Field(ge=0, allow_inf_nan=False)] = None
    #: Streaming datasets only: bytes rank 0 had downloaded so far (whole shards and ranged
    #: reads), its cache hit rate (0..1), samples it had read remotely.
    downloaded: Annotated[int | None, Field(ge=0)] = None
    hit_rate: Annotated[float | None, Field(ge=0, le=1, allow_inf_nan=False)] = None
    remote: Annotated[int | None, Field(ge=0)] = None
    #: Rank 0's throughput figures (``shoal.worker.flops``), on the first step entry of each
    #: generation and the next one after a figure changed (None elsewhere): FLOPs of one
    #: sample's forward and backward, its device's peak FLOP/s, tokens in one sample.
    flops_per_sample: Annotated[float | None, Field(gt=0, allow_inf_nan=False)] = None
    peak_flops: Annotated[float | None, Field(gt=0, allow_inf_nan=False)] = None
    tokens_per_sample: Annotated[int | None, Field(gt=0)] = None
    #: An evaluation's epoch (complete epochs after its step).
    epoch: int | None = None
    #: An evaluation's metrics: name -> finite number (JSON on the wire).
    metrics: Annotated[dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None,
                       BeforeValidator(_json_object)] = None

    @property
    def is_step(self) -> bool:
        return self.kind is None

    @property
    def is_eval(self) -> bool:
        return self.kind == ProgressKind.EVAL


class LogEntry(FlatEntry):
    """A worker's (or node agent's) log line (``shoal:{J}:logs``, ``shoal logs``)."""

    #: The worker id, or ``<node>/agent`` for a node agent's own lines.
    worker: str = "-"
    #: Python logging level name (INFO, WARNING, ERROR...).
    level: str = ""
    msg: str = ""
    #: Unix time, seconds (0: not known).
    ts: Annotated[float, Field(allow_inf_nan=False)] = 0.0


class DeadLetter(FlatEntry):
    """An event the coordinator could not apply (``shoal:{J}:dead``): its original fields,
    each as ``orig_<field>`` (``orig_data`` for an event), plus why and where it came from."""

    model_config = ConfigDict(extra="allow", frozen=True)

    reason: str = ""
    #: The stream entry id it had in ``events``.
    source_id: str = ""


def entry_fields(entry: FlatEntry) -> dict[str, Any]:
    """An entry as plain JSON values (lists for list fields): what the HTTP API returns."""
    return entry.model_dump(mode="json")
