"""The training worker's own decisions: a pure function of (state, input, now).

:func:`decide` never touches Redis, torch or the clock. It returns a :class:`Choice`: the
worker's new :class:`TrainerState`, the actions to perform in order, and a one-line reason
for people (logged when ``level`` says so). The loop in :mod:`shoal.worker.training` performs
the actions - join the group, move state, train a step, checkpoint, send events, exit - and
feeds what they produced back as the next input. At most one action of a decision produces an
input, and it is the last one; a decision whose actions produce none ends the loop's
iteration (``run_once``). Tests drive it by passing a later ``now`` instead of sleeping.

The phases and their allowed moves are documented on :class:`Phase`.

Invariants: the cursor and step move only on a committed step (or a catch-up); a generation
is joined at most once (``used``: its rendezvous prefix is spent whether or not the group
formed); draining (SIGTERM) sends ``leave`` once and trains on until a table without this
worker arrives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from enum import Enum

from shoal.events.exits import WorkerExit
from shoal.events.models import FormationError, Member, ShardTable
from shoal.worker.data import contiguous_table
from shoal.events.states import JobState, is_terminal

#: A heartbeat carries the parameter digest every this many steps (sha256 of every parameter:
#: cheap for small models, not free for large ones).
DIGEST_EVERY = 50
#: The longest single blocking wait at the Redis barrier, seconds: the last member to arrive
#: ends every wait at once, and so do a newer table and the job's end; this bounds how late
#: an eviction (seen by the heartbeat thread) is noticed there.
BARRIER_WAIT_S = 1.0

Ranges = tuple[tuple[int, int, int], ...]


class Phase(str, Enum):
    """Where the worker stands between generations.

    Phases and their allowed moves (:data:`PHASE_MOVES`; staying in a phase is always allowed)::

        IDLE      -> FORMING   a fetched table includes this worker
        IDLE      -> EXITED    draining and the newest table excludes it; the job ended; evicted
        FORMING   -> TRAINING  the group formed and caught up
        FORMING   -> IDLE      the barrier gave up (deadline, a newer table, evicted); could not form
        FORMING   -> EXITED    as from IDLE (the loop does not start an iteration while forming)
        TRAINING  -> IDLE      a step agreed on a newer generation (an orderly switch) that is
                               not a re-slice of this one; a step failed; rejoined a job that
                               Redis had lost
        TRAINING  -> EXITED    training complete; the job ended; evicted
        EXITED    -> (none)

    - IDLE: in no process group. An iteration starts a switch: fetch the newest table; meet its
      members if it includes this worker, else wait (bounded: IDLE with a ``deadline``) for a
      newer one.
    - FORMING: meeting the other members of ``table`` at the Redis barrier (until ``deadline``),
      then forming the group and catching up state.
    - TRAINING: a member of ``table``'s generation; one step per iteration. When a step's
      all-reduce says some member saw a newer generation (``switch_to``), every member leaves
      at that step boundary - with slices by speed (``Limits.may_reslice``) it first reads the
      table of the generation right after its own (:class:`FetchNext`): a re-slice of it
      (:func:`reslices`: the same members at the same ranks, new ranges) is adopted in place,
      in the same group, before the next step; anything else makes it leave as said. A failed
      step leaves at once.

    The in-place switch is exactly-once: the all-reduce's result is the same on every rank, so
    every member learns of the switch after the same committed step ``S``, and none starts
    step ``S + 1`` before its :class:`FetchNext` answered (a member that had not seen the new
    table itself learns of it from that result: nobody trains past ``S`` on the old ranges).
    They all read the table of the one generation ``g + 1`` (a generation number names one
    table once a replica holds it: :meth:`~shoal.worker.membership.Membership.table_of`), so
    they all decide alike: all switch in place to the same ranges at ``S + 1``, or all leave.
    If a member could not read it (trimmed, unconfirmed) it leaves while the others stay:
    their step ``S + 1`` then fails in the group it left, nothing applied, as any lost peer's.
    - EXITED: terminal; ``exit_code`` says how (``WorkerExit.OK``: finished, left, or the job ended;
      ``WorkerExit.FAILED``: evicted).
    """

    IDLE = "idle"
    FORMING = "forming"
    TRAINING = "training"
    EXITED = "exited"


PHASE_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.FORMING, Phase.EXITED}),
    Phase.FORMING: frozenset({Phase.IDLE, Phase.TRAINING, Phase.EXITED}),
    Phase.TRAINING: frozenset({Phase.IDLE, Phase.EXITED}),
    Phase.EXITED: frozenset(),
}


class IllegalMove(ValueError):
    """A decision tried a move :data:`PHASE_MOVES` forbids (a bug in this module)."""


def check_move(src: Phase, dst: Phase) -> None:
    """Raise :class:`IllegalMove` unless ``src -> dst`` is listed (staying is always allowed,
    except in EXITED, which no input changes)."""
    if dst != src and dst not in PHASE_MOVES[src]:
        raise IllegalMove(f"worker phase {src.value} -> {dst.value} is not allowed")


@dataclass(frozen=True)
class Limits:
    """What the decisions need of the job and the process; fixed for a run."""

    #: dataset length x epochs: the cursor at which training is complete (None: not known yet)
    total_samples: int | None = None
    max_steps: int | None = None
    #: rank 0 checkpoints every this many committed steps (0: only a final one)
    checkpoint_interval: int = 0
    #: how long one wait for a newer table lasts before the worker looks again, seconds
    wait_s: float = 10.0
    #: how long the members of a table are awaited at the barrier, seconds
    barrier_s: float = 30.0
    #: the dataset's length: the cursor advances by it per epoch (None: not known yet)
    num_samples: int | None = None
    #: every member evaluates after every this many committed steps, or after the last step
    #: of every this many epochs (None: not periodically; both None when there is no eval_fn)
    eval_every_steps: int | None = None
    eval_every_epochs: int | None = None
    #: rank 0 can write a whole checkpoint alone, outside any group (the layout's
    #: ``saves_alone``: data parallelism and DiLoCo; not HSDP, whose checkpoint needs the
    #: saving replica group)
    saves_alone: bool = True
    #: the job's tables may be re-slices (``batch_split: by_speed``): an agreed switch first
    #: reads the next generation's table (:class:`FetchNext`); else it leaves the group at once
    may_reslice: bool = False


@dataclass(frozen=True)
class TrainerState:
    limits: Limits = field(default_factory=Limits)
    worker_id: str = ""
    phase: Phase = Phase.IDLE
    #: committed steps, and the global cursor after them
    step: int = 0
    cursor: int = 0
    #: FORMING, TRAINING: the table of the generation being formed / trained in, and this
    #: worker's entry in it (None in the other phases)
    table: ShardTable | None = None
    member: Member | None = None
    #: newest generation seen anywhere (the watcher, a table, the barrier)
    seen: int = 0
    #: generation the last committed step agreed to switch to
    switch_to: int = 0
    #: newest generation whose group this process joined or tried to: never joined again
    used: int = 0
    draining: bool = False
    #: IDLE while waiting: a table newer than this ends the wait
    awaiting: int = 0
    #: monotonic seconds: the end of the current wait (IDLE) or barrier (FORMING)
    deadline: float = 0.0
    #: TRAINING: this rank's part of the generation's first step after a catch-up
    first_ranges: Ranges | None = None
    #: EXITED: the process's exit code
    exit_code: int | None = None
    #: the last committed step this worker evaluated (0: none): never twice in a row
    evaluated: int = 0
    #: (generation, world size) of the group in which this worker was rank 0 when its step
    #: aborted: its weights are still that group's last committed state, so if the job is
    #: stopped before any newer generation, it writes the final checkpoint (a peer that saw
    #: the stop one step earlier exits, and rank 0's next step aborts for want of it)
    aborted_rank0: tuple[int, int] | None = None
    #: (generation, world size) of the last group this worker formed (and committed steps in):
    #: the group whose committed state its weights are
    trained_in: tuple[int, int] | None = None
    #: :attr:`trained_in`, when this worker was rank 0 of the newest data-parallel table it
    #: belonged to (the group it trained in, or a table it was forming when a newer one came):
    #: its weights are the job's last committed state, so if it drains and the next table
    #: pauses the job (every member drained: ``docker compose down``, a node pool scaled to
    #: zero) it writes a checkpoint of them before it leaves - the job resumes where it stopped
    #: instead of redoing every step since the last interval's checkpoint
    drained_saver: tuple[int, int] | None = None

    @property
    def group(self) -> int:
        """The generation of the process group this worker is in (0: none)."""
        return self.table.generation if self.phase is Phase.TRAINING and self.table else 0

    @property
    def rank0(self) -> bool:
        return self.phase is Phase.TRAINING and self.member is not None and self.member.rank == 0

    @property
    def saver(self) -> bool:
        """This worker writes checkpoints: rank 0 in data parallelism; in HSDP every member of
        rank 0's replica group (each its shards)."""
        return (self.phase is Phase.TRAINING and self.member is not None and self.table is not None
                and self.member.rank < self.table.shard_size)

    @property
    def done(self) -> bool:
        total, max_steps = self.limits.total_samples, self.limits.max_steps
        return (total is not None and self.cursor >= total) or (max_steps is not None and self.step >= max_steps)


