"""One training step that does not depend on the world size, and is applied all-or-nothing.

World-size invariance
    For a global batch ``G`` of ``n`` samples the runtime wants the gradient of the *mean* loss,
    ``(1/n) * sum_{i in G} grad l_i``. Each rank computes the **sum** of the per-sample losses of
    its slice (``loss_fn`` with ``reduction="sum"``) and backpropagates it, accumulating over
    micro-batches when the slice is larger than ``micro_batch``. The per-rank gradient sums are
    added by all-reduces (SUM) and divided by ``n``, the actual size of the global batch.
    So the update is the same for 1 or 16 workers, up to the order of float additions; a rank
    with an empty slice contributes zeros. (Dropout and BatchNorm statistics break this.)
    Gradient clipping (``max_grad_norm``) and the fp16 overflow check work on that reduced,
    divided gradient, identical on every rank: they are world-size invariant too.

Overlap (:mod:`shoal.worker.reducer`)
    As DDP's reducer does, the gradient is reduced in buckets while backward still runs: the
    engine's :class:`~shoal.worker.reducer.GradientReducer` holds the buckets (each
    parameter's ``.grad`` is a view of its bucket), their hooks and their all-reduces, launched
    in index order during the backward of the **last** micro-batch (earlier ones just
    accumulate), so every rank starts the same collectives in the same order. This module is
    the transaction around it: forward and backward, the checks on the reduced values, the
    update or the rollback. In a group, a parameter whose gradient arrives a second time in
    one backward after its bucket was launched (reentrant checkpointing of shared weights)
    fails the step as a UserCodeError.

Atomicity
    A step either commits on every rank or on none that the next generation keeps:

    * nothing is applied before every collective of the step has succeeded;
    * if a collective raises (a peer died or hung past the collective timeout, or the group was
      aborted - also while backward is still running), the gradients are dropped, module
      buffers (e.g. BatchNorm running stats) are restored to their values before the step, the
      optimizer, LR scheduler and loss scale are not stepped, the collectives still in flight
      are abandoned with freshly allocated buckets in their place (they may still write into
      the old ones), and :class:`~worker.errors.StepAborted` is raised - the caller redoes the
      step, same cursor, in the next generation;
    * every rank sees the same all-reduced values, so decisions taken on them (the sample
      count check -> :class:`~worker.errors.InconsistentStep`, the newest generation, the fp16
      overflow skip, the clipping factor) are the same everywhere.

    A collective can still complete on some ranks and fail on others (a peer dying during the
    last exchange of a ring all-reduce). A rank that completed holds the *full* reduced
    gradient, so its committed step is correct; the ranks disagree only on how many steps
    were committed. :func:`shoal.worker.transfer.catch_up_state`, called first thing in every new
    generation, copies the state of the member with the most committed steps to the others,
    which closes that gap.

Mixed precision (:mod:`shoal.worker.precision`)
    ``bf16``/``fp16`` run forward and loss under autocast; parameters, gradients and buckets
    stay float32. ``fp16`` backpropagates the local loss sum times ``scale / n`` - the scaled
    *mean* loss of the global batch, what ``torch.amp.GradScaler`` scales in DDP - and divides
    the reduced gradient by the scale. A reduced gradient that is not finite is an **overflow step**,
    the same on every rank: the optimizer does not step, the scale halves, and the step still
    *commits* - its samples are consumed, the cursor advances and the LR scheduler steps - as
    with DDP and ``torch.amp.GradScaler``. ``StepResult.skipped`` tells. The loss scale is
    replicated state: :meth:`StepEngine.state_extras` travels with the model in state
    transfers and checkpoints.

One host sync per step
    The loss sum is accumulated on the device, the trailing values are written by fills
    (never a copy from a host scalar) and batches move to the device with non-blocking copies,
    so on a GPU the one host sync of a step is after its collectives: one read of the trailing
    values with the gradient norm (the loss, the sample count and the overflow/clipping
    decision together), plus the generation in the two-collective form. None per micro-batch
    (``tests/processes/test_engine_overlap.py`` counts them with
    ``torch.cuda.set_sync_debug_mode``).

Wire format of the all-reduces
    The buckets (float32, or float64 when a parameter is float64), each one collective (SUM),
    launched in index order. The last bucket - the first-registered parameters, whose
    gradients come last - carries three trailing values: how far this rank's newest seen
    generation is ahead of the group's (``base_generation``), the local loss sum, the local
    sample count. Without ``base_generation``, one int64 tensor with this rank's newest seen
    generation is reduced with MAX first (SUM and MAX cannot share one collective).

State transfer between members (broadcast, catch-up and their encoding) lives in
:mod:`shoal.worker.transfer`; this module is the step only.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from shoal.events.models import finite_metrics
from shoal.worker import process_group as pg
from shoal.worker.errors import CollectiveFailed, InconsistentStep, StepAborted, UserCodeError, raised_at
from shoal.worker.precision import LossScale, autocast, check_precision
from shoal.worker.reducer import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_BYTES, GradientReducer, plan_buckets
from shoal.worker.steal import StepShares, parts as claimed_parts
from shoal.worker.userapi import TrainingSetup

log = logging.getLogger("shoal.worker")

__all__ = ["DEFAULT_BUCKET_CAP_MB", "FIRST_BUCKET_BYTES", "StepEngine", "StepResult", "plan_buckets"]

_TAIL = 6  # ranks, table sum, table square sum, ahead, loss sum, count: the trailing values of the last bucket
#: The table check's modulus: each rank adds ``base_generation % TABLE_MOD`` and its square
#: (exact in float32 sums up to about 17,000 ranks).
TABLE_MOD = 32


@dataclass(frozen=True)
class StepResult:
    """What one committed step produced (identical on every rank except the local fields:
    ``local_count`` and the timings, which are this rank's host time)."""

    loss: float  #: global mean loss: sum of per-sample losses / count
    loss_sum: float
    count: int  #: samples in the global batch
    local_count: int  #: samples this rank processed
    max_generation: int  #: newest generation any rank had seen when the step committed
    compute_seconds: float  #: data, forward and backward of the local slice
    #: from the first collective's launch until the last one completed (communication time,
    #: hidden by backward or not)
    comm_seconds: float
    #: the part of the communication NOT hidden by backward: waiting on the collectives after
    #: this rank's backward returned (a slow peer's lag counts here too)
    comm_exposed_seconds: float = 0.0
    #: an fp16 overflow step: the reduced gradient was not finite, the optimizer did not step
    #: (on every rank alike); the step still committed: advance the cursor
    skipped: bool = False
    #: L2 norm of the reduced mean gradient before clipping (computed with ``max_grad_norm``
    #: or fp16; None otherwise)
    grad_norm: float | None = None
    #: the fp16 loss scale this step used (None unless fp16)
    loss_scale: float | None = None
    #: the samples this rank trained in the step when a layout chose others than its slice
    #: (DiLoCo's first round after a failure: what a member finished before, plus its share of
    #: the samples nobody finished); None: its slice. What the ledger records.
    trained: tuple[int, ...] | None = None


def _to_device(obj: Any, device: torch.device) -> Any:
    return map_tensors(obj, lambda t: t.to(device, non_blocking=True))


class StepCommon:
    """What every step engine shares (:class:`StepEngine`, data parallel, and
    :class:`~shoal.worker.sharded_engine.ShardedEngine`, elastic HSDP) - the step's parts that
    do not depend on how the gradient is reduced: the user's objects and their checks
    (its constructor), reading a micro-batch, the loss of one (:meth:`_loss`, the one place user
    code runs in forward), the clipping factor, the optimizer and scheduler tail
    (:meth:`_update`, the one place they run), the callbacks due before an update, rolling back
    a step's gradients and buffers, and evaluating."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: Any, *,
              loss_fn: Callable[[Any, Any], torch.Tensor] | None, step_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None,
              lr_scheduler: Any | None, collate_fn: Callable[[list[Any]], Any] | None, micro_batch: int | None,
              device: torch.device | str, precision: str, max_grad_norm: float | None) -> None:
        """Check and keep the user's objects and the options every engine reads (ValueError
        naming the bad one); the model moves to ``device`` here, before any optimizer state
        exists."""
        if (loss_fn is None) == (step_fn is None):
            raise ValueError("give exactly one of loss_fn and step_fn")
        if micro_batch is not None and micro_batch <= 0:
            raise ValueError(f"micro_batch must be positive, got {micro_batch}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        self.precision = check_precision(precision)
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.optimizer = optimizer
        self.dataset = dataset
        self.loss_fn = loss_fn
        self.step_fn = step_fn
        self.lr_scheduler = lr_scheduler
        self.collate_fn = collate_fn or default_collate
        #: Where :meth:`fetch_batch` takes collated batches from instead of reading the dataset
        #: (the training worker installs its :class:`~shoal.worker.prefetch.Prefetcher`'s
        #: ``fetch``): called with a micro-batch's dataset indices, returns their collated batch
        #: on the CPU (pinned for a CUDA device); None: read and collate inline.
        self.fetcher: Callable[[list[int]], Any] | None = None
        self.micro_batch = micro_batch
        self.max_grad_norm = max_grad_norm
        self._before_update: list[Callable[[], None]] = []
        #: a compiled model's fixed micro-batch (None: not compiled; :meth:`compile_model`)
        self.compiled_shape: int | None = None
        #: Called in every step once its collectives succeeded, right before anything is
        #: applied; raising StepAborted there rolls the step back like a failed collective
        #: (the training worker's fence: a member the coordinator evicted commits nothing).
        self.commit_guard: Callable[[], None] | None = None
        #: Called when this step's own work (data, forward, backward) is done and it is about
        #: to wait on its peers (the training worker's progress report: a slow peer is
        #: waited for, a step stuck in its own work is the one to evict).
        self.before_collectives: Callable[[], None] | None = None
        #: The newest generation this process has seen now (any thread's view; None: only the
        #: ``generation`` a step is called with counts). Read when a step's tail is written,
        #: right before its last backward: a table published during the step's own work is
        #: carried by this step's all-reduce instead of the next one's (a switch one step sooner;
        #: the training worker sets it for slices by speed).
        self.newest_seen: Callable[[], int] | None = None

    def _loss(self, batch: Any, *, real: int | None = None) -> torch.Tensor:
        """The summed loss of one micro-batch (the user's ``step_fn``, or ``loss_fn`` on the
        model's output), under the engine's autocast. ``real``: the batch was padded to the
        compiled shape and only its first ``real`` samples count (the model sees them all, the
        loss only those). TypeError unless a scalar tensor."""
        with autocast(self.precision, self.device):
            if self.step_fn is not None:
                loss = self.step_fn(self.model, batch)
            else:
                inputs, targets = batch
                outputs = self.model(inputs)
                if real is not None:
                    outputs = _head(outputs, real)
                loss = self.loss_fn(outputs, targets)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError("the loss must be a scalar tensor: the SUM of per-sample losses (reduction='sum')")
        return loss

    # --- a compiled model: one shape ------------------------------------------------------------
    def compile_model(self, options: Any, modules: list[torch.nn.Module], fixed: int | None) -> None:
        """``torch.compile`` the forward of each of ``modules`` in place (the module objects and
        their parameter names stay: checkpoints and digests do not see it) with ``options``
        (:class:`~shoal.core.jobspec.CompileOptions`), and cut every rank's work into
        micro-batches of ``fixed`` samples from now on (``micro_batch`` when set)."""
        for module in modules:
            compile_forward(module, options)
        self.compiled_shape = self.micro_batch or fixed

    def _loss_of(self, part: list[int]) -> torch.Tensor:
        """:meth:`_loss` of the samples ``part``; with a compiled model and a ``loss_fn``, a part
        shorter than the compiled shape is padded to it (copies of its first sample, which the
        loss leaves out): the compiled graph never sees another shape. (A ``step_fn`` sees the
        short batch as it is: the graph for it is compiled once, on first use.)"""
        batch = self.fetch_batch(part)
        shape = self.compiled_shape
        if shape is not None and self.step_fn is None and 0 < len(part) < shape:
            inputs, targets = batch
            return self._loss((_pad(inputs, shape), targets), real=len(part))
        return self._loss(batch)

    def warm_up(self) -> float:
        """Compile before training (a joiner must not make its peers wait for its compile):
        one forward and backward on the compiled shape, from the dataset's first samples, with
        nothing kept - gradients dropped, buffers and every RNG as before. Returns its seconds
        (0: not compiled)."""
        shape = self.compiled_shape
        if shape is None:
            return 0.0
        t0 = time.perf_counter()
        buffers = [b.detach().clone() for b in self.model.buffers()]
        rng = _rng_state(self.device)
        self.model.train()
        try:
            loss = self._loss_of(list(range(min(shape, len(self.dataset)))))
            loss.float().backward()
        finally:
            self._rollback(buffers)
            _set_rng_state(rng)
        return time.perf_counter() - t0

    def _clip_coef(self, grad_norm: float | None) -> float | None:
        """The factor the reduced gradient is multiplied by (``max_grad_norm``), or None."""
        if self.max_grad_norm is None or grad_norm is None or not math.isfinite(grad_norm) \
                or grad_norm <= self.max_grad_norm:
            return None
        return self.max_grad_norm / (grad_norm + 1e-6)

    def _update(self, *, skip: bool = False) -> None:
        """Step the optimizer (unless ``skip``: an fp16 overflow) and the LR scheduler, then
        drop the gradients. UserCodeError (naming the file and line) when either raises."""
        try:
            if not skip:
                self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        except Exception as exc:  # noqa: BLE001 - user optimizer/scheduler
            raise UserCodeError(f"optimizer step raised {type(exc).__name__}: {exc} (at {raised_at(exc)})") from exc
        finally:
            self.optimizer.zero_grad(set_to_none=True)

    def before_update(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once in the next :meth:`step`, once its collectives are over and before
        anything is applied or rolled back (whether the step commits or aborts) - e.g. to wait
        for a thread still reading the parameters, which do not change before that point."""
        self._before_update.append(fn)

    def _settle(self) -> None:
        while self._before_update:
            self._before_update.pop(0)()

    def fetch_batch(self, indices: list[int]) -> Any:
        """The collated batch of dataset ``indices`` (one micro-batch of this rank's slice),
        on the engine's device: the one place the engine reads the dataset (through
        :attr:`fetcher` when one is installed)."""
        if self.fetcher is not None:
            batch = self.fetcher(indices)
        else:
            batch = self.collate_fn([self.dataset[i] for i in indices])
        if self.device.type != "cpu":
            batch = _to_device(batch, self.device)
        return batch

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict (a sharded engine gathers it: every member of its
        replica group must call this together)."""
        return self.model.state_dict()

    def _rollback(self, buffers: list[torch.Tensor]) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in zip(self.model.buffers(), buffers):
                b.copy_(saved)

    # --- eval -----------------------------------------------------------------------------
    def eval_sums(self, dataset: Any, sums_fn: Callable[[torch.nn.Module, Any], dict[str, torch.Tensor]] | None,
                  batch_size: int, part: range, passes: int) -> tuple[list[str], torch.Tensor]:
        """This rank's part of a distributed evaluation: the samples ``part`` of ``dataset``,
        in ``passes`` batches of at most ``batch_size`` (a pass with none left runs on the
        first sample and counts nothing: sharded ranks go in lock-step), each giving
        ``sums_fn(model, batch)`` (None: the summed training loss). Returns the sums' names,
        sorted, and one float64 tensor ``[samples, sum of each name...]`` on the device, to
        be all-reduced. Eval mode, no gradients; UserCodeError when the user's code raises."""
        indices = list(part)
        total: torch.Tensor | None = None
        names: list[str] = []
        self.model.eval()
        try:
            with torch.no_grad():
                for k in range(max(1, passes)):
                    chunk = indices[k * batch_size:(k + 1) * batch_size]
                    counted = bool(chunk)
                    batch = self.collate_fn([dataset[i] for i in (chunk or [0])])
                    if self.device.type != "cpu":
                        batch = _to_device(batch, self.device)
                    with autocast(self.precision, self.device):
                        sums = sums_fn(self.model, batch) if sums_fn is not None else {"loss": self._eval_loss(batch)}
                    if total is None:
                        names = sorted(sums)
                        total = torch.zeros(1 + len(names), dtype=torch.float64, device=self.device)
                    if counted:
                        total[0] += len(chunk)
                        for i, name in enumerate(names):
                            total[1 + i] += sums[name].detach().to(torch.float64)
        except Exception as exc:  # noqa: BLE001 - user code
            raise UserCodeError(f"the distributed evaluation raised {type(exc).__name__}: {exc} "
                                f"(at {raised_at(exc)})") from exc
        finally:
            self.model.train()
        return names, total

    def _eval_loss(self, batch: Any) -> torch.Tensor:
        if self.step_fn is not None:
            return self.step_fn(self.model, batch)
        inputs, targets = batch
        return self.loss_fn(self.model(inputs), targets)

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


class StepEngine(StepCommon):
    """Runs world-size-invariant, atomic training steps for one model/optimizer.

    Build it once per worker process (it survives generation changes: its owner - the data-
    parallel layout, :mod:`shoal.worker.layout_dp` - hands it each generation's group as
    :attr:`group`, and takes it back when the generation ends). ``device`` defaults to
    :func:`~shoal.worker.process_group.device_for` the default backend. The model is moved to
    ``device`` here, before any optimizer state exists. ``require_group=False`` allows a purely
    local run (no collectives) while :attr:`group` is None - for tests and single-process use;
    with the default ``True``, stepping without a group raises StepAborted.

    Exactly one of ``loss_fn`` (``loss_fn(outputs, targets)`` = SUM of per-sample losses, the
    batch being ``(inputs, targets)``) and ``step_fn`` (``step_fn(model, batch)`` = that sum)
    must be given. ``precision`` (fp32, bf16, fp16), ``max_grad_norm`` (None: no clipping) and
    ``bucket_cap_mb`` are the job spec's fields; ``overlap=False`` launches every bucket after
    backward (the same values, for comparison and benchmarks).

    The engine's :attr:`reducer` registers a post-accumulate-grad hook on every trainable
    parameter; they act only inside its own steps (:meth:`close` removes them). A UserCodeError
    raised after some buckets were launched leaves the group's collective sequence broken: the
    worker must leave the group (a user error is fatal to it anyway).
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
        precision: str = "fp32",
        max_grad_norm: float | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        overlap: bool = True,
        group: pg.Group | None = None,
    ) -> None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        super().__init__(model, optimizer, dataset, loss_fn=loss_fn, step_fn=step_fn, lr_scheduler=lr_scheduler,
                   collate_fn=collate_fn, micro_batch=micro_batch,
                   device=device if device is not None else pg.device_for(pg.default_backend()),
                   precision=precision, max_grad_norm=max_grad_norm)
        #: the group this engine's steps reduce over (None: none; see the class docstring)
        self.group: pg.Group | None = group
        self.require_group = require_group
        self.overlap = overlap
        #: the fp16 loss scale (None unless fp16): replicated state, see :meth:`state_extras`
        self.scaler: LossScale | None = LossScale() if precision == "fp16" else None
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        #: the gradient's buckets, their hooks and their all-reduces (see its contract)
        self.reducer = GradientReducer(params, self.device, bucket_cap_mb, tail=_TAIL)

    @property
    def bucket_count(self) -> int:
        """How many all-reduces carry the gradient of one step."""
        return self.reducer.bucket_count

    @property
    def find_unused(self) -> bool:
        """Whether unused parameters are looked for in the loss's autograd graph before the
        last backward (:attr:`GradientReducer.find_unused`: on once a step found some)."""
        return self.reducer.find_unused

    @find_unused.setter
    def find_unused(self, value: bool) -> None:
        self.reducer.find_unused = value

    def close(self) -> None:
        """Remove the engine's gradient hooks from the model's parameters."""
        self.reducer.close()

    def state_extras(self) -> dict[str, Any]:
        """The engine's own replicated state, beyond model, optimizer and scheduler: JSON
        values to send along with them (a state transfer's ``extra``): ``{"loss_scale":
        {...}}`` in fp16, else nothing."""
        return {"loss_scale": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_extras(self, extra: dict[str, Any]) -> None:
        """Take :meth:`state_extras` of another replica (other keys are ignored; a missing
        loss scale - a source without one - leaves this engine's as it is)."""
        if self.scaler is not None and isinstance(extra.get("loss_scale"), dict):
            self.scaler.load_state_dict(extra["loss_scale"])

    @classmethod
    def from_setup(
        cls,
        setup: TrainingSetup,
        *,
        device: torch.device | str | None = None,
        require_group: bool = True,
        precision: str = "fp32",
        max_grad_norm: float | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        overlap: bool = True,
        group: pg.Group | None = None,
    ) -> "StepEngine":
        """An engine for a validated :class:`~worker.userapi.TrainingSetup` (the keyword
        options as in the constructor; the training worker passes the job spec's)."""
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
            precision=precision,
            max_grad_norm=max_grad_norm,
            bucket_cap_mb=bucket_cap_mb,
            overlap=overlap,
            group=group,
        )

    # --- the step -------------------------------------------------------------------------
    def step(
        self,
        local_indices: Sequence[int] | np.ndarray,
        global_count: int,
        generation: int,
        *,
        base_generation: int | None = None,
        shares: StepShares | None = None,
    ) -> StepResult:
        """Train on this rank's ``local_indices`` of a global batch of ``global_count`` samples.
        With ``shares`` (the whole step's slices by rank, :mod:`shoal.worker.steal`; only in a
        group) the rank trains the chunks it claims instead - its own slice's from the front,
        then others' still untaken - and the result's ``trained`` says which samples it took.

        Every rank of the current group must call it for the same step (same cursor) with its
        own slice; ``generation`` is the newest generation this rank has seen (the returned
        ``max_generation`` is the maximum over ranks). With ``base_generation`` (the group's
        own generation, or the re-slice's whose ranges this rank trains) the step needs no
        collective besides the gradient buckets: the last
        bucket carries how far each rank's seen generation is ahead of the base, and
        ``max_generation`` is then only known to be ``base + 1`` when any rank saw a newer one
        (the caller reads the newest table itself). Returns after the optimizer stepped on
        this rank - or, for an fp16 overflow step (``skipped``), did not, on every rank alike:
        either way the step is committed (advance the cursor by ``global_count``).

        Raises StepAborted (nothing applied; redo in the next generation) when a collective
        fails, no group is joined (with ``require_group``) or :attr:`commit_guard` refuses;
        InconsistentStep (a StepAborted) when the ranks' slices do not add up to ``global_count``
        or the ranks' ``base_generation`` differ (each rank adds it mod :data:`TABLE_MOD` and its
        square to the tail: all equal iff ranks x sum of squares = sum squared, a verdict every
        rank reaches alike from the reduced values; ranks on the slices of different tables
        could otherwise add up to the count by chance); UserCodeError when the
        user's dataset/model/loss raised (nothing applied either) - or when the optimizer or
        LR scheduler raised after the collectives, in which case the step may be partly
        applied: treat it as fatal for this worker.
        """
        if global_count <= 0:
            raise ValueError(f"global_count must be positive, got {global_count}")
        local = [int(i) for i in local_indices]
        if len(local) > global_count:
            raise ValueError(f"local slice of {len(local)} samples exceeds the global batch {global_count}")
        group = self.group
        distributed = group is not None
        if not distributed and self.require_group:
            raise StepAborted("step: not in a process group (no group for this generation)")

        buffers = [b.detach().clone() for b in self.model.buffers()]
        self.reducer.begin(group)
        one_collective = base_generation is not None
        ahead = float(max(0, generation - base_generation)) if one_collective else 0.0
        # the two-collective form's MAX operand; a fill, not a copy from the host (that would
        # be a host sync on a GPU)
        gen = None if one_collective else torch.full((1,), generation, dtype=torch.int64, device=self.device)
        t0 = time.perf_counter()
        try:
            if distributed and not one_collective:  # first: the same order on every rank
                self.reducer.launch(gen, dist.ReduceOp.MAX, "all_reduce of the generation")
            trained = self._forward_backward(local, ahead, global_count, base_generation,
                                             shares if distributed else None)
        except CollectiveFailed as exc:  # the generation's launch (an aborted group), a chunk's claim
            self._abandon(buffers)
            raise StepAborted(f"step aborted, nothing applied: {exc}", local=exc.local) from exc
        except Exception as exc:  # noqa: BLE001 - user code; translated
            self._abandon(buffers)
            raise UserCodeError(f"training step raised {type(exc).__name__}: {exc} (at {raised_at(exc)})") from exc
        t1 = time.perf_counter()

        if self.before_collectives is not None:
            self.before_collectives()
        try:
            self.reducer.finish()
            self.reducer.complete()
        except CollectiveFailed as exc:
            self._abandon(buffers)
            raise StepAborted(f"step aborted, nothing applied: {exc}", local=exc.local) from exc
        except Exception as exc:  # noqa: BLE001 - a gradient after its bucket went, a bad .grad
            self._abandon(buffers)
            raise UserCodeError(f"gradient reduction failed: {exc} (at {raised_at(exc)})") from exc
        t2 = time.perf_counter()
        first = self.reducer.first_launch
        self._settle()
        result = self._apply(buffers, trained, global_count, gen, base_generation, compute_seconds=t1 - t0,
                             comm_seconds=t2 - first if first is not None else 0.0,
                             comm_exposed_seconds=t2 - t1 if distributed else 0.0)
        return result if trained is local else replace(result, trained=tuple(trained))

    def _parts(self, local: list[int], shares: StepShares | None) -> Iterator[list[int]]:
        """The step's forward/backward passes on this rank: its slice in micro-batches, or
        (``shares``) the chunks it claims in the group's store."""
        if shares is None:
            mb = self.compiled_shape or self.micro_batch or max(1, len(local))
            return (local[start : start + mb] for start in range(0, len(local), mb))
        return (part for _block, part in claimed_parts(shares, self.group.claim))

    def _forward_backward(self, local: list[int], ahead: float, global_count: int, base_generation: int | None,
                          shares: StepShares | None = None) -> list[int]:
        """Forward and backward of this rank's passes (:meth:`_parts`); the samples trained
        (``local`` itself without ``shares``)."""
        self.model.train()
        # backward of the loss sum / global count: the reduced gradient is the global batch's mean
        # with no pass over it afterwards. fp16: x the scale, as with torch.amp.GradScaler and
        # a mean loss (the sum alone would be count times larger and overflow at once); the
        # reduced gradient is divided by the scale
        factor = (self.scaler.scale if self.scaler is not None else 1.0) / global_count
        total = torch.zeros((), dtype=self.reducer.dtype, device=self.device)
        parts = self._parts(local, shares)
        trained: list[int] = local if shares is None else []
        part = next(parts, None)
        while part is not None:
            loss = self._loss_of(part)
            total += loss.detach()  # on the device: no host sync per micro-batch
            if shares is not None:
                trained += part
            after = next(parts, None)  # (a claim: before this backward, which may be the last)
            if after is None:  # the last micro-batch: its backward launches the buckets
                ahead = self._ahead_now(ahead, base_generation)
                self._write_tail(ahead, total, len(trained), base_generation)
                if self.overlap:
                    self.reducer.arm(loss)
            (loss.float() * factor).backward()
            part = after
        if not trained:  # an empty slice (nothing claimed): zeros, and the trailing values
            self._write_tail(self._ahead_now(ahead, base_generation), total, 0, base_generation)
        return trained

    def _ahead_now(self, ahead: float, base_generation: int | None) -> float:
        """``ahead``, or how far :attr:`newest_seen` is ahead of the base now if farther."""
        if base_generation is None or self.newest_seen is None:
            return ahead
        return max(ahead, float(self.newest_seen() - base_generation))

    def _write_tail(self, ahead: float, total: torch.Tensor, count: int, base_generation: int | None) -> None:
        # fills and a device-to-device copy: assigning a Python number (tail[-1] = count)
        # would copy a host scalar in, a host sync per step on a GPU
        tail = self.reducer.buckets[-1].flat
        # the table check (see _apply): this rank, and its table's generation mod TABLE_MOD
        table = (base_generation or 0) % TABLE_MOD
        tail[-6].fill_(1)
        tail[-5].fill_(table)
        tail[-4].fill_(table * table)
        tail[-3].fill_(ahead)
        tail[-2].copy_(total)
        tail[-1].fill_(count)

    def _abandon(self, buffers: list[torch.Tensor]) -> None:
        """Roll back a step that fails before it applied anything: the reducer gives up its
        collectives (:meth:`GradientReducer.abandon`: new buckets where one may still be
        written), then the :meth:`before_update` callbacks run and the gradients and buffers
        are rolled back."""
        self.reducer.abandon()
        self._settle()
        self._rollback(buffers)

    # --- after the collectives -------------------------------------------------------------
    def _apply(self, buffers: list[torch.Tensor], local: list[int], global_count: int, gen: torch.Tensor | None,
               base_generation: int | None, *, compute_seconds: float, comm_seconds: float,
               comm_exposed_seconds: float) -> StepResult:
        """Check the reduced values, unscale, clip, and step the optimizer (or skip, fp16)."""
        scale = self.scaler.scale if self.scaler is not None else None
        buckets = self.reducer.buckets
        grads = [b.grads for b in buckets]
        if scale is not None and scale != 1.0:  # backward divided by the count already: the mean
            for g in grads:
                g.div_(scale)
        tail = buckets[-1].flat[-_TAIL:]
        want_norm = scale is not None or self.max_grad_norm is not None
        if want_norm:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            values = torch.cat([tail, norm.reshape(1).to(tail.dtype)]).tolist()  # the one host read
        else:
            values = tail.tolist()
        ranks, tables, squares = values[0], values[1], values[2]
        ahead, loss_sum, reduced = values[3], values[4], int(round(values[5]))
        grad_norm = values[6] if want_norm else None
        if ranks * squares != tables * tables:  # not every rank's the same: n * sum(x^2) = sum(x)^2 iff all equal
            self._rollback(buffers)
            raise InconsistentStep(
                f"ranks trained on the slices of different shard tables (generations mod {TABLE_MOD}: "
                f"{ranks:.0f} ranks, sum {tables:.0f}, sum of squares {squares:.0f}): nothing applied")
        if reduced != global_count:
            self._rollback(buffers)
            raise InconsistentStep(
                f"ranks processed {reduced} samples, expected a global batch of {global_count}: "
                "shard tables or cursors differ between ranks"
            )
        if self.commit_guard is not None:
            try:
                self.commit_guard()
            except StepAborted:
                self._rollback(buffers)
                raise
        if base_generation is not None:  # locally, the tail holds this rank's own distance
            max_generation = base_generation + 1 if ahead > 0 else base_generation
        else:
            max_generation = int(gen.item())
        skipped = scale is not None and not math.isfinite(grad_norm)
        coef = None if skipped else self._clip_coef(grad_norm)
        if coef is not None:
            for g in grads:
                g.mul_(coef)
        if self.scaler is not None:
            self.scaler.update(found_inf=skipped)
        if skipped:
            log.info("fp16 overflow: step skipped on every rank, loss scale %g -> %g", scale, self.scaler.scale)
        self.reducer.unflatten_grads()
        self._update(skip=skipped)
        return StepResult(
            loss=loss_sum / global_count,
            loss_sum=loss_sum,
            count=global_count,
            local_count=len(local),
            max_generation=max_generation,
            compute_seconds=compute_seconds,
            comm_seconds=comm_seconds,
            comm_exposed_seconds=comm_exposed_seconds,
            skipped=skipped,
            grad_norm=grad_norm,
            loss_scale=scale,
        )


def compile_forward(module: torch.nn.Module, options: Any) -> None:
    """``module.forward = torch.compile(module.forward, ...)``: the module object, its hooks
    and its parameter names stay as they are (a compiled ``OptimizedModule`` wrapper would
    prefix every state-dict key with ``_orig_mod.``)."""
    kwargs = {k: v for k, v in (("mode", options.mode), ("fullgraph", options.fullgraph),
                                 ("dynamic", options.dynamic)) if v is not None}
    module.forward = torch.compile(module.forward, **kwargs)


def checkpoint_forward(module: torch.nn.Module) -> None:
    """Recompute ``module``'s activations in backward instead of keeping them
    (``torch.utils.checkpoint``, non-reentrant: it composes with FSDP2 and with compile)."""
    import torch.utils.checkpoint as activation

    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return activation.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` (a tensor, or a tuple, namedtuple, list or dict of them, nested) with ``fn``
    applied to every tensor; anything else as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(o, fn) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _pad(inputs: Any, shape: int) -> Any:
    """``inputs`` (batch first) with their first sample repeated up to ``shape`` samples."""
    def pad(t: torch.Tensor) -> torch.Tensor:
        short = shape - t.shape[0]
        return torch.cat([t, t[:1].expand(short, *t.shape[1:])]) if short > 0 else t

    return map_tensors(inputs, pad)


def _head(outputs: Any, n: int) -> Any:
    """The first ``n`` samples of a model's ``outputs`` (batch first)."""
    return map_tensors(outputs, lambda t: t[:n])


def _rng_state(device: torch.device) -> tuple:
    import random

    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    import random

    py, npy, cpu, cuda = state
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
