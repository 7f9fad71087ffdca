"""The data-parallel layout (``shard_size`` 1): every member holds the whole model.

Each generation's members form one group - torch's registered default group, made by the
worker's :class:`~shoal.worker.process_group.Rendezvous` - on which the step all-reduces the
gradient in buckets (:class:`~shoal.worker.engine.StepEngine`, whose :attr:`group` this layout
sets for the generation) and over which a new generation starts from the most advanced
member's state (:func:`~shoal.worker.transfer.catch_up_state`: only the members behind receive
it). An eviction aborts that generation's group, formed or still being formed; nothing else.
A member evicted while alive rejoins with its state (the next generation catches it up).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from shoal.core.faults import FaultPlan
from shoal.events.models import Member, ShardTable
from shoal.storage.train_state import TrainState
from shoal.worker.checkpoints import RESUME, Restore, load_flat, restore_warm
from shoal.worker.classify import formation_error
from shoal.worker.decide import Formed, FormFailed
from shoal.worker.engine import StepEngine, StepResult
from shoal.worker.errors import CollectiveFailed, RendezvousFailed, StateMismatch
from shoal.worker.layout import GroupSettings, LayoutOptions, eval_metrics
from shoal.worker.steal import StepShares
from shoal.worker.transfer import catch_up_state, state_bytes, transfer_timeout
from shoal.worker.userapi import TrainingSetup

log = logging.getLogger("shoal.worker")


class DataParallel(StepEngine):
    """The :class:`~shoal.worker.layout.Layout` of data parallelism (see the module docstring)."""

    save_waits = False
    saves_alone = True

    def __init__(self, model, optimizer, dataset, *, options: LayoutOptions, groups: GroupSettings | None = None,
                 **kwargs: Any) -> None:
        super().__init__(model, optimizer, dataset, device=options.device, precision=options.precision,
                         max_grad_norm=options.max_grad_norm, bucket_cap_mb=options.bucket_cap_mb, **kwargs)
        self.groups = groups
        #: whether the steps take ``shares`` (slices by speed evened out within the step)
        self.steals = options.steal_chunk is not None
        #: the worker's fault plan (its ``transfer`` phase: a catch-up's source mid-transfer)
        self.faults: FaultPlan = FaultPlan([])

    @classmethod
    def from_setup(cls, setup: TrainingSetup, options: LayoutOptions, groups: GroupSettings | None = None,
                   faults: FaultPlan | None = None) -> "DataParallel":
        layout = cls(setup.model, setup.optimizer, setup.dataset, options=options, groups=groups,
                     loss_fn=setup.loss_fn, step_fn=setup.step_fn, lr_scheduler=setup.lr_scheduler,
                     collate_fn=setup.collate_fn, micro_batch=setup.micro_batch)
        layout.faults = faults or FaultPlan([])
        if options.compile is not None:  # the whole model's forward
            layout.compile_model(options.compile, [layout.model], options.fixed_micro_batch)
        if layout.steals and layout.micro_batch is None and layout.compiled_shape is None:
            # the chunks claimed within a step are the engine's micro-batches (the prefetcher
            # fetches each one as an item of its own)
            layout.micro_batch = options.steal_chunk
        return layout

    @staticmethod
    def prepare_process(device_type: str) -> None:
        """Nothing: the model is built as the user builds it."""

    # --- a generation's group -------------------------------------------------------------------
    def form(self, table: ShardTable, member: Member, step: int, cursor: int) -> Formed | FormFailed:
        """Join ``table``'s group and make every member's state equal to the most advanced
        member's: only the members that are behind (a joiner; after a failure, one that missed
        the contested step) receive it, from one sender that does not wait for the transfer."""
        g = self.groups
        try:
            self.group = g.rendezvous.join(
                table.generation, member.rank, table.world_size, g.rdzv_timeout, device=self.device,
                # a state transfer is bounded by its own, size-scaled timeout
                collective_timeout=max(g.collective_timeout, transfer_timeout(state_bytes(self.model, self.optimizer))))
            # the engine's replicated state (the fp16 loss scale) travels in extra
            extra = {"step": step, "cursor": cursor, **self.state_extras()}
            src, got, behind = catch_up_state(
                self.model, self.optimizer, extra, step, lr_scheduler=self.lr_scheduler, group=self.group,
                on_header_sent=(lambda: self.faults.at(g.worker_id(), step, "transfer")) if self.faults else None)
            self.load_state_extras(got)
        except (RendezvousFailed, CollectiveFailed, StateMismatch) as exc:
            return FormFailed(str(exc), formation_error(exc))
        return Formed(int(got["step"]), int(got["cursor"]), src, tuple(behind))

    def leave(self, *, background: bool = False) -> None:
        """Leave the generation's group (:meth:`Rendezvous.close_joined`). Never raises."""
        self.group = None
        if self.groups is not None:
            self.groups.rendezvous.close_joined(background=background)

    def aborted(self) -> bool:
        group = self.group
        return bool(group is not None and group.abort_reason)

    def abort_for(self, generation: int, members: frozenset[str], evicted: Sequence[str], newer: int) -> None:
        gone = [w for w in evicted if w in members]
        if gone:  # the group formed, or being formed (its rendezvous waits for that peer)
            self.groups.rendezvous.request_abort(generation, f"generation {newer} evicted {', '.join(gone)}")

    def abort_all(self, generation: int, why: str) -> None:
        self.groups.rendezvous.request_abort(generation, why)

    def membership_lost(self, generation: int, why: str) -> None:
        self.groups.rendezvous.request_abort(generation, why)

    def before_rejoin(self) -> None:
        """Nothing: a data-parallel member rejoins with its state."""

    def close(self) -> None:
        self.leave()
        super().close()  # the gradient hooks

    # --- the step -------------------------------------------------------------------------------
    def step(self, local_indices: Sequence[int], global_count: int, generation: int, *, base_generation: int,
             world_size: int = 0, shares: StepShares | None = None) -> StepResult:
        """As :meth:`StepEngine.step` (``world_size``: the generation's; a data-parallel step
        needs only its own slice - or, with ``shares``, the chunks it claims)."""
        return super().step(local_indices, global_count, generation, base_generation=base_generation, shares=shares)

    def evaluate_split(self, dataset: Any, sums_fn: Any, batch_size: int) -> dict[str, float]:
        """A distributed evaluation (``TrainingSetup.eval_dataset``): this rank's contiguous
        part of ``dataset``, its sums all-reduced over the generation's group (every member
        calls it for the same step). ``val_<name>`` = sum / samples. CollectiveFailed when a
        peer fails; UserCodeError when the user's code raises."""
        group = self.group
        rank, world = (group.rank, group.world_size) if group is not None else (0, 1)
        n = len(dataset)
        part = range(rank * n // world, (rank + 1) * n // world)
        names, total = self.eval_sums(dataset, sums_fn, batch_size, part, -(-len(part) // batch_size))
        if group is not None:
            group.all_reduce(total, what="the all-reduce of the evaluation's sums")
        return eval_metrics(names, total)

    # --- state ----------------------------------------------------------------------------------
    def checkpoint(self, shard: int, **counters: Any) -> TrainState:
        """The whole state (rank 0 writes it)."""
        return TrainState.capture(self.model, self.optimizer, self.lr_scheduler, scaler=self.scaler, **counters)

    def resume(self, state: Any, newest: Callable[[], Any], parts: Restore = RESUME) -> None:
        """Load ``state`` now: a whole checkpoint as it is, a sharded one gathered whole
        (a warm start: the weights, and the optimizer's state with ``parts.optimizer``)."""
        if isinstance(state, TrainState) and parts.warm:
            restore_warm(state, self.model, self.optimizer if parts.optimizer else None)
        elif isinstance(state, TrainState):
            state.restore(self.model, self.optimizer, self.lr_scheduler, rng=state.rng is not None, scaler=self.scaler)
        else:
            load_flat(self, state, parts)

