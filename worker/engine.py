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
    were committed. :func:`resync_state`, called first thing in every new generation, copies the
    state of the member with the most committed steps to all others, which closes that gap.

Wire format of the all-reduce
    One flat bucket (float32, or float64 when a parameter is float64) holding every trainable
    parameter's gradient in ``model.parameters()`` order, then the local loss sum and the local
    sample count; plus one int64 tensor with this rank's newest seen generation, reduced with
    MAX (a second, 8-byte all-reduce: SUM and MAX cannot share one collective).

State transfer
    :func:`broadcast_state` sends model weights and buffers, optimizer state, LR scheduler state
    and a JSON-able ``extra`` dict (step, cursor, ...) from one rank to all: a JSON header (as a
    uint8 tensor) describing the structure, then one flat buffer per dtype. No pickle.
    :func:`catch_up_state` (what a generation switch uses) sends the same header point to
    point, from the most advanced member to the members that are behind only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from shoal.worker import process_group as pg
from shoal.worker.errors import (
    CollectiveFailed,
    InconsistentStep,
    StateMismatch,
    StepAborted,
    UserCodeError,
)
from shoal.worker.userapi import TrainingSetup

log = logging.getLogger(__name__)


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
        # one persistent bucket; gradients of bucket-dtype parameters live in views of it,
        # so backward accumulates straight into what is all-reduced (no flatten/unflatten copy)
        self._bucket = torch.zeros(self._numel + 3, dtype=self.bucket_dtype, device=self.device)
        self._views: list[torch.Tensor | None] = []
        offset = 0
        for p in self.params:
            n = p.numel()
            self._views.append(self._bucket[offset : offset + n].view_as(p) if p.dtype == self.bucket_dtype else None)
            offset += n
        self._before_update: list[Callable[[], None]] = []
        #: Called in every step once its collectives succeeded, right before anything is
        #: applied; raising StepAborted there rolls the step back like a failed collective
        #: (the training worker's fence: a member the coordinator evicted commits nothing).
        self.commit_guard: Callable[[], None] | None = None

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
            raise UserCodeError(f"training step raised {type(exc).__name__}: {exc}") from exc
        t1 = time.perf_counter()

        bucket = self._flatten_grads(local_sum, len(local))
        gen = torch.tensor([generation], dtype=torch.int64, device=self.device)
        one_collective = base_generation is not None
        if one_collective:
            bucket[-3] = float(max(0, generation - base_generation))
        if distributed:
            try:
                if not one_collective:
                    pg.all_reduce(gen, dist.ReduceOp.MAX)
                pg.all_reduce(bucket, dist.ReduceOp.SUM)
            except CollectiveFailed as exc:
                self._settle()
                self._rollback(buffers)
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
            raise UserCodeError(f"optimizer step raised {type(exc).__name__}: {exc}") from exc
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
            chunk = local[start : start + mb]
            batch = self.collate_fn([self.dataset[i] for i in chunk])
            if self.device.type != "cpu":
                batch = _to_device(batch, self.device)
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
        """Run ``eval_fn(model)`` in eval mode without gradients; UserCodeError if it raises."""
        self.model.eval()
        try:
            with torch.no_grad():
                metrics = eval_fn(self.model)
        except Exception as exc:  # noqa: BLE001 - user code
            raise UserCodeError(f"eval_fn raised {type(exc).__name__}: {exc}") from exc
        finally:
            self.model.train()
        return {str(k): float(v) for k, v in dict(metrics).items()}


# --- state transfer ----------------------------------------------------------------------------
_T = "__tensor__"
_TUPLE = "__tuple__"
_DICT = "__dict__"


