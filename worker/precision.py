"""Mixed precision for the step engine: autocast contexts and the fp16 loss scale.

``precision`` (the job spec's field) is one of :data:`PRECISIONS`:

* ``fp32``: no autocast.
* ``bf16``: forward and loss run under ``torch.autocast(device_type, torch.bfloat16)``;
  parameters, gradients and the optimizer stay float32. bf16 has float32's range: no scaling.
* ``fp16``: autocast to float16, and the loss is multiplied by a :class:`LossScale` before
  backward so that small gradients do not flush to zero in float16 (the engine scales the
  mean loss of the global batch, as ``torch.amp.GradScaler`` does with a mean loss, so the
  usual initial scale fits). The engine divides the *reduced* gradient by the scale; when it holds an inf or a NaN the step is an **overflow
  step**: see :meth:`LossScale.update`.

The overflow decision is taken on the all-reduced gradient, which is identical on every rank,
so every rank skips the same steps and changes its scale the same way: the scale is part of
the replicated training state (checkpointed with it and sent to joiners).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
_AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`; ValueError otherwise."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context forward and loss run in: autocast to bf16/fp16 on ``device``'s type, or
    nothing for fp32."""
    dtype = _AUTOCAST_DTYPE.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass
class LossScale:
    """The dynamic loss scale of fp16 training (the policy of ``torch.amp.GradScaler``).

    The loss is multiplied by :attr:`scale` before backward; gradients are divided by it after
    the all-reduce. :meth:`update` after every step: an overflow step (non-finite reduced
    gradient) halves the scale (``backoff_factor``) and restarts the count; after
    ``growth_interval`` finite steps in a row the scale doubles (``growth_factor``). The scale
    stays a power of two, so scaling and unscaling are exact.

    The state that travels (:meth:`state_dict`: ``scale``, ``growth_tracker``) is plain
    numbers, so it fits a checkpoint file, a JSON header and a state transfer's ``extra``.
    """

    scale: float = 2.0**16
    growth_tracker: int = 0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    #: the scale never falls below this (a gradient that is non-finite at any scale - a NaN
    #: from the model itself - must not drive it to zero)
    min_scale: float = 2.0**-24

    def update(self, found_inf: bool) -> None:
        """Account for one committed step whose reduced gradient was (``found_inf``) or was
        not finite. Pure arithmetic on replicated numbers: every rank gets the same result."""
        if found_inf:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            grown = self.scale * self.growth_factor
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take ``state`` (:meth:`state_dict`'s form); ValueError when it is not one."""
        try:
            scale, tracker = float(state["scale"]), int(state["growth_tracker"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a loss-scale state: {state!r}") from exc
        if not (math.isfinite(scale) and scale > 0) or tracker < 0:
            raise ValueError(f"not a loss-scale state: {state!r}")
        self.scale, self.growth_tracker = scale, tracker
