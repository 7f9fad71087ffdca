"""What a checkpoint restores: :class:`TrainState`.

A TrainState holds the model ``state_dict``, optimizer and (optional) LR-scheduler state,
the (optional) fp16 loss-scale state, the global RNG states, and the counters that place training in time: ``step``, ``epoch``,
``data_cursor`` (any JSON value the data loader understands), ``generation`` and
``world_size``. The tensors go into torch files (one per component, see :data:`FILES`), the
counters into the manifest.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch

from shoal.storage.memcopy import copy_tensors
from shoal.storage.resume_point import ResumePoint
from shoal.storage.rng import capture_rng, restore_rng

#: Component -> file name inside a checkpoint directory. ``model.pt`` is mandatory.
FILES: dict[str, str] = {
    "model": "model.pt",
    "optimizer": "optimizer.pt",
    "scheduler": "scheduler.pt",
    "rng": "rng.pt",
    "scaler": "scaler.pt",
}


@dataclass
class TrainState(ResumePoint):
    """Everything needed to resume training at a step boundary: the counters of its
    :class:`~shoal.storage.resume_point.ResumePoint` and the state dicts.

    ``model``/``optimizer``/``scheduler`` are state dicts; ``rng`` is :func:`capture_rng`
    output; ``scaler`` is the fp16 loss scale's state (``scale``, ``growth_tracker``: see
    ``shoal.worker.precision.LossScale``), None when the job does not use one. Built by :meth:`capture` they reference live tensors: save them synchronously
    or take a :meth:`snapshot` first (the async saver does).
    """

    model: dict[str, Any]
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None

    @classmethod
    def capture(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        *,
        step: int,
        epoch: int = 0,
        data_cursor: Any = 0,
        generation: int = 0,
        world_size: int = 1,
        with_rng: bool = True,
        scaler: Any | None = None,
    ) -> TrainState:
        """State of live training objects (no copy) plus the global RNGs; ``scaler`` is an
        object with ``state_dict()`` (the fp16 loss scale) or None."""
        return cls(
            step=step,
            model=model.state_dict(),
            optimizer=optimizer.state_dict() if optimizer is not None else None,
            scheduler=scheduler.state_dict() if scheduler is not None else None,
            rng=capture_rng() if with_rng else None,
            epoch=epoch,
            data_cursor=data_cursor,
            generation=generation,
            world_size=world_size,
            scaler=scaler.state_dict() if scaler is not None else None,
        )

    def restore(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        *,
        rng: bool = True,
        scaler: Any | None = None,
    ) -> None:
        """Load the state into live objects. A component requested but absent from the
        checkpoint raises ``ValueError``; mismatched shapes/keys raise what torch raises. The
        loss scale is the exception: a ``scaler`` (object with ``load_state_dict``) takes the
        checkpoint's state when it has one, and is left as it is otherwise (a checkpoint of
        an fp32 run resumed in fp16 starts from the initial scale)."""
        if optimizer is not None and self.optimizer is None:
            raise ValueError(f"checkpoint of step {self.step} has no optimizer state")
        if scheduler is not None and self.scheduler is None:
            raise ValueError(f"checkpoint of step {self.step} has no LR scheduler state")
        if rng and self.rng is None:
            raise ValueError(f"checkpoint of step {self.step} has no RNG state")
        model.load_state_dict(self.model)
        if optimizer is not None:
            optimizer.load_state_dict(self.optimizer)
        if scheduler is not None:
            scheduler.load_state_dict(self.scheduler)
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(self.scaler)
        if rng:
            restore_rng(self.rng)  # type: ignore[arg-type]

    def snapshot(self, reuse: TrainState | None = None) -> TrainState:
        """A deep copy with every tensor copied to CPU memory, independent of training.

        ``reuse`` is an earlier snapshot nobody reads any more: tensors of the same shape,
        dtype and position are overwritten in place instead of newly allocated (no page
        faults on the hot path). ``reuse`` must not be shared with anything still in use."""
        r = reuse
        return replace(
            self,
            model=cpu_copy(self.model, r.model if r else None),
            optimizer=cpu_copy(self.optimizer, r.optimizer if r else None),
            scheduler=cpu_copy(self.scheduler, r.scheduler if r else None),
            rng=cpu_copy(self.rng, r.rng if r else None),
            scaler=copy.deepcopy(self.scaler),
            data_cursor=copy.deepcopy(self.data_cursor),
        )

    def components(self) -> dict[str, Any]:
        """File name -> object for every component present (model always)."""
        parts = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "rng": self.rng,
                 "scaler": self.scaler}
        return {FILES[k]: v for k, v in parts.items() if v is not None}


def cpu_copy(obj: Any, into: Any = None) -> Any:
    """Deep copy of nested dict/list/tuple containers with tensors detached and copied to
    CPU memory that is not shared with ``obj``. Where ``into`` (same structure) has a CPU
    tensor of the same shape and dtype at the same place, that tensor is overwritten and
    reused instead of allocating a new one. Tensor data is copied in one batch
    (:func:`shoal.storage.memcopy.copy_tensors`)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = _plan_copy(obj, into, pairs)
    copy_tensors(pairs)
    return out


def _plan_copy(obj: Any, into: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """The copied structure, with each tensor's destination allocated (or reused) and the
    (destination, source) pair queued in ``pairs``; data is not copied yet."""
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        if not (
            isinstance(into, torch.Tensor)
            and into.device.type == "cpu"
            and into.shape == src.shape
            and into.dtype == src.dtype
            and into.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
        ):
            into = torch.empty(src.shape, dtype=src.dtype, device="cpu")
        pairs.append((into, src))
        return into
    if isinstance(obj, dict):
        sub = into if isinstance(into, dict) else {}
        items = ((k, _plan_copy(v, sub.get(k), pairs)) for k, v in obj.items())
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, (list, tuple)):
        sub = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        copied = [_plan_copy(v, w, pairs) for v, w in zip(obj, sub, strict=True)]
        return copied if isinstance(obj, list) else tuple(copied)
    return copy.deepcopy(obj)
