"""The elastic HSDP layout (``shard_size`` > 1): replica groups shard the model.

The first generation a worker trains in forms its replica group's *shard group* (torch's
registered default group, made by the worker's :class:`~shoal.worker.process_group.
Rendezvous`, kept for the replica group's life: torch resolves FSDP's groups by name), and the
model is sharded over it (:meth:`ShardedEngine.shard`); every generation forms a standalone
*cross-replica group* of this member's shard index, over which a new replica group heals shard
by shard (:func:`~shoal.worker.transfer.catch_up_state`) and the step's gradient shards are
summed. A switch drops only the cross group. When this worker's own replica group loses a
member, or this worker is evicted, its process ends (exit code 75,
:mod:`shoal.worker.restart`): its agent starts it again and it joins a new replica group.

**An eviction aborts exactly what it concerns** (:meth:`Hsdp.abort_for`): that generation's
cross-replica group, formed or still being formed - never the shard group, which outlives
generations and which only the loss of a member of this worker's own replica group concerns
(and that ends the process). At 5e93599 a table that arrived after a failed step had already
dropped the cross group aborted the process's current group instead - the shard group - and the
abort outlived the generation it was meant for: every later step of that replica group failed
its vote, for good (issue 34). Every switch ends with the replica group's vote over its shard
group (:meth:`Hsdp._vote_on_form`), which proves the shard group usable before it is trained
on and that every member starts from the same step; an aborted or broken shard group ends the
process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shoal.core.faults import FaultPlan
from shoal.events.models import Member, ShardTable
from shoal.storage.errors import CheckpointCorrupt
from shoal.storage.rng import capture_rng
from shoal.storage.sharded import Chunk, ShardedTrainState
from shoal.worker import torch_compat as tc
from shoal.worker.allocator import return_freed_tensors
from shoal.worker.checkpoints import RESUME, Restore, load_flat
from shoal.worker.classify import formation_error
from shoal.worker.decide import Formed, FormFailed
from shoal.worker.engine import StepResult, checkpoint_forward, compile_forward
from shoal.worker.errors import CollectiveFailed, RendezvousFailed, StateMismatch
from shoal.worker.layout import GroupSettings, LayoutOptions, eval_metrics
from shoal.worker.process_group import Group
from shoal.worker.restart import exit_for_restart
from shoal.worker.sharded_engine import ShardedEngine
from shoal.worker.steal import StepShares
from shoal.worker.transfer import catch_up_state, state_bytes, transfer_timeout
from shoal.worker.userapi import TrainingSetup

log = logging.getLogger("shoal.worker")


class Hsdp(ShardedEngine):
    """The :class:`~shoal.worker.layout.Layout` of elastic HSDP (see the module docstring)."""

    save_waits = True
    saves_alone = False
    steals = False

    def __init__(self, model, optimizer, dataset, *, options: LayoutOptions, groups: GroupSettings | None = None,
                 **kwargs: Any) -> None:
        # ``options.bucket_cap_mb`` is read and not used: FSDP's units are the buckets here
        super().__init__(model, optimizer, dataset, device=options.device, precision=options.precision,
                         max_grad_norm=options.max_grad_norm, **kwargs)
        self.options = options
        self.groups = groups
        #: this worker's replica group (its id and member ids, from the table it first trained in)
        self.replica: tuple[str, frozenset[str]] = ("", frozenset())
        #: the cross-replica group being formed: [generation, abort reason] (None: none is);
        #: another thread sets the reason, the rendezvous reads it (under ``_lock``)
        self._cross_forming: list | None = None
        self._lock = threading.Lock()
        self.prepare_unit = self._prepare_unit

    @classmethod
    def from_setup(cls, setup: TrainingSetup, options: LayoutOptions, groups: GroupSettings | None = None,
                   faults: FaultPlan | None = None) -> "Hsdp":
        layout = cls(setup.model, setup.optimizer, setup.dataset, options=options, groups=groups,
                     loss_fn=setup.loss_fn, step_fn=setup.step_fn, lr_scheduler=setup.lr_scheduler,
                     collate_fn=setup.collate_fn, micro_batch=setup.micro_batch, shard_units=setup.shard_units)
        if options.compile is not None:  # each shard unit, before it is sharded (torchtitan's way)
            layout.compile_model(options.compile, [], options.fixed_micro_batch)
        return layout

    def _prepare_unit(self, unit: torch.nn.Module) -> None:
        """Each shard unit right before ``fully_shard``: activation checkpointing, then compile."""
        if self.options.activation_checkpointing:
            checkpoint_forward(unit)
        if self.options.compile is not None:
            compile_forward(unit, self.options.compile)

    @staticmethod
    def prepare_process(device_type: str) -> None:
        """On CPU, before the model is built: glibc's thresholds that return freed tensors to
        the kernel (:mod:`shoal.worker.allocator`)."""
        if device_type == "cpu":
            return_freed_tensors()

    # --- a generation's groups ------------------------------------------------------------------
    def form(self, table: ShardTable, member: Member, step: int, cursor: int) -> Formed | FormFailed:
        """The replica group's shard group on its first generation (and the model sharded over
        it), this generation's cross-replica group of this member's shard index, and the
        catch-up over it: a new replica group receives every shard from the most advanced one.
        Then the replica group votes over its shard group (:meth:`_vote_on_form`): it goes on
        only when every member formed and starts from the same step - a member that could not
        form its cross group must not leave the others inside the first step's FSDP
        collectives, which nothing can cancel."""
        me = member
        g = self.groups
        replicas = table.world_size // table.shard_size
        collective_timeout = max(g.collective_timeout, transfer_timeout(state_bytes(self.model, self.optimizer)))
        try:
            if self.shard_group is None:
                self.replica = (me.group, frozenset(x.worker_id for x in table.members if x.group == me.group))
                group = g.rendezvous.join(table.generation, me.shard, table.shard_size, g.rdzv_timeout,
                                          device=self.device, prefix=g.keys.replica_rendezvous(me.group, table.generation),
                                          collective_timeout=collective_timeout)
                try:
                    self.shard(group)
                except Exception:
                    g.rendezvous.close_joined()  # the next try forms the shard group anew, on a fresh prefix
                    self.shard_group = None
                    raise
                if self.resumed_at is not None:  # another checkpoint than the one chosen at start
                    step, cursor = self.resumed_at
            elif me.group != self.replica[0]:  # the coordinator never moves a member: a bug
                self.exit_regroup(f"generation {table.generation} puts this worker in replica group {me.group}, "
                                  f"not {self.replica[0]}")
        except (RendezvousFailed, CollectiveFailed, StateMismatch, ValueError) as exc:
            return FormFailed(str(exc), formation_error(exc))
        failure: Exception | None = None
        got = {"step": step, "cursor": cursor}
        src = 0
        try:
            cross = None
            if replicas > 1:
                forming = [table.generation, ""]
                with self._lock:
                    self._cross_forming = forming
                try:
                    cross = g.rendezvous.standalone(
                        g.keys.cross_rendezvous(table.generation, me.shard), me.replica, replicas, g.rdzv_timeout,
                        generation=table.generation, device=self.device,
                        name=f"generation {table.generation}'s cross-replica group of shard {me.shard}",
                        abort=lambda: forming[1], collective_timeout=collective_timeout)
                finally:
                    with self._lock:
                        self._cross_forming = None
                        self.cross = cross  # from here an eviction aborts it directly
            self.set_cross(cross)
            if cross is not None:  # one replica group: nothing to heal from
                extra = {"step": step, "cursor": cursor, **self.state_extras()}
                src, got, _behind = catch_up_state(self.model, self.optimizer, extra, step,
                                                   lr_scheduler=self.lr_scheduler, group=cross)
        except (RendezvousFailed, CollectiveFailed, StateMismatch, ValueError) as exc:
            failure = exc
        others = self._vote_on_form(table.generation, failure is not None, int(got["step"]), int(got["cursor"]))
        if failure is not None or others:
            self.leave()
            if failure is not None:
                return FormFailed(str(failure), formation_error(failure))
            return FormFailed(f"generation {table.generation}: {others}")
        # every member of a replica group takes its table ranges at once (FSDP's collectives go
        # in lock-step within the group): nobody sits the first step out
        return Formed(int(got["step"]), int(got["cursor"]), src * table.shard_size, ())

    def _vote_on_form(self, generation: int, failed: bool, step: int, cursor: int) -> str:
        """The replica group's vote at the end of a switch, over its shard group (every member
        reaches it, whether its own part of the switch worked or not): "" when every member
        formed, else why not. It also proves the shard group usable before it is trained on -
        not aborted, and one collective over it goes through - and that every member starts
        ``generation`` from the same step and cursor. A shard group that is not usable, or
        members whose states differ, end the process (:meth:`exit_regroup`): its agent starts
        it again in a new replica group, healed from the others. One all-reduce of five
        numbers per switch."""
        group = self.shard_group
        why = group.abort_reason
        if not why:
            vote = torch.tensor([1.0 if failed else 0.0, step, -step, cursor, -cursor], dtype=torch.float64,
                                device=self.device)
            try:
                group.all_reduce(vote, dist.ReduceOp.MAX, what=f"the replica group's vote on generation {generation}")
            except CollectiveFailed as exc:
                why = str(exc)
            else:
                others, high, low, ahead, behind = vote.tolist()
                if others > 0:
                    return f"another member of replica group {self.replica[0]} could not form it"
                if high != -low or ahead != -behind:
                    why = (f"its members start generation {generation} from different states (steps {int(-low)}-"
                           f"{int(high)}, cursors {int(-behind)}-{int(ahead)})")
        if why:
            self.exit_regroup(f"the shard group of replica group {self.replica[0]} cannot train in generation "
                              f"{generation}: {why}")
        return ""

    def leave(self, *, background: bool = False) -> None:
        """Leave the generation's cross-replica group only (the shard group lives as long as
        the replica group). Never raises."""
        with self._lock:
            cross, self.cross = self.cross, None
        self.set_cross(None)
        if cross is not None:
            cross.close(background=background)

    def aborted(self) -> bool:
        cross = self.cross
        return bool(cross is not None and cross.abort_reason)

    def abort_for(self, generation: int, members: frozenset[str], evicted: Sequence[str], newer: int) -> None:
        group_id, replica = self.replica
        lost = [w for w in evicted if w in replica]
        if lost:
            why = f"generation {newer} evicted {', '.join(lost)} of replica group {group_id}"
            if self.shard_group is not None:
                self.exit_regroup(why)
            self.groups.rendezvous.request_abort(generation, why)  # the shard group being formed waits for it
        gone = [w for w in evicted if w in members and w not in replica]
        if gone:
            self._abort_cross(generation, f"generation {newer} evicted {', '.join(gone)}")

    def _abort_cross(self, generation: int, why: str) -> None:
        """(Any thread.) Abort ``generation``'s cross-replica group, formed or being formed;
        nothing when this worker holds none of that generation (it left it already)."""
        with self._lock:
            forming = self._cross_forming
            if forming is not None and forming[0] == generation and not forming[1]:
                forming[1] = why
                log.warning("aborting the rendezvous of generation %d's cross-replica group: %s", generation, why)
            cross = self.cross
        if cross is not None and cross.generation == generation:
            cross.request_abort(why)

    def abort_all(self, generation: int, why: str) -> None:
        self._abort_cross(generation, why)
        shard_group: Group | None = self.shard_group
        if shard_group is not None:  # the process ends next: nothing outlives it
            shard_group.request_abort(why)
        self.groups.rendezvous.request_abort(generation, why)

    def membership_lost(self, generation: int, why: str) -> None:
        if self.shard_group is not None:
            self.exit_regroup(why)
        self.groups.rendezvous.request_abort(generation, why)

    def before_rejoin(self) -> None:
        """A member whose replica group trained ends its process (its shard group cannot be
        made again here); one that never formed a group rejoins with its state."""
        if self.shard_group is not None:
            self.exit_regroup("evicted by the coordinator")

    def exit_regroup(self, why: str) -> None:
        """(Any thread.) End this process for its node agent to start again: its replica
        group's shard group cannot go on. Nothing of it is lost: the other replica groups hold
        the same state and heal the new group."""
        exit_for_restart(f"{why}: this replica group goes whole, and this worker joins a new one")

    def close(self) -> None:
        """Leave the cross group and the shard group (a worker's last act). Never raises."""
        self.leave()
        if self.groups is not None:
            self.groups.rendezvous.close_joined()
        self.shard_group = None

    # --- the step -------------------------------------------------------------------------------
    def warm_up(self) -> float:
        """Nothing before the replica group forms: the shard units are compiled as they are
        sharded, and compile on the first step of the group's first generation (its peers in
        other groups wait for that step)."""
        return 0.0

    def step(self, local_indices: Sequence[int], global_count: int, generation: int, *, base_generation: int,
             world_size: int = 0, shares: StepShares | None = None) -> StepResult:
        """As :meth:`ShardedEngine.step` (``shares`` never comes: :attr:`steals` is False - every
        rank of a replica group takes as many samples, in lock-step)."""
        return super().step(local_indices, global_count, generation, base_generation=base_generation,
                            world_size=world_size or None)

    def evaluate_split(self, dataset: Any, sums_fn: Any, batch_size: int) -> dict[str, float]:
        """A distributed evaluation: every rank (replica x shard_size + shard) its contiguous
        part of ``dataset``, as many passes on every rank as the largest part needs (FSDP's
        collectives go in lock-step within a replica group), the sums all-reduced over the
        shard group, then across replica groups. As :meth:`DataParallel.evaluate_split`."""
        shard, size = self.shard_group.rank, self.shard_group.world_size
        replica, replicas = (self.cross.rank, self.cross.world_size) if self.cross is not None else (0, 1)
        rank, world = replica * size + shard, replicas * size
        n = len(dataset)
        part = range(rank * n // world, (rank + 1) * n // world)
        largest = -(-n // world)
        names, total = self.eval_sums(dataset, sums_fn, batch_size, part, -(-largest // batch_size))
        self.shard_group.all_reduce(total, what="the replica group's all-reduce of the evaluation's sums")
        if self.cross is not None:
            self.cross.all_reduce(total, what="the cross-replica all-reduce of the evaluation's sums")
        return eval_metrics(names, total)

    # --- state ----------------------------------------------------------------------------------
    def checkpoint(self, shard: int, **counters: Any) -> ShardedTrainState:
        """This member's shards (every member of the saving replica group writes its part)."""
        return capture_sharded(self, shard, **counters)

    def resume(self, state: Any, newest: Callable[[], Any], parts: Restore = RESUME) -> None:
        """Load ``state`` once the model is sharded (its replica group formed; at once when it is
        already: a later generation that starts from a checkpoint). A group can
        take a while to form, and retention may have removed that checkpoint meanwhile
        (measured in the HSDP chaos soak: 9 s later, ``shard-0-of-2.bin: missing``, and the
        worker died): then the newest checkpoint that verifies now (``newest()``) is loaded
        instead, and :attr:`resumed_at` says which step and cursor the member starts from (a
        warm start's ``parts`` start at step 0 whichever checkpoint they load)."""

        def load() -> None:
            try:
                load_flat(self, state, parts)
                return
            except CheckpointCorrupt as exc:
                log.warning("the checkpoint of step %d is gone since this worker started (%s): loading the newest "
                            "one instead", state.step, exc)
            newer = newest()
            load_flat(self, newer, parts)
            if parts.warm:
                return
            self.resumed_at = (newer.step, int(newer.data_cursor))
            log.info("resumed from step %d (cursor %s) instead", newer.step, newer.data_cursor)

        if self.shard_group is not None:  # sharded already: a generation that starts from a checkpoint
            load()
            return
        self.after_shard(load)


def capture_sharded(engine, shard: int, **counters) -> ShardedTrainState:
    """This member's part of a sharded checkpoint (live tensors: the saver snapshots them):
    the local shard of every sharded tensor; member 0 also the replicated tensors (buffers,
    optimizer step counts) and values (parameter groups, LR scheduler, RNG)."""
    chunks: list[Chunk] = []
    groups: dict = {}
    for key, value in tc.flat_state(engine.model, engine.optimizer).items():
        if not isinstance(value, torch.Tensor):
            groups[key] = value
            continue
        piece = tc.chunk_of(value)
        if piece is not None:
            local, offsets, size = piece
            if local.numel():
                chunks.append(Chunk(key, local, offsets, size))
        elif shard == 0:
            chunks.append(Chunk(key, value, (0,) * value.dim(), tuple(value.shape)))
    first = shard == 0
    scheduler = engine.lr_scheduler.state_dict() if first and engine.lr_scheduler is not None else None
    return ShardedTrainState(shard=shard, shard_size=engine.shard_group.world_size, chunks=chunks,
                             optimizer_groups=groups if first else None, scheduler=scheduler,
                             rng=capture_rng() if first else None, **counters)
