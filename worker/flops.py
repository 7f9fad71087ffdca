"""FLOPs of a training step, measured once, and the peak FLOP/s of this worker's device: what
``shoal status``, the report and TensorBoard turn into FLOP/s and MFU
(:mod:`shoal.core.throughput`).

**Measured** with torch's own counter (``torch.utils.flop_counter.FlopCounterMode``: the
matrix multiplications, convolutions and attention of forward and backward, as torch counts
them) around this worker's first committed step that trained on samples of its own; divided
by those samples it is ``flops_per_sample``, the same at any world size. The counter is on for
that one step only; a step that aborts is not counted and the next one is. A job may declare
the figure instead (the spec's ``flops_per_sample``, e.g. 6 x parameters x tokens per sample
for a transformer): then nothing is measured. What torch does not count is missing: on a CPU
(torch 2.13) ``scaled_dot_product_attention`` runs as ``_scaled_dot_product_flash_attention_for_cpu``,
which has no FLOP formula (the GPU kernels - flash, efficient, cuDNN - have), so a CPU figure
leaves attention out (the LM example's 2-layer, 64-byte model: exactly 6 x parameters x tokens).

**Peak** (:func:`peak_flops`): the spec's ``peak_flops`` (per worker), else :data:`PEAKS`, dense
figures of common NVIDIA GPUs from their datasheets, by the name torch gives the device and
the job's precision (fp32 reads the TF32 column when torch lets float32 matmuls use TF32). A
CPU, or a GPU not in the table, has none: MFU is then not shown.

**Published** once known, each an optional field: on this worker's heartbeat
(``flops_per_sample``, ``peak_flops``, ``tokens_per_sample``: ``shoal status`` sums the members'
peaks), on rank 0's progress entries (the first of each generation and the next one after a
figure changed: the report reads them after the job ended) and to rank 0's TensorBoard.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger("shoal.worker.flops")

#: Dense (no structured sparsity) peak FLOP/s per precision of common GPUs, by a pattern of
#: the name ``torch.cuda.get_device_name`` reports, first match wins. None: the GPU has no
#: such arithmetic worth the name (bf16 before Ampere). Sources: NVIDIA's datasheets, whose
#: tensor-core figures are "with sparsity" (halved here):
#: - H100 SXM / H200 SXM: nvidia.com/en-us/data-center/h100 and /h200 (FP32 67 TF, TF32 989 TF
#:   sparse, BF16/FP16 1,979 TF sparse); H100 PCIe: FP32 51 TF, TF32 756, BF16 1,513 sparse;
#:   H100 NVL / H200 NVL: FP32 60 TF, TF32 835, BF16 1,671 sparse.
#: - A100 (SXM and PCIe, 40 and 80 GB): nvidia.com/en-us/data-center/a100 (FP32 19.5 TF, TF32
#:   156 TF, BF16/FP16 312 TF dense).
#: - L40S: nvidia.com/en-us/data-center/l40s (FP32 91.6 TF, TF32 366, BF16 733 sparse); L40:
#:   FP32 90.5 TF, TF32 181, BF16 362 sparse; L4: nvidia.com/en-us/data-center/l4 (FP32 30.3 TF,
#:   TF32 120, BF16 242 sparse); A10: nvidia.com/en-us/data-center/products/a10-gpu (FP32 31.2 TF,
#:   TF32 125, BF16 250 sparse).
#: - V100 SXM2: FP32 15.7 TF, FP16 tensor 125 TF; V100 PCIe: 14, 112; T4: FP32 8.1, FP16 65
#:   (their datasheets; no bf16).
#: - GeForce RTX 4090 (Ada whitepaper, FP16/BF16 tensor with FP32 accumulate): FP32 82.6 TF,
#:   TF32 82.6, BF16 165.2 dense; RTX 3090 (GA102 whitepaper): FP32 35.6, TF32 35.6, BF16 71.
PEAKS: tuple[tuple[str, dict[str, float | None]], ...] = tuple(
    (pattern, {k: (v * 1e12 if v is not None else None) for k, v in figures.items()})
    for pattern, figures in (
        (r"\bH100\b.*\bPCIe\b", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
        (r"\bH[12]00\b.*\bNVL\b", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
        (r"\bH[12]00\b", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
        (r"\bA100\b", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
        (r"\bL40S\b", {"fp32": 91.6, "tf32": 183.0, "bf16": 366.5, "fp16": 366.5}),
        (r"\bL40\b", {"fp32": 90.5, "tf32": 90.5, "bf16": 181.0, "fp16": 181.0}),
        (r"\bL4\b", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
        (r"\bA10\b", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
        (r"\bV100\b.*\bPCIE\b", {"fp32": 14.0, "tf32": None, "bf16": None, "fp16": 112.0}),
        (r"\bV100\b", {"fp32": 15.7, "tf32": None, "bf16": None, "fp16": 125.0}),
        (r"\bT4\b", {"fp32": 8.1, "tf32": None, "bf16": None, "fp16": 65.0}),
        (r"\bRTX 4090\b", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
        (r"\bRTX 3090\b", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),
    )
)


def table_peak(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a GPU named ``device_name`` at ``precision`` (fp32, tf32, bf16,
    fp16) from :data:`PEAKS`; None when the GPU is not in the table."""
    for pattern, figures in PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return figures.get(precision)
    return None


