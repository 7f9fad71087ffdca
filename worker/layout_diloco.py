"""The semi-synchronous layout (``sync: diloco``): DiLoCo, one worker per replica.

A *step* of the job is a **round**: the global batch of a round is ``inner_steps`` (H) x
``global_batch_size`` samples at the committed cursor, split among the generation's members
by the shard table like any step's. Each member

1. starts from the global weights (its model's, equal on every member at a round boundary)
   and runs H inner steps of the user's own optimizer and LR scheduler on its slice, cut in
   H consecutive inner batches - no collective at all (each inner step is the step engine's
   local step: the user's micro-batches, precision and clipping apply);
2. sends its outer gradient ``global - local`` with its sample count ``n`` once: all-reduced
   (fp32: the sum of ``n x delta``) or all-gathered and summed in fp32 in rank order (bf16,
   int8: :mod:`shoal.worker.outer`), so every member holds the same bits - over a slow link
   as long as it takes: the collective timeout bounds a piece of it, not the whole (see
   :mod:`shoal.worker.outer`), and ``step_timeout`` only the inner steps;
3. steps the global weights with the outer Nesterov SGD on ``sum(n x delta) / sum(n)`` and
   loads them into its model.

Steps 1-3 are one step of the engine protocol (:meth:`Diloco.step`), atomic like a data-
parallel step: when the outer collective fails (a member died, was evicted, or a new generation
aborted the group) nothing of the round is applied - the weights, the inner optimizer's state,
the LR scheduler and the buffers are rolled back to the round's start - and the round is
redone, from the same cursor, by the next generation. So a round's samples commit only with the
outer step that holds their outer gradients (the ledger writes the round when :meth:`step`
returns). A member that had finished its inner steps keeps that work aside (:class:`Finished`):
in the redone round - the generation's first, where the members agree on who trains what with
one all-gather (:meth:`Diloco._assign`) - it goes on from there, and only the samples nobody
finished (a dead member's part) are split among the members and trained. A member's death
costs the survivors no inner step, and every sample of the round is trained and committed
exactly once, whatever failed (the ledger records what each member trained:
``StepResult.trained``).

Replicated state: the model (the global weights at every round boundary) and the outer
momentum, kept in the inner optimizer's state under :data:`OUTER_STATE` (a key torch's
``Optimizer.state_dict`` keeps as it is), so the catch-up of a joiner, a checkpoint and a
resume carry it with the rest with no code of their own. The inner optimizer's own state
is each member's (a joiner starts from its source's).

Everything else - forming a generation, the catch-up, aborts, evaluation, checkpoints - is
the data-parallel layout's (:class:`~shoal.worker.layout_dp.DataParallel`).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shoal.core.faults import FaultPlan
from shoal.events.models import Member, ShardTable
from shoal.worker.decide import Formed, FormFailed
from shoal.worker import outer
from shoal.worker.engine import StepEngine, StepResult
from shoal.worker.errors import CollectiveFailed, InconsistentStep, StepAborted
from shoal.worker.layout import GroupSettings, LayoutOptions
from shoal.worker.layout_dp import DataParallel
from shoal.worker.steal import StepShares
from shoal.worker.userapi import TrainingSetup

log = logging.getLogger("shoal.worker")

#: the key of the outer optimizer's state in the inner optimizer's ``state`` (a string key:
#: ``state_dict()`` keeps it as it is, ``load_state_dict`` restores it)
OUTER_STATE = "shoal_diloco_outer"


def inner_batches(local: Sequence[int], inner_steps: int) -> list[list[int]]:
    """A member's slice of a round cut in ``inner_steps`` consecutive inner batches whose sizes
    differ by at most one (the empty ones left out: a slice shorter than H)."""
    if not inner_steps or not len(local):
        return []
    parts = np.array_split(np.asarray(local, dtype=np.int64), inner_steps)
    return [[int(i) for i in part] for part in parts if len(part)]


def inner_step_count(samples: int, world: int, global_batch: int, inner_steps: int) -> int:
    """How many inner steps a member trains ``samples`` in: inner batches of about its share of
    the global batch (``global_batch / world``), at most H. A full round's slice is H of them;
    an epoch's short last round, or a dead member's part taken over, fewer (never H inner steps
    of a few samples each)."""
    if samples <= 0:
        return 0
    return max(1, min(inner_steps, round(samples * max(1, world) / global_batch)))


@dataclass
class Finished:
    """A round this member finished (its H inner steps) whose outer exchange failed: kept so
    that the same round, redone by the next generation, does not train these samples again.
    ``start``: the global weights the round started from (what identifies the round);
    ``weights``, ``optimizer``, ``scheduler``, ``buffers``: the state after the inner steps."""

    start: torch.Tensor
    indices: list[int]
    loss_sum: float
    weights: torch.Tensor
    optimizer: dict
    scheduler: Any
    buffers: list[torch.Tensor]


class Diloco(DataParallel):
    """The :class:`~shoal.worker.layout.Layout` of DiLoCo (see the module docstring)."""

    def __init__(self, model, optimizer, dataset, *, options: LayoutOptions, groups: GroupSettings | None = None,
                 **kwargs: Any) -> None:
        super().__init__(model, optimizer, dataset, options=options, groups=groups, **kwargs)
        if options.diloco is None:
            raise ValueError("the DiLoCo layout needs the spec's diloco options")
        self.diloco = options.diloco
        #: the samples of one inner step over all members (the spec's ``global_batch_size``)
        self.global_batch = options.global_batch
        #: the parameters the outer step moves (the trainable ones, in model order)
        self.outer_params = [p for p in self.model.parameters() if p.requires_grad]
        #: a round finished here whose outer exchange failed (see :class:`Finished`)
        self.finished: Finished | None = None
        #: whether the next round is its generation's first (the members then agree on who
        #: trains what: some may hold finished work of it)
        self.first_round = False

    @classmethod
    def from_setup(cls, setup: TrainingSetup, options: LayoutOptions, groups: GroupSettings | None = None,
                   faults: FaultPlan | None = None) -> "Diloco":
        layout = cls(setup.model, setup.optimizer, setup.dataset, options=options, groups=groups,
                     loss_fn=setup.loss_fn, step_fn=setup.step_fn, lr_scheduler=setup.lr_scheduler,
                     collate_fn=setup.collate_fn, micro_batch=setup.micro_batch)
        layout.faults = faults or FaultPlan([])
        return layout

    def form(self, table: ShardTable, member: Member, step: int, cursor: int) -> Formed | FormFailed:
        """As :meth:`DataParallel.form`; the generation's first round then starts with the
        members agreeing on who trains which samples (:meth:`_assign`)."""
        formed = super().form(table, member, step, cursor)
        self.first_round = isinstance(formed, Formed)
        return formed

    # --- the outer state ------------------------------------------------------------------------
    def _flat(self) -> torch.Tensor:
        """The outer parameters as one fp32 vector (a copy)."""
        return torch.cat([p.detach().reshape(-1).float() for p in self.outer_params])

    def _load_flat(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            offset = 0
            for p in self.outer_params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n

    def momentum_buffer(self, n: int) -> torch.Tensor:
        """The outer Nesterov momentum (zeros before the first outer step)."""
        state = self.optimizer.state.get(OUTER_STATE)
        buf = state.get("momentum_buffer") if isinstance(state, dict) else None
        if not isinstance(buf, torch.Tensor) or buf.numel() != n:
            buf = torch.zeros(n, dtype=torch.float32, device=self.device)
            self.optimizer.state[OUTER_STATE] = {"momentum_buffer": buf}
        return buf

    # --- the round ------------------------------------------------------------------------------
    def step(self, local_indices: Sequence[int], global_count: int, generation: int, *, base_generation: int,
             world_size: int = 0, shares: StepShares | None = None) -> StepResult:
        """One round on this member's ``local_indices`` of a round of ``global_count`` samples
        (see the module docstring). StepAborted: nothing of the round applied (redo it in the
        next generation); InconsistentStep when the members' slices do not add up to
        ``global_count``; UserCodeError from the user's code (fatal for this worker)."""
        group = self.group
        if group is None:
            raise StepAborted("step: not in a process group (no group for this generation)")
        local = [int(i) for i in local_indices]
        start = self._flat()
        saved = self._snapshot()
        t0 = time.perf_counter()
        finished, self.finished = self.finished, None
        if finished is not None and not torch.equal(finished.start, start):
            finished = None  # another round's (the others committed it without this member)
        todo, done, loss_sum = local, [], 0.0
        world = group.world_size
        if self.first_round:
            try:
                todo, done = self._assign(group, local, global_count, finished)
            except CollectiveFailed as exc:
                self.finished = finished
                raise StepAborted(f"round aborted, nothing applied: {exc}", local=exc.local) from exc
            if done:  # go on from the inner steps finished before, then this member's share of the rest
                self._resume_finished(finished)
                loss_sum = finished.loss_sum
                log.info("round redone: %d sample(s) trained before kept, %d more of the members that did not "
                         "finish it", len(done), len(todo))
        before, self.before_collectives = self.before_collectives, None
        self.group, self.require_group = None, False  # the inner steps: local, no collective
        try:
            batches = inner_step_count(len(todo), world, self.global_batch, self.diloco.inner_steps)
            for part in inner_batches(todo, batches):
                loss_sum += StepEngine.step(self, part, len(part), generation, base_generation=base_generation).loss_sum
        except BaseException:
            self.finished = finished if done else None  # what was finished before stays finished
            self._restore(start, saved)
            raise
        finally:
            self.group, self.require_group, self.before_collectives = group, True, before
        trained = done + todo
        t1 = time.perf_counter()
        if self.before_collectives is not None:
            self.before_collectives()
        delta = start - self._flat()
        ahead = float(max(0, generation - base_generation))
        tail = torch.tensor([ahead, loss_sum, float(len(trained))], dtype=torch.float32, device=self.device)
        try:
            total, tails = self._reduce(group, delta, tail)
        except CollectiveFailed as exc:
            self._keep_finished(start, trained, loss_sum)
            self._restore(start, saved)
            raise StepAborted(f"round aborted, nothing applied (its {len(trained)} sample(s) trained here are "
                              f"kept for its redo): {exc}", local=exc.local) from exc
        t2 = time.perf_counter()
        reduced_ahead, reduced_loss, reduced = float(tails[0]), float(tails[1]), int(round(float(tails[2])))
        if reduced != global_count:
            self._restore(start, saved)
            raise InconsistentStep(f"members trained {reduced} samples, expected a round of {global_count}: "
                                   "shard tables or cursors differ between members")
        if self.commit_guard is not None:
            try:
                self.commit_guard()
            except StepAborted:
                self._restore(start, saved)
                raise
        self._settle()  # a round with no inner step (a member behind) ran no before_update callback
        d = self.diloco
        outer.nesterov_step(start, total.div_(reduced), self.momentum_buffer(start.numel()), lr=d.outer_lr,
                            momentum=d.outer_momentum)
        self._load_flat(start)
        self.first_round = False
        return StepResult(loss=reduced_loss / reduced, loss_sum=reduced_loss, count=reduced, local_count=len(trained),
                          max_generation=base_generation + 1 if reduced_ahead > 0 else base_generation,
                          compute_seconds=t1 - t0, comm_seconds=t2 - t1, comm_exposed_seconds=t2 - t1,
                          trained=tuple(trained) if trained != local else None)

    def _assign(self, group, local: list[int], global_count: int, finished: Finished | None
                ) -> tuple[list[int], list[int]]:
        """The generation's first round: (the samples this member trains now, the ones it
        finished before). One all-gather of every member's slice and finished samples: when
        nobody holds finished work of this round, everyone trains its slice; otherwise each
        member keeps what it finished and the samples nobody finished (a dead member's) are
        split among the members in rank order - so the round's samples are trained exactly once
        and nobody's finished inner steps are lost."""
        mine = finished.indices if finished is not None else []
        row = torch.full((2, global_count), -1, dtype=torch.int64)
        row[0, :len(local)] = torch.tensor(local, dtype=torch.int64)
        row[1, :len(mine)] = torch.tensor(mine, dtype=torch.int64)
        rows = [r.view(2, global_count) for r in group.all_gather(row.view(-1), what="the round's assignment")]
        batch = [int(i) for r in rows for i in r[0].tolist() if i >= 0]
        held = [[int(i) for i in r[1].tolist() if i >= 0] for r in rows]
        covered = [i for h in held for i in h]
        if not covered:
            return local, []
        if len(set(covered)) != len(covered) or not set(covered) <= set(batch):  # never expected: start over
            log.warning("the members' finished work of this round overlaps or leaves its batch: redone from scratch")
            return local, []
        taken = set(covered)
        free = [i for i in batch if i not in taken]
        rank, world = group.rank, group.world_size
        return free[rank * len(free) // world:(rank + 1) * len(free) // world], list(mine)

    def _keep_finished(self, start: torch.Tensor, trained: list[int], loss_sum: float) -> None:
        """Keep the state after this member's inner steps of a round that did not commit."""
        sched = copy.deepcopy(self.lr_scheduler.state_dict()) if self.lr_scheduler is not None else None
        self.finished = Finished(start=start.clone(), indices=list(trained), loss_sum=loss_sum, weights=self._flat(),
                                 optimizer=copy.deepcopy(self.optimizer.state_dict()), scheduler=sched,
                                 buffers=[b.detach().clone() for b in self.model.buffers()])

    def _resume_finished(self, finished: Finished) -> None:
        """Load the state after the inner steps of :attr:`finished` (its round is redone)."""
        self._load_flat(finished.weights)
        outer_state = self.optimizer.state.get(OUTER_STATE)  # the outer state is the round start's
        self.optimizer.load_state_dict(copy.deepcopy(finished.optimizer))
        if outer_state is not None:
            self.optimizer.state[OUTER_STATE] = outer_state
        if finished.scheduler is not None:
            self.lr_scheduler.load_state_dict(finished.scheduler)
        with torch.no_grad():
            for b, saved in zip(self.model.buffers(), finished.buffers):
                b.copy_(saved)

    def _reduce(self, group, delta: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every member's outer gradient times its sample count, summed; and the tails summed
        (the same bits on every member)."""
        d = self.diloco
        n = delta.numel()
        what = f"the outer {d.outer_dtype} exchange of the round"
        # one collective per piece: the collective timeout bounds a piece, so a slow link that
        # keeps moving bytes never times the exchange out (see shoal.worker.outer)
        size = self._piece_bytes(group)
        if d.outer_dtype == "fp32":
            flat = torch.cat([delta.mul_(tail[-1]), tail])
            if outer.waits_by_segment(group.backend, d.outer_dtype):  # gloo's ring: whole, as it was
                group.all_reduce(flat, what=what)
            else:
                parts = outer.spans(flat.numel(), size // flat.element_size())
                for i, (a, b) in enumerate(parts):
                    group.all_reduce(flat[a:b], what=_piece(what, i, len(parts)))
            return flat[:n], flat[n:]
        message = outer.pack(delta, tail, d.outer_dtype, d.outer_block)
        parts = outer.spans(message.numel(), size)
        pieces = [group.all_gather(message[a:b], what=_piece(what, i, len(parts))) for i, (a, b) in enumerate(parts)]
        messages = [torch.cat([got[r] for got in pieces]) for r in range(group.world_size)]
        return outer.combine(messages, d.outer_dtype, d.outer_block, n)

    def _piece_bytes(self, group) -> int:
        """The bytes of a piece of the outer exchange (:func:`outer.piece_bytes`). Every member
        must cut the same pieces, or their collectives would not match: sized by the spec's
        collective timeout, the same on every member and never above the group's own (whose
        size-scaled part follows each member's local state: a joiner without optimizer state
        gets a smaller one). A group made outside a worker (no settings): its own."""
        return outer.piece_bytes(self.groups.collective_timeout if self.groups is not None else group.timeout)

    def _snapshot(self) -> tuple[Any, Any, list[torch.Tensor]]:
        """What a round changes besides the weights: the inner optimizer's and the scheduler's
        state (copies) and the buffers."""
        sched = copy.deepcopy(self.lr_scheduler.state_dict()) if self.lr_scheduler is not None else None
        return (copy.deepcopy(self.optimizer.state_dict()), sched,
                [b.detach().clone() for b in self.model.buffers()])

    def _restore(self, start: torch.Tensor, saved: tuple[Any, Any, list[torch.Tensor]]) -> None:
        """Roll a round back to its start: weights, inner optimizer, scheduler, buffers."""
        opt, sched, buffers = saved
        self._load_flat(start)
        self.optimizer.load_state_dict(opt)
        if sched is not None:
            self.lr_scheduler.load_state_dict(sched)
        self._rollback(buffers)


def _piece(what: str, i: int, count: int) -> str:
    """``what`` naming piece ``i`` of ``count`` (as it is: a one-piece exchange)."""
    return what if count == 1 else f"{what} (piece {i + 1} of {count})"