def eval_due(limits: Limits, step: int, cursor: int) -> bool:
    """Whether the job's periodic evaluation is due after committed ``step`` (the cursor after
    it): ``step`` is a multiple of ``eval_every_steps``, or it is the last step of an epoch
    (the cursor is on an epoch boundary: an epoch's last batch may be short, so its steps
    need not be multiples of anything) and the epochs complete are a multiple of
    ``eval_every_epochs``. Every member decides it from the same committed step and cursor,
    so all evaluate the same step; a step missed (it was never committed here, e.g. a joiner
    catching up past it) is not made up: the next due one is evaluated."""
    if step <= 0:
        return False
    if limits.eval_every_steps:
        return step % limits.eval_every_steps == 0
    n = limits.num_samples
    if limits.eval_every_epochs and n and cursor > 0 and cursor % n == 0:
        return (cursor // n) % limits.eval_every_epochs == 0
    return False


# ---- inputs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    """The start of an iteration: what the heartbeat (``evicted``), the stop flag (SIGTERM)
    and the generation watcher (``latest`` generation, ``job_state``) say now."""

    evicted: bool = False
    stop: bool = False
    latest: int = 0
    job_state: str = "running"


@dataclass(frozen=True)
class Rejoined:
    """The result of :class:`TryRejoin`: ``ok`` with the new ``worker_id``, or not."""

    ok: bool
    worker_id: str = ""


@dataclass(frozen=True)
class TableFetched:
    """The result of :class:`FetchTable`: the job's current table (None: none yet)."""

    table: ShardTable | None


@dataclass(frozen=True)
class TableWaited:
    """The result of one bounded :class:`WaitTable`: a newer table, or none - and then whether
    the job has ended or this worker was evicted meanwhile."""

    table: ShardTable | None = None
    job_ended: bool = False
    evicted: bool = False


@dataclass(frozen=True)
class BarrierPolled:
    """The result of :class:`PollBarrier`: members arrived, the newest published generation."""

    arrived: int
    newest: int = 0
    evicted: bool = False
    #: the job reached a final state (nobody else will come)
    job_ended: bool = False


@dataclass(frozen=True)
class Formed:
    """:class:`Form` succeeded: the group is joined and caught up from rank ``src`` (``behind``:
    the ranks that received state); ``step``/``cursor`` are the caught-up ones; ``took`` s."""

    step: int
    cursor: int
    src: int = 0
    behind: tuple[int, ...] = ()
    took: float = 0.0


@dataclass(frozen=True)
class FormFailed:
    """:class:`Form` failed (rendezvous, a collective, a state mismatch); the group is spent.
    ``kind`` classifies ``error`` for the coordinator (configuration or transient)."""

    error: str
    kind: FormationError = FormationError.TRANSIENT
    #: the (step, cursor) of the state this member holds now when :class:`Form` loaded a
    #: checkpoint (``Form.restore``) before the group failed; None: unchanged
    restored: tuple[int, int] | None = None


@dataclass(frozen=True)
class NextFetched:
    """The result of :class:`FetchNext`: the table of the generation asked for (None: not
    found or not confirmed)."""

    table: ShardTable | None


@dataclass(frozen=True)
class Committed:
    """:class:`TrainStep` committed: the cursor after it, the generation its all-reduce agreed
    on (newer than the group's: every member switches after this step), its loss; ``started``
    is when the step began (monotonic), for the heartbeat's step time."""

    cursor: int
    max_generation: int
    loss: float | None = None
    started: float = 0.0


@dataclass(frozen=True)
class Aborted:
    """:class:`TrainStep` was aborted (a collective failed, or the commit fence refused):
    nothing was applied. ``local``: this process gave it up itself (its group was aborted
    here, its fence refused), rather than a peer failing it."""

    error: str
    local: bool = False


Input = (Tick | Rejoined | TableFetched | TableWaited | BarrierPolled | Formed | FormFailed | NextFetched | Committed
         | Aborted)


# ---- actions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TryRejoin:
    """Evicted: join the job anew with this process's state - at once when the coordinator
    declared this live process failed and the job still runs; after waiting for the job to be
    registered again when it lost its record of this process (Redis lost its data).
    -> :class:`Rejoined`."""

    last_generation: int


@dataclass(frozen=True)
class LeaveGroup:
    """Leave the process group. ``background``: an orderly switch (no collective in flight),
    the backend is freed off the critical path; otherwise synchronously, so that closing the
    sockets of a broken group makes peers still inside a collective fail at once."""

    background: bool = False


@dataclass(frozen=True)
class SendLeave:
    """Ask the coordinator to plan a generation without this worker (a drain)."""


@dataclass(frozen=True)
class SendLeft:
    """Tell the coordinator this draining worker is gone."""


@dataclass(frozen=True)
class ReportFailure:
    """Send ``step_failed`` for ``generation`` (``rendezvous``: its group could not form,
    for the reason ``kind`` classifies)."""

    generation: int
    step: int
    error: str
    rendezvous: bool = False
    kind: FormationError | None = None
    #: see :class:`Aborted`
    local: bool = False


@dataclass(frozen=True)
class FetchTable:
    """Read the job's current table. -> :class:`TableFetched`."""


@dataclass(frozen=True)
class FetchNext:
    """Read the table of exactly generation ``generation`` (the one right after the group's).
    -> :class:`NextFetched`."""

    generation: int


@dataclass(frozen=True)
class WaitTable:
    """Wait (about a second at most) for a table newer than ``after``. -> :class:`TableWaited`."""

    after: int


@dataclass(frozen=True)
class Arrive:
    """Add this worker to the barrier of ``generation`` in Redis."""

    generation: int


@dataclass(frozen=True)
class PollBarrier:
    """Wait at most ``wait`` s for every member to arrive at ``generation``'s barrier (blocking:
    the last arrival, a newer table or the job's end ends it early), then report the arrivals
    and the newest table. -> :class:`BarrierPolled`."""

    generation: int
    wait: float = BARRIER_WAIT_S


@dataclass(frozen=True)
class Form:
    """Join the group of ``table``'s generation as ``rank`` and catch up state from the most
    advanced member. -> :class:`Formed` or :class:`FormFailed`. ``restore``: first load the
    newest checkpoint from the store (the generation starts from the checkpoint of that step,
    ``ShardTable.restore_step``, and this member's committed step is below it); None: train
    on from this member's own state."""

    table: ShardTable
    rank: int
    restore: int | None = None


@dataclass(frozen=True)
class Announce:
    """A generation formed: publish it with the heartbeat, then (off the critical path) the
    digest of the state it starts from, the switch log line, and ``ready``."""

    generation: int
    rank: int
    world: int
    step: int
    cursor: int
    took: float
    src: int
    behind: tuple[int, ...]


@dataclass(frozen=True)
class TrainStep:
    """Train the step after ``step`` at ``cursor`` on ``ranges`` of the global batch, in group
    ``base`` of ``world`` ranks, telling the others the newest ``generation`` seen.
    -> :class:`Committed` or :class:`Aborted`."""

    step: int
    cursor: int
    ranges: Ranges
    generation: int
    base: int
    world: int
    #: whether every rank trains its table's ranges in this step (False: the first step of a
    #: group formed with ranks behind, whose batch the others split): the same on every rank
    planned: bool = True


@dataclass(frozen=True)
class RecordProgress:
    """Append a committed step to the job's progress history (rank 0)."""

    step: int
    loss: float | None
    generation: int
    world: int


@dataclass(frozen=True)
class SaveCheckpoint:
    """Save a checkpoint of ``step`` (rank 0); ``final`` waits until it is written."""

    step: int
    cursor: int
    generation: int
    world: int
    final: bool = False


@dataclass(frozen=True)
class Beat:
    """Put a committed step into the heartbeat (with the parameter digest if ``digest``)."""

    step: int
    generation: int
    loss: float | None
    started: float
    digest: bool = False


@dataclass(frozen=True)
class Evaluate:
    """Run ``eval_fn`` on the model as of committed ``step`` (every member: their cost is the
    same, so nobody waits for rank 0 in the next step); rank 0 (``report``) publishes the
    metrics. ``cursor``/``epoch``: the cursor after the step and its epoch; ``generation``:
    the one it was committed in. Counts as the next step's own work for the step timeout."""

    step: int
    cursor: int
    epoch: int
    generation: int
    report: bool


@dataclass(frozen=True)
class Finish:
    """Training is complete: evaluate, save ``checkpoint`` if any, report the job completed if
    ``report`` (rank 0), publish the final digest."""

    step: int
    cursor: int
    report: bool
    checkpoint: SaveCheckpoint | None = None
    #: the generation the last step committed in
    generation: int = 0


Action = (TryRejoin | LeaveGroup | SendLeave | SendLeft | ReportFailure | FetchTable | FetchNext | WaitTable | Arrive
          | PollBarrier | Form | Announce | TrainStep | RecordProgress | SaveCheckpoint | Beat | Evaluate | Finish)


@dataclass(frozen=True)
class Choice:
    """What the worker decided for one input: its next state, the actions to perform in
    order, and why (the coordinator's counterpart is ``coordinator.decide.Decision``)."""

    state: TrainerState
    actions: tuple[Action, ...] = ()
    reason: str = ""
    #: the logging level at which the loop logs ``reason`` (0: not logged)
    level: int = 0


# ---- the decision -----------------------------------------------------------------------------


def decide(state: TrainerState, event: Input, now: float) -> Choice:
    """The worker's next move after ``event``, at monotonic time ``now`` (seconds).

    Inputs that make no sense in the current phase (a late result, anything once EXITED)
    change nothing and say why. Raises :class:`IllegalMove` only on a bug here."""
    if state.phase is Phase.EXITED:
        return Choice(state, (), f"exited ({state.exit_code}): {type(event).__name__} ignored")
    handler, phases = _HANDLERS[type(event)]
    if state.phase not in phases:
        return Choice(state, (), f"{type(event).__name__} ignored while {state.phase.value}")
    d = handler(state, event, now)
    check_move(state.phase, d.state.phase)
    return d


def _idle(s: TrainerState, **changes) -> TrainerState:
    if s.member is not None:  # leaving a table (TRAINING or FORMING): was this worker its rank 0?
        changes.setdefault("drained_saver", _drained_saver(s))
    return replace(s, phase=Phase.IDLE, table=None, member=None, first_ranges=None, **changes)


def _drained_saver(s: TrainerState) -> tuple[int, int] | None:
    """:attr:`TrainerState.drained_saver` of a worker leaving its table now: only rank 0 of a
    layout whose rank 0 saves alone (``Limits.saves_alone``; an HSDP checkpoint needs every
    member of the saving replica group)."""
    if s.member is not None and s.member.rank == 0 and s.limits.saves_alone:
        return s.trained_in
    return None


def _exit(s: TrainerState, code: WorkerExit) -> TrainerState:
    return replace(s, phase=Phase.EXITED, exit_code=code)


def _wait(s: TrainerState, after: int, now: float) -> tuple[TrainerState, tuple[Action, ...]]:
    """IDLE, waiting until ``now + wait_s`` for a table newer than ``after``."""
    return _idle(s, awaiting=after, deadline=now + s.limits.wait_s), (WaitTable(after),)


def _checkpoint(s: TrainerState, *, final: bool) -> SaveCheckpoint:
    return SaveCheckpoint(s.step, s.cursor, s.group, s.table.world_size, final=final)


def _tick(s: TrainerState, t: Tick, now: float) -> Choice:
    if t.evicted:
        return Choice(s, (TryRejoin(s.seen),), "no longer counted by the coordinator: rejoin with this state "
                                                  "while the job runs, else exit")
    actions: list[Action] = []
    said: list[str] = []
    level = 0
    if t.stop and not s.draining:
        s = replace(s, draining=True)
        actions.append(SendLeave())
        said.append(f"draining after step {s.step}")
        level = logging.INFO
    s = replace(s, seen=max(s.seen, t.latest))
    if is_terminal(t.job_state):
        if t.job_state == JobState.STOPPED and s.saver:
            actions.append(_checkpoint(s, final=True))  # a graceful stop keeps the progress
        elif t.job_state == JobState.STOPPED and s.aborted_rank0 is not None and s.aborted_rank0[0] >= s.seen:
            g, world = s.aborted_rank0  # ... also when rank 0's last step aborted as its peer exited
            actions.append(SaveCheckpoint(s.step, s.cursor, g, world, final=True))
        said.append(f"the job is {t.job_state}")
        return Choice(_exit(s, WorkerExit.OK), tuple(actions), "; ".join(said), level)
    if s.phase is Phase.TRAINING and s.switch_to <= s.group:
        ranges = s.first_ranges if s.first_ranges is not None else tuple(map(tuple, s.member.ranges))
        actions.append(TrainStep(s.step, s.cursor, ranges, s.seen, s.group, s.table.world_size,
                                 planned=s.first_ranges is None))
        said.append(f"step {s.step + 1} in generation {s.group}")
        return Choice(replace(s, first_ranges=None), tuple(actions), "; ".join(said), level)
    if s.phase is Phase.TRAINING and s.limits.may_reslice:  # an orderly switch: in place if the next table re-slices this one
        actions.append(FetchNext(s.group + 1))
        said.append(f"a newer generation agreed after step {s.step}: reading generation {s.group + 1}")
        return Choice(s, tuple(actions), "; ".join(said), level)
    if s.phase is Phase.TRAINING:  # an orderly switch: the old group's teardown runs in the background
        actions.append(LeaveGroup(background=True))
        said.append(f"generation {s.switch_to} agreed after step {s.step}: leaving generation {s.group}")
    else:
        said.append("in no group: looking for the newest table")
    actions.append(FetchTable())
    return Choice(_idle(s), tuple(actions), "; ".join(said), level)


def _rejoined(s: TrainerState, r: Rejoined, now: float) -> Choice:
    if not r.ok:
        return Choice(_exit(s, WorkerExit.FAILED), (), "evicted by the coordinator (declared failed); exiting", logging.ERROR)
    # the new incarnation of the job plans a new generation; no step was lost on our side
    return Choice(_idle(s, worker_id=r.worker_id, switch_to=0), (LeaveGroup(),),
                    f"rejoined the job as {r.worker_id}, state kept", logging.INFO)


def _table_fetched(s: TrainerState, f: TableFetched, now: float) -> Choice:
    table = f.table
    if table is None or table.generation < s.switch_to:
        after = max(s.switch_to - 1, 0) if table is None else table.generation
        s, actions = _wait(s, after, now)
        return Choice(s, actions, f"waiting for a table newer than generation {after}")
    g = table.generation
    s = replace(s, seen=max(s.seen, g))
    if g <= s.used:
        s, actions = _wait(s, g, now)
        return Choice(s, actions, f"generation {g} was already joined or tried (its rendezvous is spent): "
                                    "waiting for a newer one")
    member = None if table.paused else table.member(s.worker_id)
    if member is None:
        if s.draining:
            said = f"left after step {s.step} (generation {g} no longer includes us)"
            if table.paused and s.drained_saver is not None:  # nobody trains on: keep the progress
                saved, world = s.drained_saver
                return Choice(_exit(s, WorkerExit.OK), (SaveCheckpoint(s.step, s.cursor, saved, world, final=True),
                                                        SendLeft()),
                              f"{said}; the job is paused with no member: checkpoint of step {s.step} first, so that "
                              "it resumes there", logging.INFO)
            return Choice(_exit(s, WorkerExit.OK), (SendLeft(),), said, logging.INFO)
        s, actions = _wait(s, g, now)
        return Choice(s, actions, f"generation {g} {'is paused' if table.paused else 'does not include this worker'}: "
                                    "waiting for a newer one")
    s = replace(s, phase=Phase.FORMING, table=table, member=member, deadline=now + s.limits.barrier_s)
    return Choice(s, (Arrive(g), PollBarrier(g, min(BARRIER_WAIT_S, s.limits.barrier_s))),
                    f"generation {g} includes this worker as rank {member.rank}: meeting its members")


def _table_waited(s: TrainerState, w: TableWaited, now: float) -> Choice:
    if w.table is not None:
        return Choice(replace(s, seen=max(s.seen, w.table.generation)), (), f"generation {w.table.generation} published")
    if w.evicted:
        return Choice(s, (), "evicted while waiting for a table")
    if w.job_ended:
        return Choice(s, (), "the job ended while waiting for a table")
    if now >= s.deadline:
        return Choice(s, (), f"no table newer than generation {s.awaiting} came: looking again")
    return Choice(s, (WaitTable(s.awaiting),), f"waiting for a table newer than generation {s.awaiting}")


def _barrier_polled(s: TrainerState, b: BarrierPolled, now: float) -> Choice:
    g, world = s.table.generation, s.table.world_size
    if s.used >= g:
        return Choice(s, (), f"the barrier of generation {g} is over: its group is being formed")
    if b.arrived >= world:
        restore = s.table.restore_step
        if restore is None or s.step >= restore:
            return Choice(replace(s, used=max(s.used, g)), (Form(s.table, s.member.rank),),
                          f"all {world} members of generation {g} arrived: forming its group")
        return Choice(replace(s, used=max(s.used, g)), (Form(s.table, s.member.rank, restore=restore),),
                      f"all {world} members of generation {g} arrived: forming its group from the checkpoint of "
                      f"step {restore} (no member holds the job's state; this one is at step {s.step})")
    if b.newest > g:
        return Choice(_idle(s, seen=max(s.seen, b.newest), switch_to=b.newest), (),
                        f"generation {b.newest} published while meeting generation {g}'s members: switching to it")
    if b.evicted:
        return Choice(_idle(s), (), f"evicted at the barrier of generation {g}")
    if b.job_ended:
        return Choice(_idle(s), (), f"the job ended while meeting generation {g}'s members")
    if now >= s.deadline:
        return Choice(_idle(s), (), f"only {b.arrived} of {world} members of generation {g} arrived within "
                                      f"{s.limits.barrier_s:.0f} s: looking again", logging.INFO)
    return Choice(s, (PollBarrier(g, min(BARRIER_WAIT_S, s.deadline - now)),),
                    f"{b.arrived} of {world} members of generation {g} arrived")


def _formed(s: TrainerState, f: Formed, now: float) -> Choice:
    table, rank = s.table, s.member.rank
    if s.used < table.generation:
        return Choice(s, (), f"generation {table.generation}'s group is not being formed yet: Formed ignored")
    first: Ranges | None = None
    if f.behind:
        # while the ranks behind receive state, the others split the first step's batch
        ready = [r for r in range(table.world_size) if r not in f.behind]
        mine = [] if rank in f.behind else contiguous_table(table.num_samples, len(ready))[ready.index(rank)]
        first = tuple(tuple(r) for r in mine)
    g = table.generation
    s = replace(s, phase=Phase.TRAINING, step=f.step, cursor=f.cursor, switch_to=g, first_ranges=first,
                aborted_rank0=None, drained_saver=None, trained_in=(g, table.world_size))
    return Choice(s, (Announce(g, rank, table.world_size, f.step, f.cursor, f.took, f.src, f.behind),),
                    f"formed generation {g} as rank {rank}/{table.world_size} at step {f.step}")


def _form_failed(s: TrainerState, f: FormFailed, now: float) -> Choice:
    g = s.table.generation
    if s.used < g:
        return Choice(s, (), f"generation {g}'s group is not being formed yet: FormFailed ignored")
    if f.restored is not None:  # the model holds that checkpoint now: its step and cursor go with it
        s = replace(s, step=f.restored[0], cursor=f.restored[1])
    # a generation is never retried (its rendezvous prefix is spent): ask for a new one
    failed = (LeaveGroup(), ReportFailure(g, s.step, f.error, rendezvous=True, kind=f.kind))
    s, wait = _wait(s, g, now)
    return Choice(s, failed + wait, f"generation {g} could not form: {f.error}", logging.WARNING)


def reslices(old: ShardTable, new: ShardTable) -> bool:
    """Whether ``new`` is a re-slice of ``old`` that its members adopt in place: it continues
    ``old``'s generation (``ShardTable.continues``) with the same members at the same ranks in
    the same layout (nothing but the ranges differ; only slices by speed make re-slices, and
    those are data parallelism: ``JobSpec``)."""
    return (new.continues == old.generation and new.generation == old.generation + 1 and not new.paused
            and not old.paused and new.world_size == old.world_size and new.shard_size == old.shard_size
            and new.shard_owners is None and old.shard_owners is None
            and [(m.worker_id, m.rank) for m in new.members] == [(m.worker_id, m.rank) for m in old.members])


def _next_fetched(s: TrainerState, f: NextFetched, now: float) -> Choice:
    old, new = s.table, f.table
    if s.switch_to <= s.group:
        return Choice(s, (), f"no switch agreed in generation {s.group}: NextFetched ignored")
    if new is not None and reslices(old, new):
        member = new.member(s.worker_id)
        g = new.generation
        s = replace(s, table=new, member=member, switch_to=g, used=max(s.used, g), seen=max(s.seen, g),
                    first_ranges=None)
        return Choice(s, (Announce(g, member.rank, new.world_size, s.step, s.cursor, 0.0, member.rank, ()),),
                      f"generation {g} re-slices generation {old.generation} after step {s.step}: "
                      f"switched in place ({_count(s.member.ranges)} samples a step)", logging.INFO)
    why = "not found" if new is None else "not a re-slice of it"
    return Choice(_idle(s), (LeaveGroup(background=True), FetchTable()),
                  f"a newer generation agreed after step {s.step} (generation {old.generation + 1} {why}): "
                  f"leaving generation {s.group}")


def _count(ranges) -> int:
    return sum(len(range(*r)) for r in ranges)


def _committed(s: TrainerState, c: Committed, now: float) -> Choice:
    g, world, rank0, saver = s.group, s.table.world_size, s.rank0, s.saver
    s = replace(s, step=s.step + 1, cursor=c.cursor, switch_to=c.max_generation, trained_in=(g, world))
    actions: list[Action] = []
    if rank0:  # the history `shoal report` draws
        actions.append(RecordProgress(s.step, c.loss, g, world))
    interval = s.limits.checkpoint_interval
    if saver and interval and s.step % interval == 0 and not s.done:  # the last step: Finish saves it
        actions.append(_checkpoint(s, final=False))
    actions.append(Beat(s.step, g, c.loss, c.started, digest=s.step % DIGEST_EVERY == 0))
    if s.done:  # Finish evaluates (and rank 0 reports it) whether or not one was due
        actions.append(Finish(s.step, s.cursor, report=rank0, checkpoint=_checkpoint(s, final=True) if saver else None,
                              generation=g))
        return Choice(_exit(replace(s, evaluated=s.step), WorkerExit.OK), tuple(actions),
                        f"training complete at step {s.step}, cursor {s.cursor}")
    then = f"; generation {c.max_generation} agreed: switching" if c.max_generation > g else ""
    if s.step != s.evaluated and eval_due(s.limits, s.step, s.cursor):
        epoch = s.cursor // s.limits.num_samples if s.limits.num_samples else 0
        actions.append(Evaluate(s.step, s.cursor, epoch, g, report=rank0))
        s = replace(s, evaluated=s.step)
        then += "; evaluating"
    return Choice(s, tuple(actions), f"step {s.step} committed in generation {g}{then}")


def _aborted(s: TrainerState, a: Aborted, now: float) -> Choice:
    g, step = s.group, s.step
    # the cursor stays: the same global batch is redone in the next generation
    failed = (LeaveGroup(), ReportFailure(g, step, a.error, local=a.local))
    s, wait = _wait(replace(s, aborted_rank0=(g, s.table.world_size) if s.saver else None), g, now)
    return Choice(s, failed + wait, f"step {step} aborted in generation {g}: {a.error}", logging.WARNING)


_ANY = frozenset({Phase.IDLE, Phase.FORMING, Phase.TRAINING})
_HANDLERS = {
    Tick: (_tick, _ANY),
    Rejoined: (_rejoined, _ANY),
    TableFetched: (_table_fetched, frozenset({Phase.IDLE})),
    TableWaited: (_table_waited, frozenset({Phase.IDLE})),
    BarrierPolled: (_barrier_polled, frozenset({Phase.FORMING})),
    Formed: (_formed, frozenset({Phase.FORMING})),
    FormFailed: (_form_failed, frozenset({Phase.FORMING})),
    NextFetched: (_next_fetched, frozenset({Phase.TRAINING})),
    Committed: (_committed, frozenset({Phase.TRAINING})),
    Aborted: (_aborted, frozenset({Phase.TRAINING})),
}