def _encode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """JSON-able form of ``obj`` with tensors replaced by references into ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return {_T: len(tensors) - 1}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(o, tensors) for o in obj]}
    if isinstance(obj, list):
        return [_encode(o, tensors) for o in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in (_T, _TUPLE, _DICT) for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {_DICT: [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    raise TypeError(f"cannot send a {type(obj).__name__} in a state broadcast (JSON types and tensors only)")


def _decode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(o, tensors) for o in obj]
    if isinstance(obj, dict):
        if len(obj) == 1 and _T in obj:
            return tensors[obj[_T]]
        if len(obj) == 1 and _TUPLE in obj:
            return tuple(_decode(o, tensors) for o in obj[_TUPLE])
        if len(obj) == 1 and _DICT in obj:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in obj[_DICT]}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    return obj


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise StateMismatch(f"unknown dtype {name!r} in a state broadcast")
    return dt


def _structure(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": [[k, str(v.dtype), list(v.shape)] for k, v in model.state_dict().items()],
        "groups": [len(g["params"]) for g in optimizer.param_groups],
    }


def broadcast_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None,
    src: int,
    *,
    lr_scheduler: Any | None = None,
) -> dict[str, Any]:
    """Make every rank's model, optimizer (and LR scheduler) state equal to rank ``src``'s.

    Collective: every rank of the current group calls it with the same ``src``. On ``src``,
    ``extra`` is a dict of JSON types and tensors (step, cursor, ...) sent along; on the others
    it is ignored. Returns ``src``'s ``extra`` on every rank. Model parameters and buffers are
    overwritten in place (the optimizer's references stay valid); optimizer and scheduler
    state are replaced with ``load_state_dict``.

    Raises StateMismatch on every rank when some receiver's model or optimizer differs in
    structure from ``src``'s (names, dtypes, shapes, parameter groups) or ``src``'s state
    cannot be encoded (nothing is changed anywhere); CollectiveFailed when a peer fails.
    """
    rank, world = pg.world()
    group = pg.current_group()
    comm = group.device if group else torch.device("cpu")
    if world == 1:
        return dict(extra or {})

    # 1. header: JSON structure + references to tensors
    tensors: list[torch.Tensor] = []
    payload = b""
    error = ""
    if rank == src:
        try:
            header = {
                "structure": _structure(model, optimizer),
                "model": _encode(dict(model.state_dict()), tensors),
                "optimizer": _encode(optimizer.state_dict(), tensors),
                "scheduler": _encode(lr_scheduler.state_dict(), tensors) if lr_scheduler is not None else None,
                "extra": _encode(dict(extra or {}), tensors),
            }
            header["tensors"] = [[str(t.dtype), list(t.shape), t.device.type] for t in tensors]
            payload = json.dumps(header, allow_nan=True).encode()
        except (TypeError, ValueError) as exc:
            error = f"rank {src} cannot encode its state: {exc}"
            payload = b""
    size = torch.tensor([len(payload) if not error else -1], dtype=torch.int64, device=comm)
    pg.broadcast(size, src)
    if int(size) < 0:
        raise StateMismatch(error or f"rank {src} could not encode its state")
    buf = torch.zeros(int(size), dtype=torch.uint8, device=comm)
    if rank == src:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    pg.broadcast(buf, src)
    header = json.loads(bytes(buf.cpu().numpy().tobytes()).decode())

    # 2. every rank checks it can take the state; all agree before any tensor moves
    mine = _structure(model, optimizer)
    problem = "" if mine == header["structure"] else _describe_mismatch(mine, header["structure"])
    flag = torch.tensor([1 if problem else 0], dtype=torch.int64, device=comm)
    pg.all_reduce(flag, dist.ReduceOp.MAX)
    if int(flag):
        raise StateMismatch(
            f"state broadcast from rank {src} refused: " + (problem or "another rank's model differs")
        )

    # 3. tensors: one flat buffer per dtype
    specs = header["tensors"]
    if rank != src:
        tensors = [torch.empty(shape, dtype=_dtype(dt)) for dt, shape, _ in specs]
    received = _broadcast_tensors(tensors, src, comm, rank)

    if rank != src:
        local_dev = group.device if group else torch.device("cpu")
        placed = [
            t.to(local_dev if devtype != "cpu" else torch.device("cpu"))
            for t, (_, _, devtype) in zip(received, specs)
        ]
        return _load_received(model, optimizer, lr_scheduler, header, placed)
    return _decode(header["extra"], tensors)


def _describe_mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    if mine["groups"] != theirs["groups"]:
        return f"optimizer parameter groups differ: {mine['groups']} here vs {theirs['groups']}"
    a = {k: (d, s) for k, d, s in mine["model"]}
    b = {k: (d, s) for k, d, s in theirs["model"]}
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            return f"model entry {k!r}: {a.get(k)} here vs {b.get(k)} at the source"
    return "model state order differs"


def _broadcast_tensors(
    tensors: list[torch.Tensor], src: int, comm: torch.device, rank: int
) -> list[torch.Tensor]:
    """Broadcast ``tensors`` (filled on ``src``, correctly shaped everywhere) as one flat
    buffer per dtype; returns the received tensors (on CPU unless ``comm`` is a GPU)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    out: list[torch.Tensor] = list(tensors)
    for dtype, idxs in by_dtype.items():
        wire = torch.uint8 if dtype == torch.bool else dtype
        total = sum(tensors[i].numel() for i in idxs)
        if rank == src:
            flat = torch.cat([tensors[i].reshape(-1).to(comm, wire) for i in idxs]) if total else torch.empty(0, dtype=wire, device=comm)
        else:
            flat = torch.empty(total, dtype=wire, device=comm)
        if total:
            pg.broadcast(flat, src)
        offset = 0
        for i in idxs:
            n = tensors[i].numel()
            out[i] = flat[offset : offset + n].reshape(tensors[i].shape).to(dtype).clone()
            offset += n
    return out


def resync_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None,
    committed_step: int,
    *,
    lr_scheduler: Any | None = None,
) -> tuple[int, dict[str, Any]]:
    """Start a generation from the most advanced member's state. Collective.

    Every rank passes the number of steps it has committed (``-1`` for a fresh joiner with no
    state; workers that built the initial model from the seed pass ``0``); the rank with the
    highest count (lowest rank on ties) broadcasts its model,
    optimizer, scheduler and ``extra`` (which should hold at least the step and the cursor) to
    all others with :func:`broadcast_state`. Returns ``(src, extra of src)``: every rank then
    continues from ``extra``'s step and cursor. Errors as :func:`broadcast_state`.
    """
    rank, world = pg.world()
    if committed_step < -1:
        raise ValueError(f"committed_step must be >= -1, got {committed_step}")
    if world == 1:
        return 0, dict(extra or {})
    group = pg.current_group()
    comm = group.device if group else torch.device("cpu")
    # encode (steps, lowest rank) in one MAX: larger step wins, then the smaller rank
    key = torch.tensor([(committed_step + 1) * world + (world - 1 - rank)], dtype=torch.int64, device=comm)
    pg.all_reduce(key, dist.ReduceOp.MAX)
    src = world - 1 - int(key) % world
    return src, broadcast_state(model, optimizer, extra, src, lr_scheduler=lr_scheduler)


