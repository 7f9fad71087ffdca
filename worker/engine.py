"""One training step that does not depend on the world size, and is applied all-or-nothing.

World-size invariance
    For a global batch ``G`` of ``n`` samples the runtime wants the gradient of the *mean* loss,
    ``(1/n) * sum_{i in G} grad l_i``. Each rank computes the **sum** of the per-sample losses of
    its slice (``loss_fn`` with ``reduction="sum"``) and backpropagates it, accumulating over
    micro-batches when the slice is larger than ``micro_batch``. The per-rank gradient sums are
    added by one all-reduce (SUM) and divided by ``n``, the actual size of the global batch.
    So the update is the same for 1 or 16 workers, up to the order of float additions; a rank
    with an empty slice contributes zeros. (Dropout and BatchNorm statistics break this.)

Atomicity
    A step either commits on every rank or on none that the next generation keeps:

    * nothing is applied before every collective of the step has succeeded;
    * if a collective raises (a peer died or hung past the collective timeout), the gradients
      are dropped, module buffers (e.g. BatchNorm running stats) are restored to their values
      before the step, the optimizer and LR scheduler are not stepped, and
      :class:`~worker.errors.StepAborted` is raised - the caller redoes the step, same cursor,
      in the next generation;
    * every rank sees the same all-reduced values, so decisions taken on them (the sample
      count check -> :class:`~worker.errors.InconsistentStep`, the newest generation) are the
      same everywhere.

    A collective can still complete on some ranks and fail on others (a peer dying during the
    last exchange of a ring all-reduce). A rank that completed holds the *full* reduced
    gradient, so its committed step is correct; the ranks disagree only on how many steps
    were committed. :func:`shoal.worker.transfer.catch_up_state`, called first thing in every new
    generation, copies the state of the member with the most committed steps to the others,
    which closes that gap.

Wire format of the all-reduce
    One flat bucket (float32, or float64 when a parameter is float64) holding every trainable
    parameter's gradient in ``model.parameters()`` order, then the local loss sum and the local
    sample count; plus one int64 tensor with this rank's newest seen generation, reduced with
    MAX (a second, 8-byte all-reduce: SUM and MAX cannot share one collective).

State transfer between members (broadcast, catch-up and their encoding) lives in
:mod:`shoal.worker.transfer`; this module is the step only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from shoal.events.models import finite_metrics
from shoal.worker import process_group as pg
from shoal.worker.errors import CollectiveFailed, InconsistentStep, StepAborted, UserCodeError, raised_at
from shoal.worker.userapi import TrainingSetup

log = logging.getLogger("shoal.worker")


@dataclass(frozen=True)
class StepResult:
    """What one committed step produced (identical on every rank except the local fields)."""

    loss: float  #: global mean loss: sum of per-sample losses / count
    loss_sum: float
    count: int  #: samples in the global batch
    local_count: int  #: samples this rank processed
    max_generation: int  #: newest generation any rank had seen when the step committed
    compute_seconds: float  #: forward + backward of the local slice
    comm_seconds: float  #: the collectives


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


class StepEngine:
    """Runs world-size-invariant, atomic training steps for one model/optimizer.

    Build it once per worker process (it survives generation changes: it always uses the
    current process group of :mod:`shoal.worker.process_group`). ``device`` defaults to the current
    group's device, or CPU. The model is moved to ``device`` here, before any optimizer state
    exists. ``require_group=False`` allows a purely local run (no collectives) when no
    process group is joined - for tests and single-process use; with the default ``True``,
    stepping outside a group raises StepAborted.

    Exactly one of ``loss_fn`` (``loss_fn(outputs, targets)`` = SUM of per-sample losses, the
    batch being ``(inputs, targets)``) and ``step_fn`` (``step_fn(model, batch)`` = that sum)
    must be given.
    """

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
        device: torch.device | str | None = None,
        require_group: bool = True,
    ) -> None:
        if (loss_fn is None) == (step_fn is None):
            raise ValueError("give exactly one of loss_fn and step_fn")
        if micro_batch is not None and micro_batch <= 0:
            raise ValueError(f"micro_batch must be positive, got {micro_batch}")
        if device is None:
            group = pg.current_group()
            device = group.device if group else pg.device_for(pg.default_backend())
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.optimizer = optimizer
        self.dataset = dataset
        self.loss_fn = loss_fn
        self.step_fn = step_fn
        self.lr_scheduler = lr_scheduler
        self.collate_fn = collate_fn or default_collate
        self.micro_batch = micro_batch
        self.require_group = require_group
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        wide = any(p.dtype == torch.float64 for p in self.params)
        self.bucket_dtype = torch.float64 if wide else torch.float32
        self._numel = sum(p.numel() for p in self.params)
        self._bucket, self._views = self._new_bucket()
        self._before_update: list[Callable[[], None]] = []
        #: Called in every step once its collectives succeeded, right before anything is
        #: applied; raising StepAborted there rolls the step back like a failed collective
        #: (the training worker's fence: a member the coordinator evicted commits nothing).
        self.commit_guard: Callable[[], None] | None = None
        #: Called when this step's own work (data, forward, backward) is done and it is about
        #: to wait on its peers (the training worker's progress report: a slow peer is
        #: waited for, a step stuck in its own work is the one to evict).
        self.before_collectives: Callable[[], None] | None = None

    def _new_bucket(self) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """One persistent bucket and each parameter's view of it: gradients of bucket-dtype
        parameters live in the views, so backward accumulates straight into what is
        all-reduced (no flatten/unflatten copy). Made anew after an aborted collective, which
        may still write into the old one."""
        bucket = torch.zeros(self._numel + 3, dtype=self.bucket_dtype, device=self.device)
        views: list[torch.Tensor | None] = []
        offset = 0
        for p in self.params:
            n = p.numel()
            views.append(bucket[offset : offset + n].view_as(p) if p.dtype == self.bucket_dtype else None)
            offset += n
        return bucket, views

    def before_update(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once in the next :meth:`step`, once its collectives are over and before
        anything is applied or rolled back (whether the step commits or aborts) - e.g. to wait
        for a thread still reading the parameters, which do not change before that point."""
        self._before_update.append(fn)

    def _settle(self) -> None:
        while self._before_update:
            self._before_update.pop(0)()

    @classmethod
    def from_setup(
        cls,
        setup: TrainingSetup,
        *,
        device: torch.device | str | None = None,
        require_group: bool = True,
    ) -> "StepEngine":
        """An engine for a validated :class:`~worker.userapi.TrainingSetup`."""
        return cls(
            setup.model,
            setup.optimizer,
            setup.dataset,
            loss_fn=setup.loss_fn,
            step_fn=setup.step_fn,
            lr_scheduler=setup.lr_scheduler,
            collate_fn=setup.collate_fn,
            micro_batch=setup.micro_batch,
            device=device,
            require_group=require_group,
        )

    # --- the step -------------------------------------------------------------------------
    def step(
        self,
        local_indices: Sequence[int] | np.ndarray,
        global_count: int,
        generation: int,
        *,
        base_generation: int | None = None,
    ) -> StepResult:
        """Train on this rank's ``local_indices`` of a global batch of ``global_count`` samples.

        Every rank of the current group must call it for the same step (same cursor) with its
        own slice; ``generation`` is the newest generation this rank has seen (the returned
        ``max_generation`` is the maximum over ranks). With ``base_generation`` (the group's
        own generation) the step uses ONE collective: the bucket carries how far each rank's
        seen generation is ahead of the base, and ``max_generation`` is then only known to be
        ``base + 1`` when any rank saw a newer one (the caller reads the newest table itself). Returns after the optimizer stepped on
        this rank (the step is committed: advance the cursor by ``global_count``).

        Raises StepAborted (nothing applied; redo in the next generation) when a collective
        fails, no group is joined (with ``require_group``) or :attr:`commit_guard` refuses;
        InconsistentStep (a StepAborted) when the ranks' slices do not add up to ``global_count``; UserCodeError when the
        user's dataset/model/loss raised (nothing applied either) - or when the optimizer or
        LR scheduler raised after the collectives, in which case the step may be partly
        applied: treat it as fatal for this worker.
        """
        if global_count <= 0:
            raise ValueError(f"global_count must be positive, got {global_count}")
        local = [int(i) for i in local_indices]
        if len(local) > global_count:
            raise ValueError(f"local slice of {len(local)} samples exceeds the global batch {global_count}")
        distributed = dist.is_initialized()
        if not distributed and self.require_group:
            raise StepAborted("step: not in a process group (join_group first)")

        buffers = [b.detach().clone() for b in self.model.buffers()]
        self._attach_grads()
        t0 = time.perf_counter()
        try:
            local_sum = self._forward_backward(local)
        except Exception as exc:  # noqa: BLE001 - user code; translated
            self._settle()
            self._rollback(buffers)
            raise UserCodeError(f"training step raised {type(exc).__name__}: {exc} (at {raised_at(exc)})") from exc
        t1 = time.perf_counter()

        bucket = self._flatten_grads(local_sum, len(local))
        gen = torch.tensor([generation], dtype=torch.int64, device=self.device)
        one_collective = base_generation is not None
        if one_collective:
            bucket[-3] = float(max(0, generation - base_generation))
        if self.before_collectives is not None:
            self.before_collectives()
        if distributed:
            try:
                if not one_collective:
                    pg.all_reduce(gen, dist.ReduceOp.MAX)
                pg.all_reduce(bucket, dist.ReduceOp.SUM)
            except CollectiveFailed as exc:
                self._settle()
                self._rollback(buffers)
                if pg.aborted():  # the abandoned collective may still write into the bucket
                    self._bucket, self._views = self._new_bucket()
                raise StepAborted(f"step aborted, nothing applied: {exc}") from exc
        t2 = time.perf_counter()
        self._settle()

        if one_collective:
            ahead = float(bucket[-3]) > 0 if distributed else generation > base_generation
            gen.fill_(base_generation + 1 if ahead else base_generation)
        loss_sum = float(bucket[-2])
        reduced_count = int(round(float(bucket[-1])))
        if reduced_count != global_count:
            self._rollback(buffers)
            raise InconsistentStep(
                f"ranks processed {reduced_count} samples, expected a global batch of {global_count}: "
                "shard tables or cursors differ between ranks"
            )
        if self.commit_guard is not None:
            try:
                self.commit_guard()
            except StepAborted:
                self._rollback(buffers)
                raise
        self._unflatten_grads(bucket, global_count)
        try:
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        except Exception as exc:  # noqa: BLE001 - user optimizer/scheduler
            raise UserCodeError(f"optimizer step raised {type(exc).__name__}: {exc} (at {raised_at(exc)})") from exc
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        return StepResult(
            loss=loss_sum / global_count,
            loss_sum=loss_sum,
            count=global_count,
            local_count=len(local),
            max_generation=int(gen.item()),
            compute_seconds=t1 - t0,
            comm_seconds=t2 - t1,
        )

    def _forward_backward(self, local: list[int]) -> float:
        self.model.train()
        total = 0.0
        mb = self.micro_batch or max(1, len(local))
        for start in range(0, len(local), mb):
            batch = self.fetch_batch(local[start : start + mb])
            if self.step_fn is not None:
                loss = self.step_fn(self.model, batch)
            else:
                inputs, targets = batch
                loss = self.loss_fn(self.model(inputs), targets)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError(
                    "the loss must be a scalar tensor: the SUM of per-sample losses (reduction='sum')"
                )
            loss.backward()
            total += float(loss.detach())
        return total

    def fetch_batch(self, indices: list[int]) -> Any:
        """The collated batch of dataset ``indices`` (one micro-batch of this rank's slice),
        on the engine's device: the one place the engine reads the dataset."""
        batch = self.collate_fn([self.dataset[i] for i in indices])
        if self.device.type != "cpu":
            batch = _to_device(batch, self.device)
        return batch

    def _attach_grads(self) -> None:
        """Zero the bucket and make each bucket-dtype parameter's ``.grad`` a view of it."""
        self._bucket.zero_()
        for p, view in zip(self.params, self._views):
            p.grad = view  # None for parameters of another dtype: they accumulate on their own

    def _flatten_grads(self, local_sum: float, local_count: int) -> torch.Tensor:
        bucket = self._bucket
        offset = 0
        for p, view in zip(self.params, self._views):
            n = p.numel()
            if p.grad is None:
                bucket[offset : offset + n].zero_()
            elif view is None or p.grad.data_ptr() != view.data_ptr():
                bucket[offset : offset + n].copy_(p.grad.reshape(-1))  # user code replaced .grad
            offset += n
        bucket[-3] = 0.0
        bucket[-2] = local_sum
        bucket[-1] = local_count
        return bucket

    def _unflatten_grads(self, bucket: torch.Tensor, count: int) -> None:
        bucket[: self._numel].div_(count)
        offset = 0
        for p, view in zip(self.params, self._views):
            n = p.numel()
            if view is not None:
                p.grad = view
            else:
                p.grad = bucket[offset : offset + n].view_as(p).to(p.dtype).clone()
            offset += n

    def _rollback(self, buffers: list[torch.Tensor]) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in zip(self.model.buffers(), buffers):
                b.copy_(saved)

    # --- eval -----------------------------------------------------------------------------
    def evaluate(self, eval_fn: Callable[[torch.nn.Module], dict[str, float]]) -> dict[str, float]:
        """Run ``eval_fn(model)`` in eval mode without gradients, then back in train mode;
        UserCodeError (naming the file and line) if it raises. Returns the metrics a report
        can carry (:func:`~shoal.events.models.finite_metrics`): a value that is not a finite
        number (NaN, a string), a bad name or one metric too many is left out with a warning,
        never failing the job. Nothing here changes the parameters or any RNG."""
        self.model.eval()
        try:
            with torch.no_grad():
                raw = eval_fn(self.model)
        except Exception as exc:  # noqa: BLE001 - user code
            raise UserCodeError(f"eval_fn raised {type(exc).__name__}: {exc} (at {raised_at(exc)})") from exc
        finally:
            self.model.train()
        metrics, dropped = finite_metrics(raw)
        for why in dropped:
            log.warning("eval_fn's result: %s: left out", why)
        return metrics
