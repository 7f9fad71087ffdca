"""Models of the flat stream entries: the informational streams whose entries are field maps
(every value a string, as XRANGE returns it), not one JSON ``data`` field like ``events`` and
``generations``.

Writers build these fields directly (``coordinator/persist.py`` and ``coordinator/loop.py``:
``control``, ``failures``, ``dead``; ``worker/progress.py``: ``progress``;
``worker/loghandler.py`` and ``worker/agent.py``: ``logs``). These models are their published
contract (``docs/schema/``) for outside readers - dashboards, exporters -, kept in step by
``tests/control/test_wire_schema.py`` and ``tests/processes/test_tensorboard_processes.py``,
which validate real entries. Like every wire model they evolve only by adding optional
fields; readers ignore fields they do not know.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

#: An integer in decimal.
IntText = Annotated[str, Field(pattern=r"^-?[0-9]+$")]
#: A number as Python writes it (``repr``/``%f``); ``nan`` where there is none.
NumberText = Annotated[str, Field(pattern=r"^(-?[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?|nan)$")]


class _Entry(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ControlEntry(_Entry):
    """One coordinator decision that changed the job (``shoal:{J}:control``, ``shoal events``):
    what it applied and why. Written in the same fenced transaction as the state it made."""

    #: Redis server time (ms) of the decision.
    ts_ms: IntText
    #: Fencing epoch of the coordinator replica that decided it.
    epoch: IntText
    #: What it applied: a worker event's ``kind`` (join, ready, leave, left, exited,
    #: start_failed, step_failed, completed, stop, checkpoint, eval), ``tick`` (a timer:
    #: heartbeat and step timeouts, settling joins), or ``dead_letter``.
    kind: str
    #: The stream entry id of the event applied (``tick`` for a timer).
    source_id: str = ""
    #: The job's state after the decision (pending, running, paused, completed, failed, stopped).
    job_state: str = ""
    #: The job's generation after the decision.
    generation: IntText = "0"
    #: Why, for people (decisions never read it).
    reason: str = ""


class FailureEntry(_Entry):
    """One worker failure as the coordinator decided it (``shoal:{J}:failures``), fenced with
    the decision that failed the worker."""

    ts_ms: IntText
    #: The worker id, or ``<node>/slot<n>`` for a process that failed before it joined.
    worker: str
    #: The rank it held in its generation (-1: none).
    rank: IntText = "-1"
    reason: str = ""
    #: What its node agent reported of its output (empty for a heartbeat timeout).
    traceback: str = ""
    #: Its exit code, when it exited.
    exit_code: IntText | None = None
    #: The signal that killed it, when one did.
    signal: IntText | None = None


class StepProgress(_Entry):
    """A committed step of rank 0 (``shoal:{J}:progress``, entries without ``kind``): at most
    one per 0.5 s plus the first step of each generation. The entry id is Redis server time."""

    step: IntText
    #: The step's loss; ``nan`` when there was none.
    loss: NumberText
    generation: IntText
    world_size: IntText
    #: The worker's unix time, seconds.
    t: NumberText
    #: Seconds of rank 0's step spent waiting for its batches (part of ``compute``).
    input_wait: NumberText | None = None
    #: Seconds of its own work: data, forward, backward.
    compute: NumberText | None = None
    #: Seconds waiting on the gradient all-reduce after backward returned.
    exposed_comm: NumberText | None = None
    #: Streaming datasets only: bytes rank 0 had downloaded so far (whole shards and ranged
    #: reads), its cache hit rate (0..1), samples it had read remotely.
    downloaded: IntText | None = None
    hit_rate: NumberText | None = None
    remote: IntText | None = None


class EvalProgress(_Entry):
    """An evaluation rank 0 reported (``shoal:{J}:progress``, ``kind`` = ``eval``)."""

    kind: Literal["eval"]
    step: IntText
    epoch: IntText
    generation: IntText
    #: JSON object: metric name -> finite number.
    metrics: str
    t: NumberText


class LogEntry(_Entry):
    """A worker's (or node agent's) log line (``shoal:{J}:logs``, ``shoal logs``)."""

    #: The worker id, or ``<node>/agent`` for a node agent's own lines.
    worker: str
    #: Python logging level name (INFO, WARNING, ERROR...).
    level: str
    msg: str
    #: Unix time, seconds.
    ts: NumberText


class DeadLetter(_Entry):
    """An event the coordinator could not apply (``shoal:{J}:dead``): its original fields,
    each as ``orig_<field>`` (``orig_data`` for an event), plus why and where it came from."""

    model_config = ConfigDict(extra="allow", frozen=True)

    reason: str
    #: The stream entry id it had in ``events``.
    source_id: str