def _fingerprint(structure: dict[str, Any]) -> int:
    """A signed 64-bit hash of :func:`_structure`'s result (equal structures, equal numbers)."""
    return int.from_bytes(hashlib.sha256(json.dumps(structure).encode()).digest()[:8], "big", signed=True)


def _wire(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype


def catch_up_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None,
    committed_step: int,
    *,
    lr_scheduler: Any | None = None,
) -> tuple[int, dict[str, Any], list[int]]:
    """Start a generation from the most advanced member's state, moving it only where needed.

    Collective: every rank of the current group calls it first thing in a generation with its
    number of committed steps (``-1``: a joiner with no state). One 16-byte-per-rank SUM
    all-reduce gathers every rank's step count and a fingerprint of its model/optimizer
    structure; every rank derives the same plan from it:

    * ``src``: the lowest rank with the most committed steps; ``behind``: the ranks with fewer;
    * nobody behind (the usual case after a failure or a leave): nothing moves;
    * structures differ: :func:`broadcast_state` runs, which raises StateMismatch on every rank
      (naming the difference) before any tensor moves;
    * otherwise ``src`` posts its state point to point to each rank behind (the
      :func:`broadcast_state` header, then each tensor as a message; weights and optimizer
      state without a copy) and returns at once (:func:`shoal.worker.process_group.isend`; the
      next all-reduce reaps the sends); each rank behind receives everything, then loads
      it, before returning. The other ranks take no part - their state equals ``src``'s -
      and go on to their next step, whose all-reduce waits for the ranks behind.

    Returns ``(src, extra, behind)``: ``extra`` is ``src``'s (received on the ranks behind,
    the caller's own elsewhere). Raises StateMismatch as above (or on ``src`` and the ranks
    behind when ``src`` cannot encode its state), CollectiveFailed when a peer fails.
    """
    rank, world = pg.world()
    if committed_step < -1:
        raise ValueError(f"committed_step must be >= -1, got {committed_step}")
    if world == 1:
        return 0, dict(extra or {}), []
    group = pg.current_group()
    comm = group.device if group else torch.device("cpu")
    mine = _structure(model, optimizer)
    table = torch.zeros(world, 2, dtype=torch.int64, device=comm)
    table[rank, 0] = committed_step
    table[rank, 1] = _fingerprint(mine)
    pg.all_reduce(table, dist.ReduceOp.SUM)
    steps = [int(v) for v in table[:, 0].tolist()]
    fingerprints = set(table[:, 1].tolist())
    top = max(steps)
    src = steps.index(top)
    if len(fingerprints) > 1:
        return src, broadcast_state(model, optimizer, extra, src, lr_scheduler=lr_scheduler), [r for r in range(world) if r != src]
    behind = [r for r, s in enumerate(steps) if s < top]
    if rank == src and behind:
        _send_state(model, optimizer, extra, lr_scheduler, behind, comm)
    elif rank in behind:
        return src, _recv_state(model, optimizer, lr_scheduler, src, mine, comm), behind
    return src, dict(extra or {}), behind


