"""The elastic training worker: follows shard-table generations without restarting.

Protocol (every member of a generation runs the same loop):

1. **Step.** Take the global batch at the committed cursor, this rank's slice per the shard
   table, and run one atomic, world-size-invariant step (:class:`shoal.worker.engine.StepEngine`).
   The step's collective carries the newest generation each rank has seen (MAX), so every
   member learns of a new generation in the same step.
2. **Switch** at the step boundary after which the reduced generation is newer than the
   group's: leave the process group (same process, model and optimizer stay in memory; the
   old backend is freed by a thread), meet the other members of the newest table at a Redis
   barrier, form the new group on a fresh store prefix, and catch up from the most advanced
   member (only the members behind - a joiner - receive model, optimizer and cursor, point
   to point; the others skip it and, in the generation's first step, split the batch among
   themselves while the members behind take none). Then send ``ready`` -> Active; the
   parameter digest is logged and published with the heartbeat once a helper thread has
   computed it (the first step's update waits for it).
3. **Failure.** If a peer dies mid-step the collective fails: nothing is applied
   (StepAborted), the worker leaves the group and waits for the coordinator's next
   generation, then redoes the same step. No sample is skipped or counted twice: the cursor
   only moves on a committed step, and the catch-up copies the most advanced member's cursor.
4. **Evaluate** (``eval_every_steps``/``eval_every_epochs``): after a due committed step every
   member runs ``eval_fn`` on the same, identical model (nobody then waits for rank 0 in the
   next step's all-reduce); rank 0 reports the metrics. The evaluation and the next step's own
   work are one busy span for the step timeout. ``eval_fn`` also runs once at the end.
5. **Drain** (SIGTERM): finish the step, send ``leave``, keep stepping until the generation
   without this worker is agreed, then send ``left`` and exit 0.

Every choice above is made by :func:`shoal.worker.decide.decide`, a pure function whose phases
and allowed moves are documented there. :class:`TrainingWorker` is the loop around it: it
observes (:class:`~shoal.worker.decide.Tick`), performs the decision's actions and feeds what
they produced back as the next input. It performs them with three parts, each in its own
module: the input pipeline (:class:`~shoal.worker.input_pipeline.InputPipeline`: data order,
streaming split, prefetcher), the generation switch
(:class:`~shoal.worker.switch.GenerationSwitch`: table waits, barrier, group, catch-up,
announcement) and the evaluator (:class:`~shoal.worker.evaluator.Evaluator`), plus the step
engine (:class:`~shoal.worker.engine.StepEngine`).
"""

from __future__ import annotations

import gc
import json
import logging
import resource
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from shoal.core.connection import without_retries
from shoal.core.faults import FaultPlan, InjectedAbort
from shoal.core.jobspec import JobSpec
from shoal.events.states import is_terminal
from shoal.worker import placement
from shoal.worker import restart
from shoal.worker import compile_cache
from shoal.worker import torch_compat as tc
from shoal.worker.checkpoints import Checkpoints, warm_start
from shoal.worker.collector import StepCollector
from shoal.worker.decide import (
    Aborted,
    Action,
    Announce,
    Arrive,
    Beat,
    Committed,
    Evaluate,
    FetchNext,
    FetchTable,
    Finish,
    Form,
    Formed,
    Input,
    LeaveGroup,
    NextFetched,
    Limits,
    PollBarrier,
    RecordProgress,
    Rejoined,
    ReportFailure,
    SaveCheckpoint,
    SendLeave,
    SendLeft,
    TableFetched,
    Tick,
    TrainerState,
    TrainStep,
    TryRejoin,
    WaitTable,
    decide,
    reslices,
)
from shoal.worker.digest import state_digest
from shoal.worker.errors import CollectiveFailed, StepAborted
from shoal.worker.evaluator import Evaluator
from shoal.worker.flops import FlopMeter
from shoal.worker.heartbeat import CutOff
from shoal.worker.input_pipeline import InputPipeline
from shoal.worker.ledger import Ledger
from shoal.worker.membership import Membership
from shoal.worker.progress import ProgressRecorder
from shoal.worker.layout import GroupSettings, Layout, LayoutOptions
from shoal.worker.layouts import make_layout, prepare_process
from shoal.worker.process_group import Rendezvous
from shoal.worker.runner import WorkerRunner
from shoal.worker.steal import StepShares
from shoal.worker.switch import GenerationSwitch
from shoal.worker.tensorboard import TensorBoardLog
from shoal.worker.userapi import TrainingSetup, load_entrypoint
from shoal.events import envvars

