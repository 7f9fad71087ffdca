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
they produced back as the next input.
"""

from __future__ import annotations

import gc
from collections import deque
import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from pathlib import Path

import torch

from shoal.core.connection import without_retries
from shoal.core.faults import FaultPlan
from shoal.core.jobspec import JobSpec
from shoal.events.models import ShardTable
from shoal.worker import placement
from shoal.worker import process_group as pg
from shoal.worker.barrier import GenerationBarrier
from shoal.worker.checkpoints import Checkpoints
from shoal.worker.classify import formation_error
from shoal.worker.data import DataOrder
from shoal.worker.stream_input import StreamInput, is_streaming
from shoal.worker.stream_order import DEFAULT_WINDOW
from shoal.worker.decide import (
    Aborted,
    Action,
    Announce,
    Arrive,
    BarrierPolled,
    Beat,
    Committed,
    Evaluate,
    FetchTable,
    Finish,
    Form,
    Formed,
    FormFailed,
    Input,
    LeaveGroup,
    Limits,
    PollBarrier,
    RecordProgress,
    Rejoined,
    ReportFailure,
    SaveCheckpoint,
    SendLeave,
    SendLeft,
    TERMINAL,
    TableFetched,
    TableWaited,
    Tick,
    TrainerState,
    TrainStep,
    TryRejoin,
    WaitTable,
    decide,
)
from shoal.worker.digest import digest_of, state_digest
from shoal.worker.engine import StepEngine
from shoal.worker.heartbeat import CutOff
from shoal.worker.errors import CollectiveFailed, RendezvousFailed, StateMismatch, StepAborted
from shoal.worker.ledger import Ledger
from shoal.worker.membership import Membership
from shoal.worker.prefetch import Prefetcher
from shoal.worker.progress import ProgressRecorder
from shoal.worker.runner import WorkerRunner
from shoal.worker.store import legacy_rendezvous
from shoal.worker.tensorboard import TensorBoardLog
from shoal.worker.transfer import catch_up_state, state_bytes, transfer_timeout
from shoal.worker.userapi import TrainingSetup, load_entrypoint
from shoal.worker.watcher import GenerationWatcher

log = logging.getLogger("shoal.worker")

DIGEST_JOIN_TIMEOUT = 60.0  # the switch digest's thread, awaited before the first update


class TrainingWorker(WorkerRunner):
    """One worker process of a training job. Drive with :meth:`run` (or :meth:`run_once`);
    ``stop`` drains. :meth:`prepare` builds the model before joining; every attribute exists
    from ``__init__`` on (None until prepared or started)."""

    def __init__(self, membership: Membership, spec: JobSpec, *, join_timeout: float = 30.0,
                 iface: str | None = None):
        super().__init__(membership, spec, join_timeout=join_timeout)
        #: the backend and device this worker trains with, chosen by its node agent or here
        #: (:mod:`shoal.worker.placement`; PlacementRefused when the spec cannot be honoured)
        self.placement = placement.for_worker(spec.backend, spec.device)
        log.info("placement: %s", self.placement.describe())
        self.m.placement = self.placement
        #: the interface gloo advertises (None: ``SHOAL_IFACE``, else the route to Redis; see
        #: :func:`shoal.worker.process_group.choose_address`)
        self.iface = iface
        self.faults = FaultPlan.from_env()
        self.ledger = Ledger.from_env()
        #: the last committed step's compute and exposed all-reduce seconds (for progress)
        self._step_parts: tuple[float | None, float | None] = (None, None)
        #: bounds the Redis barrier and each wait of the rendezvous
        self.rdzv_timeout = 30.0
        #: everything the decisions read; replaced by each decision
        self.state = TrainerState(Limits(max_steps=spec.max_steps, checkpoint_interval=spec.checkpoint_interval,
                                         wait_s=5 * spec.heartbeat_ttl + 5, barrier_s=self.rdzv_timeout))
        # built by prepare()
        self.setup: TrainingSetup | None = None
        self.engine: StepEngine | None = None
        self.order: DataOrder | None = None
        self.ckpt: Checkpoints | None = None
        #: the input pipeline: fetches the next steps' batches ahead (the engine's fetcher)
        self.prefetch: Prefetcher | None = None
        #: a streaming dataset's per-step assignment by shard owner (None: map-style dataset)
        self.stream: StreamInput | None = None
        #: (generation, step, ranks behind) of the last group formed: in that step the ranks
        #: behind take no samples (a streaming dataset's split leaves them out)
        self._behind: tuple[int, int, frozenset[int]] = (0, -1, frozenset())
        # started by start()
        self.watcher: GenerationWatcher | None = None
        #: where the members of a generation meet (blocking waits; the watcher wakes them)
        self.barrier: GenerationBarrier | None = None
        self._legacy_barrier = legacy_rendezvous()  # benches only: the 2 ms polling barrier
        self.progress: ProgressRecorder | None = None
        #: rank 0's TensorBoard event files (the spec's ``tensorboard_dir``; None: not asked for)
        self.tensorboard = TensorBoardLog(spec.tensorboard_dir) if spec.tensorboard_dir else None
        # the switch digest's helper (one long-lived thread: no start-up per switch) and the
        # (future, generation, step) it is working on
        self._digester = ThreadPoolExecutor(1, thread_name_prefix="switch-digest")
        self._digesting: tuple[Future, int, int] | None = None
        #: actions decided and not yet performed (a Redis outage interrupted them)
        self._todo: deque[Action] = deque()
        #: the generation and member ids of the group being formed or joined (read by the
        #: watcher's thread)
        self._group: tuple[int, frozenset[str]] = (0, frozenset())
        #: the last evaluation: ((step, cursor), metrics), so an action performed again after
        #: a Redis error only sends again, and never evaluates a step twice
        self._evaluation: tuple[tuple[int, int], dict[str, float]] | None = None
        #: (generation, step, seconds it took) of the last periodic evaluation: the next step
        #: of that generation counts as busy that much longer
        self._eval_took: tuple[int, int, float] | None = None

    # ---- setup -------------------------------------------------------------------------------

    def prepare(self) -> None:
        setup = load_entrypoint(self.spec.entrypoint, self.spec.seed)
        self.setup = setup
        device = placement.local_device(self.placement.device)
        self.m.device = str(device)
        self.engine = StepEngine.from_setup(setup, device=device, require_group=True, precision=self.spec.precision,
                                            max_grad_norm=self.spec.max_grad_norm,
                                            bucket_cap_mb=self.spec.bucket_cap_mb)
        n = len(setup.dataset)
        if is_streaming(setup.dataset):  # shard-aware order; each rank reads the shards it owns
            shard_samples = list(setup.dataset.shard_samples)
            self.order = DataOrder(n, self.spec.seed, self.spec.global_batch_size, shard_samples=shard_samples,
                                   window=int(getattr(setup.dataset, "shuffle_window", None) or DEFAULT_WINDOW))
            self.stream = StreamInput(setup.dataset, self.order,
                                      tolerance=int(getattr(setup.dataset, "balance_tolerance", None) or 0))
            self.m.num_shards = len(shard_samples)
            log.info("streaming dataset: %d shards, shuffle window %d shards", len(shard_samples), self.order.window)
        else:
            self.order = DataOrder(n, self.spec.seed, self.spec.global_batch_size)
        log.info("built %s: %d samples, %d steps/epoch", self.spec.entrypoint, n, self.order.steps_per_epoch())
        # here, before any thread or socket of the heartbeat, the watcher or a group exists: a
        # forked loader inherits none of them (see shoal.worker.prefetch)
        self.prefetch = Prefetcher(
            setup.dataset, self.engine.collate_fn, num_samples=n, seed=self.spec.seed,
            global_batch=self.spec.global_batch_size, micro_batch=self.engine.micro_batch, device=self.engine.device,
            workers=self.spec.loader_workers if setup.loader_workers is None else setup.loader_workers,
            steps=self.spec.prefetch_steps if setup.prefetch_steps is None else setup.prefetch_steps,
            end=self.order.cursor_after(self._total_steps()),  # nothing past the last step is fetched
            order=self.order)
        if self.stream is not None:
            self.prefetch.owned_at = self.stream.reading
        self.engine.fetcher = self.prefetch.fetch
        self.ckpt = Checkpoints.open(self.spec, self.m, self.faults) if self.spec.checkpoint_uri else None
        step, cursor = 0, 0
        if self.ckpt is not None:
            resumed = self.ckpt.resume(self.engine)
            if resumed is not None:
                step, cursor = resumed
        every_steps, every_epochs = self.spec.eval_every_steps, self.spec.eval_every_epochs
        if setup.eval_fn is None and (every_steps or every_epochs):
            log.warning("the job sets eval_every_%s but %s returns no eval_fn: no periodic evaluation",
                        "steps" if every_steps else "epochs", self.spec.entrypoint)
            every_steps = every_epochs = None
        limits = replace(self.state.limits, total_samples=n * self.spec.epochs, num_samples=n,
                         eval_every_steps=every_steps, eval_every_epochs=every_epochs)
        self.state = replace(self.state, limits=limits, step=step, cursor=cursor)

    def start(self) -> str:
        wid = super().start()
        self.state = replace(self.state, worker_id=wid)
        # the client's pool gives the watcher's blocking XREAD a connection of its own
        self.barrier = GenerationBarrier(self.m.client, self.m.keys)
        self.watcher = GenerationWatcher(self.m.client, self.m.keys, interval=min(1.0, self.spec.heartbeat_interval * 2),
                                         on_table=self._on_table, on_ended=self._on_ended)
        self.watcher.start()
        self.progress = ProgressRecorder(without_retries(self.m.client), self.m.keys)
        self.engine.commit_guard = self._fence
        self.engine.before_collectives = self._not_busy
        return wid

    def _on_table(self, table: ShardTable) -> None:
        """(The watcher's thread.) A newer table that evicts a member of our group: abort the
        group's collectives now - that peer is hung, cut off or dead, and will not come. A
        wait at an older generation's barrier ends at once (this one supersedes it)."""
        if self.barrier is not None:
            self.barrier.wake(newer=table.generation)
        generation, members = self._group
        if table.generation <= generation or not table.evicted:
            return
        gone = [w for w in table.evicted if w in members]
        if gone:  # the group formed, or being formed (its rendezvous waits for that peer)
            pg.request_abort(generation, f"generation {table.generation} evicted {', '.join(gone)}")

    def on_evicted(self) -> None:
        """(The heartbeat thread.) This worker is no longer a member - declared failed, or its
        record lost with Redis's data: its step cannot commit (the fence would refuse it), so
        the group's collectives are aborted now instead of waiting for peers that may have
        left already (after a Redis wipe a peer whose fence found out first left the group,
        and this one sat in the next step's all-reduce until the collective timeout: 65 s)."""
        generation, _members = self._group
        if generation:
            pg.request_abort(generation, "this worker is no longer a member of the job (declared failed, "
                                         "or its record was lost with Redis's data)")

    def _on_ended(self, state: str) -> None:
        """(The watcher's thread.) The job failed: a group still being formed (its rendezvous
        waits for peers that will not come) or stuck in a collective is aborted, so the loop
        sees the end at once. Not on a completed or stopped job: there every member finishes
        its step (a stop saves a checkpoint of it). A wait at a barrier ends at once."""
        if self.barrier is not None:
            self.barrier.wake()
        generation, _members = self._group
        if generation and state == "failed":
            pg.request_abort(generation, "the job failed")

    def _not_busy(self) -> None:
        if self.hb is not None:
            self.hb.busy(False)

    def _fence(self) -> None:
        """The last check before a step is applied: a member the coordinator declared failed
        (frozen or starved past its TTL: it wakes still inside its old generation, alone or
        with peers frozen alike) must commit nothing more - its steps are being redone by
        the generation that replaced it. Free unless beats are late; see
        :meth:`Heartbeater.still_member`."""
        if self.hb is None:
            return
        try:
            member = self.hb.still_member()
        except CutOff as exc:
            raise StepAborted(str(exc)) from exc
        if not member:
            raise StepAborted("evicted by the coordinator (declared failed): this step is not applied")

    def cleanup(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        pg.leave_group()
        if self.prefetch is not None:
            self.prefetch.close()
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
            event = Tick(evicted=self.evicted, stop=self.stop.is_set(), latest=self.watcher.latest,
                         job_state=self.watcher.job_state)
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
                self.progress.record(step, loss, generation, world, input_wait=self.prefetch.step_wait,
                                     compute=compute, exposed_comm=exposed,
                                     stream=self.stream.last_figures if self.stream is not None else None)
                if self.tensorboard is not None:
                    lrs = [group.get("lr", 0.0) for group in self.engine.optimizer.param_groups]
                    self.tensorboard.scalars(step, loss, generation, world, lrs)
            case SaveCheckpoint():
                self._save(action)
            case Evaluate():
                self._evaluate(action)
            case TryRejoin(last_generation=last):
                return Rejoined(self.rejoin_evicted(last), self.m.worker_id or "")
            case LeaveGroup(background=background):
                aborted = bool(pg.aborted())
                pg.leave_group(background=background)
                if not background and not aborted:
                    # a failed collective's leftovers may pin the broken group's sockets (an
                    # aborted group is abandoned to a thread instead: nobody waits on it)
                    gc.collect()
                self._digest_done()  # a catch-up may overwrite what the digest still reads
            case SendLeave():
                self.m.leave("SIGTERM")
            case SendLeft():
                self.m.left()
            case ReportFailure(generation=generation, step=step, error=error, rendezvous=rendezvous, kind=kind):
                self.m.step_failed(generation, step, error, rendezvous=rendezvous, formation_error=kind)
            case FetchTable():
                return TableFetched(self.m.current_table())
            case WaitTable(after=after):
                return self._wait_table(after)
            case Arrive(generation=generation):
                self.barrier.arrive(generation, self.m.worker_id, self.state.table.world_size)
            case PollBarrier(generation=generation, wait=wait):
                return self._poll_barrier(generation, wait)
            case Form(table=table, rank=rank):
                return self._form(table, rank)
            case Announce():
                self._announce(action)
            case Finish():
                self._finish(action)
            case _:  # pragma: no cover - a new action type without a performer
                raise TypeError(f"no performer for {action!r}")
        return None

    # ---- performers --------------------------------------------------------------------------

    def _train_step(self, act: TrainStep) -> Input:
        """Train one step; the ledger records a committed one before anything else happens."""
        wid = self.m.worker_id
        evaluated, self._eval_took = self._eval_took, None
        if self.hb is not None:
            # an evaluation right before this step, in this group, is part of its own work:
            # the peers wait for both in this step's all-reduce (not for what came between,
            # e.g. a Redis outage that held the evaluation's report)
            follows = evaluated is not None and evaluated[:2] == (act.base, act.step)
            self.hb.busy(True, since=time.monotonic() - evaluated[2] if follows else None)
        self.faults.at(wid, act.step, "before_step")
        batch = self.order.batch(act.cursor)
        ranges = act.ranges
        if self.stream is not None:  # the split by shard owner replaces the table's ranges
            active = self._active_ranks(act)
            ranges = self.stream.ranges(batch, active)
            self.stream.note_step(batch, active)
        local = batch.for_rank(ranges)
        self.prefetch.start_step(act.cursor, ranges, self._steady_ranges(ranges))
        started = time.monotonic()
        self.faults.at(wid, act.step, "mid_step")
        try:
            result = self.engine.step(local, batch.count, act.generation, base_generation=act.base)
        except StepAborted as exc:
            self._not_busy()
            # returned, not handled here: once this frame is gone nothing pins the broken
            # group, so leaving it closes its sockets and peers still inside the collective fail now
            return Aborted(str(exc))
        self._not_busy()
        scaler = self.engine.scaler
        fp16 = {} if scaler is None else {"loss_scale": result.loss_scale, "skipped": result.skipped,
                                          "scale_after": scaler.state_dict()}
        self.ledger.commit(wid, act.step + 1, batch, act.base, local, act.world, fp16)
        self.prefetch.aim(batch.next_cursor, self._steady_ranges(ranges))  # the next steps' batches
        if self.stream is not None:
            self.stream.plan_ahead(batch.next_cursor, self.prefetch.end)
        self._step_parts = (result.compute_seconds, result.comm_exposed_seconds)
        if self.hb is not None:  # published with the next beat
            self.hb.update(compute_time=round(result.compute_seconds, 4),
                           exposed_comm_time=round(result.comm_exposed_seconds, 4))
            self.hb.update(input_wait_time=round(self.prefetch.step_wait, 4))  # waited for its batches
            if self.stream is not None:
                # the dataset's counters (files shared with the loaders, a directory scan) once a second at most
                self.hb.update(**self.stream.figures(max_age=1.0))
        self.faults.at(wid, act.step + 1, "after_commit")
        return Committed(cursor=batch.next_cursor, max_generation=result.max_generation, loss=result.loss, started=started)

    def _active_ranks(self, act: TrainStep) -> list[int] | None:
        """The ranks that take samples in ``act`` (None: all): in the first step after a
        catch-up, those that were not behind. Keeps the stream's table current."""
        self.stream.use_table(self.state.table, self.m.worker_id)
        self.prefetch.owned = self.stream.reading(act.cursor)
        generation, step, behind = self._behind
        if behind and generation == act.base and step == act.step:
            return [r for r in range(act.world) if r not in behind]
        return None

    def _steady_ranges(self, fallback: tuple):
        """This member's ranges in its generation's table (the first step after a catch-up
        may take others): what the prefetcher plans the coming steps with. A streaming
        dataset's: a function of each step's batch (its split by shard owner)."""
        if self.stream is not None:
            stream = self.stream
            return lambda batch: stream.ranges(batch)
        member = self.state.member
        return tuple(map(tuple, member.ranges)) if member is not None else fallback

    def _beat(self, act: Beat) -> None:
        if self.hb is None:
            return
        fields = dict(step=act.step, generation=act.generation, step_time=time.monotonic() - act.started, loss=act.loss,
                      epoch=self.state.cursor // self.order.num_samples, total_steps=self._total_steps())
        if act.digest:
            fields["digest"] = state_digest(self.engine.model)
        self.hb.update(**fields)

    def _total_steps(self) -> int:
        """The job's length in steps: ``max_steps``, else every epoch's steps (the last batch
        of an epoch may be short), whichever is fewer."""
        by_epochs = self.order.steps_per_epoch() * self.spec.epochs
        return min(by_epochs, self.spec.max_steps) if self.spec.max_steps else by_epochs

    def _save(self, act: SaveCheckpoint) -> None:
        """Rank 0's checkpoint (the decision chose when); async unless ``final``."""
        if self.ckpt is None:
            return
        self.ckpt.save(self.engine, step=act.step, cursor=act.cursor, epoch=act.cursor // self.order.num_samples,
                       generation=act.generation, world_size=act.world, wait=act.final)

    def _wait_table(self, after: int) -> TableWaited:
        """One bounded wait for a table newer than ``after``."""
        if self.evicted:
            return TableWaited(evicted=True)
        table = self.m.next_table(after, timeout=min(1.0, self.spec.heartbeat_ttl))
        if table is not None:
            return TableWaited(table)
        return TableWaited(job_ended=self.m.job_state() in TERMINAL)

    def _poll_barrier(self, generation: int, wait: float) -> BarrierPolled:
        """One blocking wait (at most ``wait`` s) at the barrier; a newer table or the job's
        end (the watcher's, read locally) ends it early (:meth:`_on_table`, :meth:`_on_ended`)."""
        if self._legacy_barrier:
            p = self.barrier.poll_legacy(generation)
            return BarrierPolled(p.arrived, p.newest, self.evicted, job_ended=p.job_state in TERMINAL)
        watcher = self.watcher

        def interrupted() -> bool:
            return watcher.latest > generation or watcher.job_state in TERMINAL or self.evicted

        arrived = self.barrier.wait(generation, self.m.worker_id, self.state.table.world_size, wait, interrupted)
        return BarrierPolled(arrived, watcher.latest, self.evicted, job_ended=watcher.job_state in TERMINAL)

    def _form(self, table: ShardTable, rank: int) -> Formed | FormFailed:
        """Join ``table``'s group and make every member's state equal to the most advanced
        member's: only the members that are behind (a joiner; after a failure, one that missed
        the contested step) receive it, from one sender that does not wait for the transfer."""
        self.faults.at(self.m.worker_id, self.state.step, "rendezvous")
        t0 = time.monotonic()
        self._group = (table.generation, frozenset(m.worker_id for m in table.members))
        try:
            pg.join_group(self.m.client, self.m.job_id, table.generation, rank, table.world_size,
                          timeout=self.rdzv_timeout, iface=self.iface, backend=self.placement.backend,
                          device=self.engine.device,
                          # a state transfer is bounded by its own, size-scaled timeout
                          collective_timeout=max(self.collective_timeout,
                                                 transfer_timeout(state_bytes(self.engine.model, self.engine.optimizer))))
            # the engine's replicated state (the fp16 loss scale) travels in extra
            extra = {"step": self.state.step, "cursor": self.state.cursor, **self.engine.state_extras()}
            src, got, behind = catch_up_state(self.engine.model, self.engine.optimizer, extra, self.state.step,
                                              lr_scheduler=self.engine.lr_scheduler)
            self.engine.load_state_extras(got)
        except (RendezvousFailed, CollectiveFailed, StateMismatch) as exc:
            return FormFailed(str(exc), formation_error(exc))
        self._behind = (table.generation, int(got["step"]), frozenset(int(r) for r in behind))
        return Formed(int(got["step"]), int(got["cursor"]), src, tuple(behind), time.monotonic() - t0)

    def _announce(self, act: Announce) -> None:
        """Publish the new generation with the heartbeat, then log (and publish) the digest of
        the state this member starts it from and send ``ready``: on a helper thread while the
        first step runs. The parameters do not change before that step's update, which waits
        for the helper (``engine.before_update``); buffers, which the forward pass may update,
        are copied. So a member reported Active has logged its starting digest, and ``ready``
        precedes its first commit in the generation, as when this was done inline."""
        if self.hb is not None:
            self.hb.update(generation=act.generation, digest=None, step=act.step)
        first = self.state.first_ranges
        if self.stream is not None:
            self.stream.use_table(self.state.table, self.m.worker_id)
            self.prefetch.owned = self.stream.reading(act.cursor)
            active = [r for r in range(act.world) if r not in act.behind] if act.behind else None
            end = self.prefetch.end
            first = self.stream.ranges(self.order.batch(act.cursor), active) if end is None or act.cursor < end else None
            self.stream.plan_ahead(act.cursor, self.prefetch.end)
        self.prefetch.aim(act.cursor, self._steady_ranges(first or ()), first_ranges=first)
        model = self.engine.model
        params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        state = {k: v if k in params else v.clone() for k, v in model.state_dict().items()}
        moved = f"; state from rank {act.src} to {list(act.behind)}" if act.behind else ""
        if self.tensorboard is not None and act.rank == 0:
            table = self.state.table
            why = table.reason if table is not None and table.generation == act.generation else ""
            # the plan's reason says who joined, failed or left, and names the generation
            self.tensorboard.text(act.step, "membership", why or f"generation {act.generation}: world size {act.world}")

        def run() -> None:
            try:
                digest = digest_of(state)
                if self.hb is not None:
                    self.hb.update(digest=digest)
                log.info("generation %d: rank %d/%d, step %d, cursor %d, digest %s (switch %.3fs%s)",
                         act.generation, act.rank, act.world, act.step, act.cursor, digest, act.took, moved)
            except Exception:  # noqa: BLE001 - a diagnostic: never stops training
                log.warning("the digest of generation %d's starting state failed", act.generation, exc_info=True)
            self.m.ready(act.generation, act.step)  # on failure, sent again by _digest_done

        self._digesting = (self._digester.submit(run), act.generation, act.step)
        self.engine.before_update(self._digest_done)

    def _digest_done(self) -> None:
        """Wait (bounded) for :meth:`_announce`'s helper; send ``ready`` from here when it
        could not (raising what the send raises)."""
        pending, self._digesting = self._digesting, None
        if pending is None:
            return
        future, generation, step = pending
        try:
            future.result(DIGEST_JOIN_TIMEOUT)
        except FutureTimeout:
            log.warning("the switch digest took more than %.0f s; training on", DIGEST_JOIN_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - the helper's ready failed: once more, here
            log.warning("ready for generation %d failed on the helper thread (%s); sending it again", generation, exc)
            self.m.ready(generation, step)

    def _evaluated(self, step: int, cursor: int) -> dict[str, float]:
        """``eval_fn``'s metrics of the model as of committed ``step`` at ``cursor``: computed
        once, then remembered (an action redone after a Redis error does not evaluate again)."""
        if self._evaluation is None or self._evaluation[0] != (step, cursor):
            self._evaluation = ((step, cursor), self.engine.evaluate(self.setup.eval_fn))
        return self._evaluation[1]

    def _evaluate(self, act: Evaluate) -> None:
        """A periodic evaluation (every member); rank 0 reports it to the coordinator and the
        progress history. Busy (the step timeout) from its start to the next step's
        all-reduce. Raises UserCodeError when ``eval_fn`` raises (a crash, as in a step)."""
        started = time.monotonic()
        fresh = self._evaluation is None or self._evaluation[0] != (act.step, act.cursor)
        if self.hb is not None and fresh:
            self.hb.busy(True)
        try:
            metrics = self._evaluated(act.step, act.cursor)
        finally:
            self._not_busy()
        if fresh:
            self._eval_took = (act.generation, act.step, time.monotonic() - started)
        if act.report:
            self._report_eval(act.step, act.epoch, act.generation, metrics)
        log.info("evaluated step %d (epoch %d) in %.3f s%s: %s", act.step, act.epoch, time.monotonic() - started,
                 ", reported" if act.report else "", json.dumps(metrics))

    def _report_eval(self, step: int, epoch: int, generation: int, metrics: dict, final: bool = False) -> None:
        """Rank 0's evaluation, where people look: the coordinator (job record, status,
        events), the progress stream (the report, the dashboard) and TensorBoard."""
        self.m.evaluated(step, epoch, generation, metrics, final=final)
        self.progress.record_eval(step, epoch, generation, metrics)
        if self.tensorboard is not None:
            self.tensorboard.metrics(step, metrics)

    def _finish(self, act: Finish) -> None:
        summary = {"step": act.step, "cursor": act.cursor, "digest": state_digest(self.engine.model)}
        if self.setup.eval_fn is not None:
            metrics = self._evaluated(act.step, act.cursor)
            # a metric named like a summary field (step, cursor, digest) does not replace it
            summary.update({k: v for k, v in metrics.items() if k not in summary})
            if act.report:  # before the completion: the job's last evaluation is this one
                epoch = act.cursor // self.order.num_samples
                self._report_eval(act.step, epoch, self._group[0], metrics, final=True)
        if act.checkpoint is not None:
            self._save(act.checkpoint)
        export = os.environ.get("SHOAL_EXPORT_DIR")
        if export:  # tests and tools compare final weights across runs
            Path(export).mkdir(parents=True, exist_ok=True)
            torch.save(self.engine.model.state_dict(), Path(export) / f"final-{self.m.worker_id}.pt")
        if act.report:
            self.m.completed(act.step, summary)
        if self.hb is not None:
            self.hb.update(step=act.step, digest=summary["digest"])
            self.hb.beat()
        log.info("finished: %s", json.dumps(summary))
