"""The training step of elastic HSDP: one replica group shards the model, the other replica
groups hold the same shards, and the step is world-size invariant and all-or-nothing as in
data parallelism (:mod:`shoal.worker.engine`).

Layout
    A job's ``shard_size`` S workers form a replica group (the coordinator's choice). Its
    members share a *shard group*: the process's registered default group, formed once when
    the replica group first trains and kept for its life (torch resolves FSDP's groups by
    name: they cannot be destroyed and made again). :meth:`ShardedEngine.shard` wraps the
    model with FSDP2 (``fully_shard``) over that group: each unit (``TrainingSetup.shard_units``,
    by default the root's children and the elements of its containers), then the root. The
    optimizer's parameter groups are pointed at the sharded parameters (same names, same
    groups), so the user's optimizer and LR scheduler objects stay the ones in use. Each
    member then holds 1/S of the parameters, gradients and optimizer state.

    Across replica groups, per generation, one gloo group per shard index (a *cross group*,
    :meth:`ShardedEngine.set_cross`: a standalone group, dropped at the next switch) carries
    the gradient: FSDP's all-reduce hook starts an asynchronous SUM all-reduce of each unit's
    reduce-scattered gradient shard on it (FSDP views its parameters' gradients into that
    buffer, so the reduced values land in place); the step waits for them after backward,
    abortably like every wait of :mod:`shoal.worker.process_group`. FSDP's reduce-scatter
    averages over the shard group, so backward runs on the local loss sum x S / global count:
    the final gradient is the global batch's mean, whatever the number of replica groups.

Atomicity
    After backward: the cross-replica all-reduce of ``(ahead, loss sum, count)``, then one
    shard-group all-reduce of those with an error flag and the squared norm of the local
    gradient shard - the step's one host read. Every member of a replica group decides alike:
    when any member's cross-replica reduce failed (a replica group died, hung or was evicted),
    nobody in the group applies the step (gradients dropped, buffers restored, FSDP's
    iteration state reset) and StepAborted is raised: the step is redone in the next
    generation. A replica group that committed while another did not is caught up shard by
    shard in the next generation (:func:`shoal.worker.transfer.catch_up_state` over the cross
    group). A failure inside the shard group (a member of this replica group died) is not
    recovered here: the coordinator evicts the whole replica group and its members restart.

Limits: fp16 (a loss scale) is refused by the job spec with ``shard_size`` > 1; every member
of a replica group must run the same number of micro-batches (equal local slices, which the
spec's divisibility rule gives a map-style dataset; leave ``micro_batch`` unset for a streamed
one).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shoal.worker import torch_compat as tc
from shoal.worker.engine import StepCommon, StepResult, _to_device
from shoal.worker.errors import CollectiveFailed, InconsistentStep, StepAborted, UserCodeError, raised_at
from shoal.worker.precision import check_precision
from shoal.worker.process_group import Group, PendingReduce
from shoal.worker.userapi import TrainingSetup

log = logging.getLogger("shoal.worker")

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


def default_shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each child of the root that holds parameters, and each element that does of a child
    container (``ModuleList``, ``Sequential``, ``ModuleDict``): a transformer's blocks, its
    embedding, its head. Modules that share a parameter with another candidate (a head tied
    to the token embedding) are left to the root's unit, which holds both."""
    units: list[torch.nn.Module] = []
    for child in model.children():
        if isinstance(child, _CONTAINERS):
            units += [m for m in child.children() if any(True for _ in m.parameters())]
        elif any(True for _ in child.parameters()):
            units.append(child)
    holders: dict[int, int] = {}
    for unit in units:
        for p in set(map(id, unit.parameters())):
            holders[p] = holders.get(p, 0) + 1
    return [u for u in units if all(holders[id(p)] == 1 for p in u.parameters())]