def _matmul_precision(precision: str) -> str:
    """The table column of the job's precision: fp32 matmuls run as TF32 when torch allows it
    (``torch.set_float32_matmul_precision("high")`` or ``allow_tf32``)."""
    if precision != "fp32":
        return precision
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_flops(device: torch.device | str, precision: str, declared: float | None = None) -> float | None:
    """This worker's peak FLOP/s: ``declared`` (the spec's ``peak_flops``) when given, else the
    table's figure for a CUDA ``device``; None for a CPU or a GPU the table lacks."""
    if declared:
        return float(declared)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        name = torch.cuda.get_device_name(device)
    except (RuntimeError, AssertionError):  # a device that is not there after all
        return None
    return table_peak(name, _matmul_precision(precision))


class _Counted:
    """The samples a measured step trained (:meth:`FlopMeter.measure`)."""

    def __init__(self, samples: int) -> None:
        self.samples = samples


class FlopMeter:
    """Measures ``flops_per_sample`` once (:meth:`measure`) and publishes the figures (see the
    module docstring). Created with the worker; never raises into training except what the
    measured step itself raises."""

    def __init__(self, spec: Any, device: torch.device | str):
        self.spec = spec
        self.device = device
        #: FLOPs of one sample's forward and backward (None: not measured or declared yet)
        self.flops_per_sample: float | None = spec.flops_per_sample
        #: whether the measurement is still to be made (no declared figure, none measured yet)
        self.pending = spec.flops_per_sample is None
        #: this worker's peak FLOP/s, looked up at the first step (``build`` may have allowed
        #: TF32); a 1-tuple once looked up
        self._peak: tuple[float | None] | None = None
        #: what was last handed to which sinks
        self._published: tuple | None = None

    def figures(self, setup: Any) -> dict[str, float | None]:
        """What is published: FLOPs per sample, this worker's peak FLOP/s, tokens per sample."""
        if self._peak is None:
            self._peak = (peak_flops(self.device, self.spec.precision, self.spec.peak_flops),)
        return {"flops_per_sample": self.flops_per_sample, "peak_flops": self._peak[0],
                "tokens_per_sample": getattr(setup, "tokens_per_sample", None)}

    @contextlib.contextmanager
    def measure(self, samples: int, setup: Any, hb: Any = None, progress: Any = None,
                tensorboard: Any = None) -> Iterator[None]:
        """Around one step of ``samples`` local samples: counts its FLOPs while still pending
        and ``samples`` > 0; when the step returns, publishes the figures to the heartbeat
        (``hb.update``), the progress recorder (``progress.figures``) and TensorBoard
        (``tensorboard.figures``) if any changed. A step that raises is not counted. Yields a
        record whose ``samples`` the caller corrects when the step trained another number of
        samples than its slice (slices evened out within the step)."""
        counted = _Counted(samples)
        if not self.pending or samples <= 0:
            yield counted
        else:
            from torch.utils.flop_counter import FlopCounterMode

            counter = FlopCounterMode(display=False)
            with counter:
                yield counted
            total = counter.get_total_flops()
            self.pending = counted.samples <= 0
            if counted.samples > 0:
                self.flops_per_sample = total / counted.samples if total > 0 else None
                log.info("FLOPs of a step's forward and backward: %.4g per sample (%d samples counted)",
                         total / counted.samples, counted.samples)
        self._publish(setup, hb, progress, tensorboard)

    def _publish(self, setup: Any, hb: Any, progress: Any, tensorboard: Any) -> None:
        """Hand the figures to the sinks when they changed, or when a sink is new (a worker
        that rejoined after an eviction beats with a new heartbeat)."""
        figures = self.figures(setup)
        if (figures, (hb, progress, tensorboard)) == self._published:
            return
        self._published = (figures, (hb, progress, tensorboard))
        if hb is not None:
            hb.update(**figures)
        if progress is not None:
            progress.figures(**figures)
        if tensorboard is not None:
            tensorboard.figures(samples_per_step=self.spec.step_samples, **figures)