def _send_state(model, optimizer, extra, lr_scheduler, dsts: list[int], comm: torch.device) -> None:
    """Post ``src``'s state to ``dsts``: the header length, the header, then every tensor as its
    own message. Parameters and optimizer state go as they are (no copy): they change only in
    ``optimizer.step``, i.e. after the next all-reduce, which cannot complete before every
    receiver has taken all of them. Everything else (buffers, which a forward pass updates;
    scheduler state; extra) is copied first."""
    tensors: list[torch.Tensor] = []
    error = ""
    try:
        header = {"structure": _structure(model, optimizer), "model": _encode(dict(model.state_dict()), tensors)}
        params = {(p.data_ptr(), p.numel()) for p in model.parameters()}
        stable = [(t.data_ptr(), t.numel()) in params for t in tensors]  # weights, not buffers
        header["optimizer"] = _encode(optimizer.state_dict(), tensors)
        stable += [True] * (len(tensors) - len(stable))
        header["scheduler"] = _encode(lr_scheduler.state_dict(), tensors) if lr_scheduler is not None else None
        header["extra"] = _encode(dict(extra or {}), tensors)
        stable += [False] * (len(tensors) - len(stable))
        header["tensors"] = [[str(t.dtype), list(t.shape), t.device.type] for t in tensors]
        payload = json.dumps(header, allow_nan=True).encode()
    except (TypeError, ValueError) as exc:
        error = f"rank {pg.world()[0]} cannot encode its state: {exc}"
        payload = b""
    size = torch.tensor([-1 if error else len(payload)], dtype=torch.int64, device=comm)
    wire: list[torch.Tensor] = []
    if not error:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(comm)
        for t, keep in zip(tensors, stable):
            if t.numel() == 0:
                continue
            w = t.to(comm, _wire(t.dtype)).contiguous()
            wire.append(w if keep or w.data_ptr() != t.data_ptr() else w.clone())
    # posted, not waited for (the caller goes on training at once); the next all-reduce reaps
    # the sends, since each receiver takes everything before it joins that all-reduce
    for dst in dsts:
        pg.isend(size, dst)
        if error:
            continue
        pg.isend(buf, dst)
        for w in wire:
            pg.isend(w, dst)
    if error:
        pg.wait_sends()  # the receivers got the -1 and raise too
        raise StateMismatch(error)


def _recv_state(model, optimizer, lr_scheduler, src: int, mine: dict[str, Any], comm: torch.device) -> dict[str, Any]:
    """Receive what :func:`_send_state` posts into fresh tensors, then load it (nothing is
    changed before everything has arrived)."""
    size = torch.zeros(1, dtype=torch.int64, device=comm)
    pg.recv(size, src)
    if int(size) < 0:
        raise StateMismatch(f"rank {src} could not encode its state")
    buf = torch.empty(int(size), dtype=torch.uint8, device=comm)
    pg.recv(buf, src)
    header = json.loads(bytes(buf.cpu().numpy().tobytes()).decode())
    if header["structure"] != mine:  # the fingerprints matched: only a hash collision gets here
        raise StateMismatch(f"state from rank {src} refused: {_describe_mismatch(mine, header['structure'])}")
    specs = header["tensors"]
    wire = [torch.empty(shape, dtype=_wire(_dtype(dt)), device=comm) for dt, shape, _ in specs]
    pg.recv_many([w for w in wire if w.numel()], src)
    placed = [
        w.to(_dtype(dt)).to(comm if devtype != "cpu" else torch.device("cpu"))
        for w, (dt, _, devtype) in zip(wire, specs)
    ]
    return _load_received(model, optimizer, lr_scheduler, header, placed)


def _load_received(model, optimizer, lr_scheduler, header: dict, placed: list) -> dict:
    """Copy a received state (header + tensors placed on this rank's devices) into the model
    in place (the optimizer's parameter references stay valid), the optimizer and the
    scheduler; returns the sender's ``extra``."""
    model_state = _decode(header["model"], placed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(model_state[name])
    optimizer.load_state_dict(_decode(header["optimizer"], placed))
    if lr_scheduler is not None and header["scheduler"] is not None:
        lr_scheduler.load_state_dict(_decode(header["scheduler"], placed))
    return _decode(header["extra"], placed)