class ShardedEngine(StepCommon):
    """See the module docstring. Build it before the replica group exists (the model moves to
    ``device``); :meth:`shard` once the shard group formed; :meth:`set_cross` each generation.
    Attributes as :class:`~shoal.worker.engine.StepEngine`'s that the worker reads."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        step_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
        lr_scheduler: Any | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        micro_batch: int | None = None,
        device: torch.device | str = "cpu",
        precision: str = "fp32",
        max_grad_norm: float | None = None,
        shard_units: Callable[[torch.nn.Module], list[torch.nn.Module]] | None = None,
    ) -> None:
        if check_precision(precision) == "fp16":
            raise ValueError("fp16 (a loss scale) is not supported by elastic HSDP: use bf16 or fp32")
        super().__init__(model, optimizer, dataset, loss_fn=loss_fn, step_fn=step_fn, lr_scheduler=lr_scheduler,
                   collate_fn=collate_fn, micro_batch=micro_batch, device=device, precision=precision,
                   max_grad_norm=max_grad_norm)
        self.shard_units = shard_units or default_shard_units
        #: never in HSDP (fp16 is refused); the worker reads it
        self.scaler = None
        #: applied to each shard unit right before it is sharded (None: nothing)
        self.prepare_unit: Callable[[torch.nn.Module], None] | None = None
        #: the replica group's shard group (None until :meth:`shard`) and this generation's
        #: cross-replica group of this member's shard index (None: one replica group)
        self.shard_group: Group | None = None
        self.cross: Group | None = None
        #: the cross-replica reduces of the step in flight, and their failures
        self._pending: list[PendingReduce] = []
        self._errors: list[str] = []
        self._local_error = False
        #: what runs once the model is sharded (a checkpoint to resume from)
        self._after_shard: list[Callable[[], None]] = []
        #: (step, cursor) of a checkpoint loaded in place of the one chosen at start, which
        #: retention removed before the replica group formed (None: as chosen)
        self.resumed_at: tuple[int, int] | None = None

    @classmethod
    def from_setup(cls, setup: TrainingSetup, *, device: torch.device | str = "cpu", precision: str = "fp32",
                   max_grad_norm: float | None = None) -> "ShardedEngine":
        return cls(setup.model, setup.optimizer, setup.dataset, loss_fn=setup.loss_fn, step_fn=setup.step_fn,
                   lr_scheduler=setup.lr_scheduler, collate_fn=setup.collate_fn, micro_batch=setup.micro_batch,
                   device=device, precision=precision, max_grad_norm=max_grad_norm, shard_units=setup.shard_units)

    # --- layout -------------------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        return self.shard_group is not None

    def after_shard(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at the end of :meth:`shard` (load a checkpoint into the sharded model)."""
        self._after_shard.append(fn)

    def shard(self, group: Group) -> None:
        """Shard the model over ``group`` (the registered default group, this replica group's
        shard group; once), point the optimizer at the sharded parameters, then run what
        :meth:`after_shard` queued. Raises ValueError when the optimizer already holds state
        (it must not have stepped yet)."""
        if self.shard_group is not None:
            raise ValueError("the model is sharded already (a replica group's shard group lives as long as it)")
        if self.optimizer.state:
            raise ValueError("the optimizer holds state before the model was sharded")
        names = {id(p): n for n, p in self.model.named_parameters()}
        unknown = [p for g in self.optimizer.param_groups for p in g["params"] if id(p) not in names]
        if unknown:
            raise ValueError(f"the optimizer holds {len(unknown)} parameter(s) that are not the model's")
        mesh = tc.mesh_of_default_group(self.device.type)
        for unit in self.shard_units(self.model):
            if self.prepare_unit is not None:  # activation checkpointing, compile: before it is sharded
                self.prepare_unit(unit)
            tc.fully_shard(unit, mesh)
        tc.fully_shard(self.model, mesh)
        sharded = dict(self.model.named_parameters())
        for g in self.optimizer.param_groups:
            g["params"] = [sharded[names[id(p)]] for p in g["params"]]
        for module in tc.fsdp_modules(self.model):
            module.set_all_reduce_hook(self._cross_reduce)
        self.shard_group = group
        log.info("model sharded over a replica group of %d (%d FSDP units): %d of %d parameters here",
                 group.world_size, len(tc.fsdp_modules(self.model)),
                 sum(tc.local(p).numel() for p in self.model.parameters()),
                 sum(p.numel() for p in self.model.parameters()))
        while self._after_shard:
            self._after_shard.pop(0)()

    def set_cross(self, group: Group | None) -> None:
        """This generation's cross-replica group of this member's shard index (None: one
        replica group, or between generations)."""
        self.cross = group

    def _cross_reduce(self, reduce_output: torch.Tensor) -> None:
        """FSDP's all-reduce hook (inside backward): start the cross-replica SUM of this
        unit's gradient shard. Never raises into autograd: a failure is kept for the vote."""
        cross = self.cross
        if cross is None or cross.world_size == 1 or self._errors:
            return
        try:
            if cross.serial_collectives() and self._pending:
                self._pending[-1].wait()  # gloo with 3+ ranks: one collective in flight
            self._pending.append(cross.all_reduce_async(reduce_output, dist.ReduceOp.SUM,
                                                        "cross-replica all-reduce of a gradient shard"))
        except CollectiveFailed as exc:
            self._fail(exc)

    # --- the step -----------------------------------------------------------------------------
    def step(self, local_indices: Sequence[int] | np.ndarray, global_count: int, generation: int, *,
             base_generation: int | None = None, world_size: int | None = None) -> StepResult:
        """Train on this rank's ``local_indices`` of a global batch of ``global_count`` samples
        (every member of every replica group calls it for the same step); as
        :meth:`StepEngine.step`, with the votes of the module docstring. ``base_generation``:
        the group's generation (``max_generation`` is ``base + 1`` when any rank saw a newer
        one). ``world_size``: the generation's ranks (all replica groups'): every member runs
        as many forward/backward passes as the largest slice needs (FSDP's collectives go in
        lock-step within a replica group), a rank with fewer samples - the short last batch
        of an epoch - makes up the difference with passes that weigh zero. Raises
        StepAborted (nothing applied), InconsistentStep, UserCodeError."""
        if global_count <= 0:
            raise ValueError(f"global_count must be positive, got {global_count}")
        if self.shard_group is None:
            raise StepAborted("step: the model is not sharded yet (no replica group)")
        base = generation if base_generation is None else base_generation
        local = [int(i) for i in local_indices]
        buffers = [b.detach().clone() for b in self.model.buffers()]
        self._pending, self._errors, self._local_error = [], [], False
        ahead = float(max(0, generation - base))
        t0 = time.perf_counter()
        #: (ahead, loss sum, count), summed across replica groups by an all-reduce that goes
        #: out before the last backward (overlapping it) - this replica group's alone when there is no other
        tail = torch.zeros(3, dtype=torch.float64, device=self.device)
        tail[0].fill_(ahead)
        tail[2].fill_(len(local))
        try:
            self._forward_backward(local, global_count, world_size or self.shard_group.world_size, tail)
        except Exception as exc:  # noqa: BLE001 - user code; translated
            self._abandon(buffers)
            raise UserCodeError(f"training step raised {type(exc).__name__}: {exc} (at {raised_at(exc)})") from exc
        t1 = time.perf_counter()
        if self.before_collectives is not None:
            self.before_collectives()
        for i, pending in enumerate(self._pending):
            try:
                pending.wait()
            except CollectiveFailed as exc:
                self._fail(exc)
                self.cross.abandon(self._pending[i + 1:])
                break
        self._pending = []  # waited for or abandoned (kept by the group): nothing pins the cross group now
        squares = [tc.local(p.grad).float().pow(2).sum() for p in self.model.parameters() if p.grad is not None]
        norm2 = torch.stack(squares).sum().to(tail.dtype) if squares else torch.zeros((), dtype=tail.dtype)
        vote = torch.cat([tail, torch.tensor([1.0 if self._errors else 0.0], dtype=tail.dtype, device=self.device),
                          norm2.reshape(1).to(self.device)])
        try:
            self.shard_group.all_reduce(vote, what="the replica group's vote on the step")
        except CollectiveFailed as exc:
            self._abandon(buffers)
            raise StepAborted(f"step aborted, nothing applied: {exc}", local=exc.local) from exc
        t2 = time.perf_counter()
        ahead_sum, loss_sum, reduced, failed, grad_sq = vote.tolist()  # the one host read
        self._settle()
        if failed > 0:
            self._rollback_step(buffers)
            why = self._errors[0] if self._errors else "another member of this replica group failed its cross-replica all-reduce"
            raise StepAborted(f"step aborted, nothing applied: {why}", local=self._local_error)
        if int(round(reduced)) != global_count:
            self._rollback_step(buffers)
            raise InconsistentStep(f"ranks processed {int(round(reduced))} samples, expected a global batch of "
                                   f"{global_count}: shard tables or cursors differ between ranks")
        if self.commit_guard is not None:
            try:
                self.commit_guard()
            except StepAborted:
                self._rollback_step(buffers)
                raise
        grad_norm = math.sqrt(grad_sq) if grad_sq >= 0 else float("nan")
        coef = self._clip_coef(grad_norm)
        if coef is not None:
            for p in self.model.parameters():
                if p.grad is not None:
                    tc.local(p.grad).mul_(coef)
        self._update()
        return StepResult(loss=loss_sum / global_count, loss_sum=loss_sum, count=global_count, local_count=len(local),
                          max_generation=base + 1 if ahead_sum > 0 else base, compute_seconds=t1 - t0,
                          comm_seconds=t2 - t1, comm_exposed_seconds=t2 - t1,
                          grad_norm=grad_norm if self.max_grad_norm is not None else None)

    def _forward_backward(self, local: list[int], global_count: int, world: int, tail: torch.Tensor) -> None:
        """Forward and backward of this rank's slice, in as many passes as the largest slice
        of the step needs (the same number on every rank). The local loss sum goes into
        ``tail[1]``, whose cross-replica all-reduce starts before the last backward."""
        self.model.train()
        # FSDP's reduce-scatter averages over the shard group: x S makes it the sum
        factor = self.shard_group.world_size / global_count
        largest = max(-(-global_count // world), len(local))
        mb = self.compiled_shape or self.micro_batch or largest
        passes = max(1, -(-largest // mb))
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        root = self.model
        for k in range(passes):
            root.set_requires_gradient_sync(k == passes - 1)  # reduce once, after the last
            part = local[k * mb:(k + 1) * mb]
            if part:
                loss, weight = self._loss_of(part), factor
            else:  # nothing left here: a pass that weighs nothing keeps the group in lock-step
                loss, weight = self._loss(self._pad_batch(self.compiled_shape or 1)), 0.0
            if part:
                total += loss.detach().to(total.dtype)
            if k == passes - 1:
                tail[1].copy_(total)
                self._reduce_tail(tail)
            (loss.float() * weight).backward()

    def _reduce_tail(self, tail: torch.Tensor) -> None:
        """Start the cross-replica SUM of the step's (ahead, loss sum, count), first of the
        step's cross-replica collectives (so in the same order on every rank)."""
        cross = self.cross
        if cross is None or cross.world_size == 1:
            return
        try:
            self._pending.append(cross.all_reduce_async(tail, dist.ReduceOp.SUM,
                                                        "cross-replica all-reduce of the step's loss and count"))
        except CollectiveFailed as exc:
            self._fail(exc)

    def _fail(self, exc: CollectiveFailed) -> None:
        """A cross-replica collective of this step failed here: kept for the vote (the first
        failure's origin says whether this process gave it up itself)."""
        if not self._errors:
            self._local_error = exc.local
        self._errors.append(str(exc))

    def _pad_batch(self, n: int = 1) -> Any:
        """A batch of ``n`` copies of the dataset's first sample, for a pass that weighs nothing
        (``n``: the compiled shape, when the model is compiled)."""
        batch = self.collate_fn([self.dataset[0]] * n)
        return _to_device(batch, self.device) if self.device.type != "cpu" else batch

    def _abandon(self, buffers: list[torch.Tensor]) -> None:
        """A step that failed in its forward, backward or the shard vote: the cross reduces in
        flight are given up, FSDP's per-iteration state is reset, gradients and buffers rolled
        back."""
        if self.cross is not None and self._pending:
            self.cross.abandon(self._pending)
        self._pending = []
        try:
            self.model.reset_iter_state()
        except Exception:  # noqa: BLE001 - the rollback below is what matters
            log.warning("resetting FSDP's iteration state failed", exc_info=True)
        self._settle()
        self._rollback(buffers)

    def _rollback_step(self, buffers: list[torch.Tensor]) -> None:
        self._pending = []
        self._rollback(buffers)

    # --- state ----------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict, gathered over the shard group (a collective: every
        member of this replica group calls it together)."""
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in self.model.state_dict().items()}

    def state_extras(self) -> dict[str, Any]:
        return {}

    def load_state_extras(self, extra: dict[str, Any]) -> None:
        """Nothing to take: no loss scale in HSDP."""

    def close(self) -> None:
        """Nothing to remove (FSDP's hooks live with the model)."""