#: How long a member other than rank 0 that finished waits for rank 0's report of the job's
#: completion before it reports it itself (seconds; at least 3 heartbeat TTLs): time for rank
#: 0's final evaluation and checkpoint.
COMPLETION_WAIT_S = 30.0


def completion_wait(spec: JobSpec) -> float:
    """See :data:`COMPLETION_WAIT_S`."""
    return max(COMPLETION_WAIT_S, 3 * spec.heartbeat_ttl)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MiB (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


log = logging.getLogger("shoal.worker")


class TrainingWorker(WorkerRunner):
    """One worker process of a training job. Drive with :meth:`run` (or :meth:`run_once`);
    ``stop`` drains. :meth:`prepare` builds the model and its parts before joining; every
    attribute exists from ``__init__`` on (None until prepared or started)."""

    def __init__(self, membership: Membership, spec: JobSpec, *, join_timeout: float = 30.0,
                 iface: str | None = None):
        super().__init__(membership, spec, join_timeout=join_timeout)
        #: the backend and device this worker trains with, chosen by its node agent or here
        #: (:mod:`shoal.worker.placement`; PlacementRefused when the spec cannot be honoured)
        self.placement = placement.for_worker(spec.backend, spec.device)
        log.info("placement: %s", self.placement.describe())
        self.membership.placement = self.placement
        #: the interface gloo advertises (None: ``SHOAL_IFACE``, else the route to Redis; see
        #: :func:`shoal.worker.process_group.choose_address`)
        self.iface = iface
        self.faults = FaultPlan.from_env()
        self.ledger = Ledger.from_env()
        #: whether each ledger entry holds the weights' digest after its step (``SHOAL_LEDGER_DIGESTS``)
        self._ledger_digests = envvars.LEDGER_DIGESTS.get() == "1"
        #: the last committed step's compute and exposed all-reduce seconds (for progress)
        self._step_parts: tuple[float | None, float | None] = (None, None)
        #: samples of its own slices and seconds of their own work, over its committed steps
        #: (the heartbeat's ``work_samples``/``work_seconds``: its rate, for slices by speed)
        self._work_samples = 0
        self._work_seconds = 0.0
        #: bounds the Redis barrier and each wait of the rendezvous
        self.rdzv_timeout = 30.0
        #: everything the decisions read; replaced by each decision
        self.state = TrainerState(Limits(max_steps=spec.max_steps, checkpoint_interval=spec.checkpoint_interval,
                                         wait_s=5 * spec.heartbeat_ttl + 5, barrier_s=self.rdzv_timeout,
                                         may_reslice=spec.batch_split == "by_speed"))
        #: rank 0's TensorBoard event files (the spec's ``tensorboard_dir``; None: not asked for)
        self.tensorboard = TensorBoardLog(spec.tensorboard_dir) if spec.tensorboard_dir else None
        #: FLOPs per sample (measured on the first step) and peak FLOP/s, for MFU (:mod:`shoal.worker.flops`)
        self.flops = FlopMeter(spec, self.placement.device)
        #: the cyclic garbage collector, run at fixed steps (``gc_every_steps``: :mod:`shoal.worker.collector`)
        self.collector = StepCollector(spec.gc_every_steps)
        # built by prepare()
        self.setup: TrainingSetup | None = None
        #: the training layout (data parallelism or elastic HSDP: :mod:`shoal.worker.layout`)
        self.engine: Layout | None = None
        self.ckpt: Checkpoints | None = None
        self.input: InputPipeline | None = None
        self.switch: GenerationSwitch | None = None
        self.evaluator: Evaluator | None = None
        # started by start()
        self.progress: ProgressRecorder | None = None
        #: actions decided and not yet performed (a Redis outage interrupted them)
        self._todo: deque[Action] = deque()
        #: a compiled model: dynamo's frames after the warm-up (None: not warmed up here), the
        #: recompiles last logged, the warm-up's seconds
        self._frames_warm: int | None = None
        self._recompiles_said = 0
        self._compile_seconds: float | None = None

    # ---- setup -------------------------------------------------------------------------------

    def prepare(self) -> None:
        prepare_process(self.spec, self.placement.device)  # before the model is built
        setup = load_entrypoint(self.spec.entrypoint, self.spec.seed, self.spec.params)
        self.setup = setup
        device = placement.local_device(self.placement.device)
        self.membership.device = str(device)
        m = self.membership
        groups = GroupSettings(Rendezvous(m.client, m.job_id, backend=self.placement.backend, iface=self.iface),
                               m.keys, lambda: m.worker_id or "", self.rdzv_timeout, self.collective_timeout)
        self.engine = make_layout(self.spec, setup, LayoutOptions.from_spec(self.spec, device), groups, self.faults)
        # here, before any thread or socket of the heartbeat, the watcher or a group exists: a
        # forked loader inherits none of them (see shoal.worker.prefetch)
        self.input = InputPipeline(setup, self.engine, self.spec, self.membership)
        self.switch = GenerationSwitch(self.membership, self.spec, self.engine, faults=self.faults,
                                       evicted=lambda: self.evicted)
        self.evaluator = Evaluator(self.engine, setup.eval_fn, self.membership, self.tensorboard, self._busy,
                                   eval_dataset=setup.eval_dataset, eval_sums=setup.eval_sums,
                                   eval_batch_size=setup.eval_batch_size)
        self.ckpt = Checkpoints.open(self.spec, self.membership, self.faults) if self.spec.checkpoint_uri else None
        if self.ckpt is not None:
            self.evaluator.on_report = self.ckpt.record_eval
        step, cursor = 0, 0
        resumed = self.ckpt.resume(self.engine) if self.ckpt is not None else None
        if resumed is not None:
            step, cursor = resumed
        elif self.spec.init_from:  # a fresh job asked to start from another's weights (at step 0)
            warm_start(self.engine, self.spec.init_from, optimizer=self.spec.init_from_optimizer)
        every_steps, every_epochs = self.spec.eval_every_steps, self.spec.eval_every_epochs
        if not self.evaluator.enabled and (every_steps or every_epochs):
            log.warning("the job sets eval_every_%s but %s returns no eval_fn or eval_dataset: no periodic evaluation",
                        "steps" if every_steps else "epochs", self.spec.entrypoint)
            every_steps = every_epochs = None
        n = self.input.num_samples
        limits = replace(self.state.limits, total_samples=n * self.spec.epochs, num_samples=n,
                         eval_every_steps=every_steps, eval_every_epochs=every_epochs,
                         saves_alone=self.engine.saves_alone)
        self.state = replace(self.state, limits=limits, step=step, cursor=cursor)
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile before joining (:meth:`Layout.warm_up`), from the compile cache in the
        checkpoint store when it holds this model's (:mod:`shoal.worker.compile_cache`; saved
        there by the first worker to compile), and count dynamo's frames from here: a frame
        compiled later is a recompile, logged once each and published with the beat."""
        engine = self.engine
        if engine.compiled_shape is None:
            return
        store = self.ckpt.store if self.ckpt is not None else None
        key = compile_cache.cache_key(engine.model, entrypoint=self.spec.entrypoint, precision=self.spec.precision,
                                      options=self.spec.compile_options, shape=engine.compiled_shape,
                                      device=engine.device)
        local = compile_cache.use_local_dir(key)
        cached = compile_cache.load(store, key, local) if store is not None else "no checkpoint store"
        took = engine.warm_up()
        if not took:  # compiled later (the layout compiles once it can run a step)
            return
        self._frames_warm = tc.compiled_frames()
        self._compile_seconds = round(took, 2)
        log.info("compiled for micro-batches of %d in %.1f s before joining (dynamo: %d frame(s); compile cache: "
                 "%s, in %s)", engine.compiled_shape, took, self._frames_warm, cached, local)
        if store is not None and cached not in ("loaded", "local") and compile_cache.save(store, key, local):
            log.info("compile cache saved to %s/%s/%s.tar.gz for the next workers", store.uri, compile_cache.PREFIX,
                     key)

    def start(self) -> str:
        wid = super().start()
        self.state = replace(self.state, worker_id=wid)
        self.switch.start()
        self.progress = ProgressRecorder(without_retries(self.membership.client), self.membership.keys)
        self.evaluator.progress = self.progress
        self.engine.commit_guard = self._fence
        self.engine.before_collectives = self._not_busy
        if self.state.limits.may_reslice:  # a re-slice is taken one step sooner
            watcher = self.switch.watcher
            self.engine.newest_seen = lambda: watcher.latest
        self.collector.start()  # after prepare() forked the loaders: they keep Python's own collection
        return wid

    def on_evicted(self) -> None:
        """(The heartbeat thread.) See :meth:`GenerationSwitch.on_evicted`."""
        if self.switch is not None:
            self.switch.on_evicted()

    def rejoin_evicted(self, last_generation: int) -> bool:
        """As :meth:`WorkerRunner.rejoin_evicted`, once the layout agreed
        (:meth:`Layout.before_rejoin`: an HSDP member whose replica group trained ends the
        process instead - its shard group cannot be made again here)."""
        if self.engine is not None:
            self.engine.before_rejoin()
        return super().rejoin_evicted(last_generation)

    def _busy(self, busy: bool) -> None:
        if self.hb is not None:
            self.hb.busy(busy)

    def _not_busy(self) -> None:
        self._busy(False)

    def _fence(self) -> None:
        """The last check before a step is applied: a member the coordinator declared failed
        (frozen or starved past its TTL: it wakes still inside its old generation, alone or
        with peers frozen alike) must commit nothing more - its steps are being redone by
        the generation that replaced it. Free unless beats are late; see
        :meth:`Heartbeater.still_member`."""
        if restart.ending():
            raise StepAborted("this process is ending for its node agent to start it again: this step is not applied",
                              local=True)
        if self.hb is None:
            return
        try:
            member = self.hb.still_member()
        except CutOff as exc:
            raise StepAborted(str(exc), local=True) from exc
        if not member:
            raise StepAborted("evicted by the coordinator (declared failed): this step is not applied", local=True)

    def cleanup(self) -> None:
        self.collector.stop()
        if self.switch is not None:
            self.switch.stop()
        if self.engine is not None:
            self.engine.close()
        if self.input is not None:
            self.input.close()
        if self.ckpt is not None:
            self.ckpt.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

    # ---- the loop ----------------------------------------------------------------------------

    def run_once(self) -> int | None:
        """One iteration: observe, then decide and perform until a decision asks for nothing
        more (one step, one switch, one bounded wait). Returns the exit code once the worker
        should end. Raises what the user's code or an unexpected failure raises (a crash).

        A Redis error (the server is unreachable) propagates after the action that raised it
        stays first in line: the next call performs it, and the rest of its decision, before
        observing anything new - nothing a decision asked for is lost to an outage."""
        event: Input | None = self._drain() if self._todo else None
        if event is None and not self._todo:
            watcher = self.switch.watcher
            event = Tick(evicted=self.evicted, stop=self.stop.is_set(), latest=watcher.latest,
                         job_state=watcher.job_state)
        while event is not None:
            d = decide(self.state, event, time.monotonic())
            if d.level:
                log.log(d.level, "%s", d.reason)
            self.state = d.state
            self._todo.extend(d.actions)
            event = self._drain()
        return self.state.exit_code

    def _drain(self) -> Input | None:
        """Perform the queued actions in order; the input the last producing one produced."""
        event = None
        while self._todo:
            event = self._perform(self._todo[0]) or event  # only the last one may produce the next input
            self._todo.popleft()
        return event

    def _perform(self, action: Action) -> Input | None:
        """Carry out one action; the input it produced, if it produces one."""
        match action:
            case TrainStep():
                return self._train_step(action)
            case Beat():
                self._beat(action)
            case RecordProgress(step=step, loss=loss, generation=generation, world=world):
                compute, exposed = self._step_parts
                self.progress.record(step, loss, generation, world, input_wait=self.input.step_wait,
                                     compute=compute, exposed_comm=exposed, stream=self.input.stream_figures)
                if self.tensorboard is not None:
                    lrs = [group.get("lr", 0.0) for group in self.engine.optimizer.param_groups]
                    self.tensorboard.scalars(step, loss, generation, world, lrs)
            case SaveCheckpoint():
                self._save(action)
            case Evaluate():
                self.evaluator.run(action)
            case TryRejoin(last_generation=last):
                return Rejoined(self.rejoin_evicted(last), self.membership.worker_id or "")
            case LeaveGroup(background=background):
                aborted = self.switch.aborted()
                self.switch.leave(background=background)
                if not background and not aborted:
                    # a failed collective's leftovers may pin the broken group's sockets (an
                    # aborted group is abandoned to a thread instead: nobody waits on it)
                    gc.collect()
                self.switch.digest_done()  # a catch-up may overwrite what the digest still reads
            case SendLeave():
                self.membership.leave("SIGTERM")
            case SendLeft():
                self.membership.left()
            case ReportFailure(generation=generation, step=step, error=error, rendezvous=rendezvous, kind=kind,
                               local=local):
                self.membership.step_failed(generation, step, error, rendezvous=rendezvous, formation_error=kind,
                                            local=local)
            case FetchTable():
                return TableFetched(self.membership.current_table())
            case FetchNext(generation=generation):
                return NextFetched(self.membership.table_of(generation))
            case WaitTable(after=after):
                return self.switch.wait_table(after)
            case Arrive(generation=generation):
                self.switch.arrive(generation, self.state.table.world_size)
            case PollBarrier(generation=generation, wait=wait):
                return self.switch.poll_barrier(generation, self.state.table.world_size, wait)
            case Form(table=table, restore=restore):
                step, cursor = self.state.step, self.state.cursor
                if restore is not None:
                    step, cursor = self._restore(restore, step, cursor)
                formed = self.switch.form(table, step, cursor)
                if isinstance(formed, Formed):
                    self.input.formed(table.generation, formed.step, frozenset(formed.behind))
                elif restore is not None:
                    formed = replace(formed, restored=(step, cursor))
                return formed
            case Announce():
                self._announce(action)
            case Finish():
                self._finish(action)
            case _:  # pragma: no cover - a new action type without a performer
                raise TypeError(f"no performer for {action!r}")
        return None

    # ---- performers --------------------------------------------------------------------------

    def _restore(self, restore: int, step: int, cursor: int) -> tuple[int, int]:
        """Load the newest checkpoint (the generation starts from the one of step ``restore``:
        no member holds the job's state); the (step, cursor) to form with. This member's own
        state when there is no store or no checkpoint verifies (then its catch-up decides)."""
        resumed = self.ckpt.resume(self.engine) if self.ckpt is not None else None
        if resumed is None:
            log.warning("generation starts from the checkpoint of step %d, but none could be loaded here: forming "
                        "with this member's own state (step %d)", restore, step)
            return step, cursor
        if resumed[0] != restore:
            log.info("the checkpoint of step %d was asked for; the newest one is of step %d", restore, resumed[0])
        return resumed

    def _reslice_ahead(self, act: TrainStep):
        """This member's entry in the re-slice of its table that the watcher delivered, if one
        came (slices by speed): seen before this step, it is carried by this step's all-reduce,
        so the steps after it use its ranges - the prefetcher fetches those ahead instead of
        ranges no step will take. A hint only: the switch itself is decided as ever."""
        table = self.switch.newest_table if self.state.limits.may_reslice else None
        if table is None or self.state.table is None or not reslices(self.state.table, table):
            return None
        return table.member(self.membership.worker_id)

    def _shares(self, act: TrainStep, batch, local: list[int]) -> StepShares | None:
        """The whole step's slices by rank when the members even the step out (slices by speed
        with ``batch_split_steal``, a map-style dataset, a group of two or more, every rank on
        its table's ranges - ``act.planned`` - of the table the step trains): None otherwise
        (then each member trains its own slice, as ever). Every condition reads what every
        rank of the step knows alike, so either all ranks claim or none does."""
        table, member = self.state.table, self.state.member
        if not self.engine.steals or self.input.stream is not None or table is None or member is None \
                or not act.planned or table.generation != act.base or len(table.members) < 2:
            return None
        blocks = [np.empty(0, dtype=np.int64)] * len(table.members)
        for m in table.members:
            blocks[m.rank] = batch.for_rank(m.ranges)
        if sum(map(len, blocks)) != batch.count:  # (the step's sample count would refuse it anyway)
            return None
        chunk = self.engine.compiled_shape or self.engine.micro_batch or max(1, len(local))
        return StepShares(tuple(blocks), member.rank, chunk, f"steal/{act.base}/{act.step}")

    def _train_step(self, act: TrainStep) -> Input:
        """Train one step; the ledger records a committed one before anything else happens."""
        wid = self.membership.worker_id
        since = self.evaluator.busy_since(act.base, act.step)
        if self.hb is not None:
            # an evaluation right before this step, in this group, is part of its own work:
            # the peers wait for both in this step's all-reduce (not for what came between,
            # e.g. a Redis outage that held the evaluation's report)
            self.hb.busy(True, since=since)
        self.faults.at(wid, act.step, "before_step")
        later = self._reslice_ahead(act)
        batch, ranges, local = self.input.step(act, self.state.table, self.state.member, wid, later)
        started = time.monotonic()
        try:
            self.faults.at(wid, act.step, "mid_step")
        except InjectedAbort as exc:  # this member gives the step up itself (core/faults.py)
            self._not_busy()
            return Aborted(f"step aborted, nothing applied: {exc}", local=True)
        try:
            with self.flops.measure(len(local), self.setup, self.hb, self.progress, self.tensorboard) as counted:
                result = self.engine.step(local, batch.count, act.generation, base_generation=act.base,
                                          world_size=act.world, shares=self._shares(act, batch, local))
                if result.trained is not None:
                    counted.samples = len(result.trained)
        except StepAborted as exc:
            self._not_busy()
            # returned, not handled here: once this frame is gone nothing pins the broken
            # group, so leaving it closes its sockets and peers still inside the collective fail now
            return Aborted(str(exc), local=exc.local)
        self._not_busy()
        scaler = self.engine.scaler
        fp16 = {} if scaler is None else {"loss_scale": result.loss_scale, "skipped": result.skipped,
                                          "scale_after": scaler.state_dict()}
        if result.trained is not None:  # the layout chose this rank's samples of the step itself
            local = list(result.trained)
        extra = {**fp16, "compute": round(result.compute_seconds, 6),
                 "comm": round(result.comm_exposed_seconds, 6)}
        if self._ledger_digests:  # tests compare the members' weights after every step
            extra["digest"] = state_digest(self.engine.model)
        self.ledger.commit(wid, act.step + 1, batch, act.base, local, act.world, extra)
        # the next steps' batches: on a re-slice's ranges when this step agreed on the switch to it
        switching = later is not None and result.max_generation > act.base
        self.input.committed(batch, ranges, later if switching else self.state.member)
        # every member at the same committed steps, outside the step's own work: they pause together
        self.collector.after_step(act.step + 1)
        self._step_parts = (result.compute_seconds, result.comm_exposed_seconds)
        self._work_samples += len(local)
        self._work_seconds += result.compute_seconds
        if self.hb is not None:  # published with the next beat
            self.hb.update(compute_time=round(result.compute_seconds, 4),
                           exposed_comm_time=round(result.comm_exposed_seconds, 4), work_samples=self._work_samples,
                           work_seconds=round(self._work_seconds, 4), **self.input.heartbeat_figures())
        self.faults.at(wid, act.step + 1, "after_commit")
        return Committed(cursor=batch.next_cursor, max_generation=result.max_generation, loss=result.loss, started=started)

    def _beat(self, act: Beat) -> None:
        if self.hb is None:
            return
        fields = dict(step=act.step, generation=act.generation, step_time=time.monotonic() - act.started, loss=act.loss,
                      epoch=self.input.epoch(self.state.cursor), total_steps=self.input.total_steps,
                      peak_rss_mb=peak_rss_mb())
        if act.digest:
            fields["digest"] = state_digest(self.engine.model)
        if self.engine.compiled_shape is not None:
            frames = tc.compiled_frames()
            recompiles = frames - self._frames_warm if self._frames_warm is not None else None
            if recompiles and recompiles != self._recompiles_said:
                log.warning("recompiled %d time(s) since the warm-up (dynamo frames %d)", recompiles, frames)
                self._recompiles_said = recompiles
            fields.update(compiled_frames=frames, recompiles=recompiles, compile_seconds=self._compile_seconds)
        self.hb.update(**fields)
        self.hb.committed(time.monotonic())

    def _save(self, act: SaveCheckpoint) -> None:
        """Rank 0's checkpoint, or in HSDP this member's part of its replica group's (the
        decision chose when); async unless ``final``."""
        if self.ckpt is None:
            return
        member = self.state.member
        self.ckpt.save(self.engine, step=act.step, cursor=act.cursor, epoch=self.input.epoch(act.cursor),
                       generation=act.generation, world_size=act.world, wait=act.final,
                       shard=member.shard if member is not None else 0)

    def _announce(self, act: Announce) -> None:
        """Publish the new generation with the heartbeat, aim the input pipeline at its first
        steps, note the membership change in TensorBoard (rank 0), and have the switch log the
        digest of the starting state and send ``ready`` off the critical path
        (:meth:`GenerationSwitch.announce`)."""
        if self.hb is not None:
            self.hb.update(generation=act.generation, digest=None, step=act.step)
        table = self.state.table
        self.input.switched(act, table, self.state.member, self.membership.worker_id, self.state.first_ranges)
        if self.tensorboard is not None and act.rank == 0:
            why = table.reason if table is not None and table.generation == act.generation else ""
            # the plan's reason says who joined, failed or left, and names the generation
            self.tensorboard.text(act.step, "membership", why or f"generation {act.generation}: world size {act.world}")

        def publish(digest: str) -> None:
            if self.hb is not None:
                self.hb.update(digest=digest)

        self.switch.announce(act, publish)

    def _finish(self, act: Finish) -> None:
        self.faults.at(self.membership.worker_id, act.step, "finish")
        summary = {"step": act.step, "cursor": act.cursor, "digest": state_digest(self.engine.model)}
        if self.evaluator.enabled:
            try:
                metrics = self.evaluator.metrics(act.step, act.cursor)
            except CollectiveFailed as exc:  # the job's last step committed: its end is not held up by a peer lost now
                log.warning("the final distributed evaluation failed (%s): not reported", exc)
                metrics = {}
            # a metric named like a summary field (step, cursor, digest) does not replace it
            summary.update({k: v for k, v in metrics.items() if k not in summary})
            if act.report and metrics:  # before the completion: the job's last evaluation is this one
                self.evaluator.report(act.step, self.input.epoch(act.cursor), act.generation or self.switch.group[0], metrics,
                                      final=True)
        if act.checkpoint is not None:
            self._save(act.checkpoint)
        export = envvars.EXPORT_DIR.get()
        if export:  # tests and tools compare final weights across runs
            Path(export).mkdir(parents=True, exist_ok=True)
            torch.save(self.engine.full_state_dict(), Path(export) / f"final-{self.membership.worker_id}.pt")
        if self.hb is not None:
            self.hb.update(step=act.step, digest=summary["digest"])
            self.hb.beat()
        if act.report:
            self.membership.completed(act.step, summary)
        else:
            self._complete_unless_reported(act.step, summary)
        log.info("finished: %s", json.dumps(summary))

    def _complete_unless_reported(self, step: int, summary: dict) -> None:
        """A member other than rank 0 that committed the job's last step: rank 0 reports the
        completion once its final checkpoint is written; this member waits for the job to end
        (its heartbeat goes on: a member that finished is never declared failed) and reports
        it itself when that has not happened within :func:`completion_wait` - a rank 0 that
        is stuck, or died after the step, must not hide a finished job (issue 34)."""
        wait = completion_wait(self.spec)
        deadline = time.monotonic() + wait
        watcher = self.switch.watcher
        while time.monotonic() < deadline and not self.stop.is_set():
            if is_terminal(watcher.job_state):
                return
            self.stop.wait(0.1)
        if is_terminal(watcher.job_state):
            return
        log.warning("the job is not complete %.0f s after its last step (%d) was committed here: reporting its "
                    "completion from this member", wait, step)
        self.membership.completed(step, summary)
