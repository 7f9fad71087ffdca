"""Python's cyclic garbage collector under the training loop's control.

Left to itself, CPython runs a full (generation 2) collection whenever enough objects have
survived younger ones, and a full collection walks every tracked object of the process: after
``import torch`` and a model build that is ~300,000 objects and 0.14 s on this project's CPU
machines (more with ``torch.compile``: inductor's modules). A step that allocates many Python
objects (a map-style dataset's per-sample tuples) triggers one every few steps, on each rank at
its own moment, and in a synchronous job the whole group waits for the rank that collected.
Measured in ``bench/uneven.py``: 5,800 samples a step set one off every 4-5 steps, 0.14 s each,
in the worker's forked loader (which inherited the objects and shares the worker's CPU quota).

What the large training codebases do (torchtitan's ``gc_freq``, Megatron's ``manual_gc``):
turn the automatic collector off for the training loop and collect at fixed step numbers,
the same on every rank, so that the ranks pause together instead of one at a time. shoal does
that with ``gc_every_steps`` (default 50; 0 keeps Python's automatic collector), and freezes
what exists when training starts (``gc.freeze``: the interpreter's modules, the model, the
dataset - alive for the whole job) so that a collection walks only what the steps created
since: it costs milliseconds instead of a tenth of a second. A forked loader freezes what it
inherited and collects automatically (:mod:`shoal.worker.prefetch`, ``_loader_main``).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


class StepCollector:
    """``start`` once training begins, ``after_step(step)`` after each committed step (the
    job's step number, the same on every member), ``stop`` when the worker leaves training."""

    def __init__(self, every_steps: int) -> None:
        self.every_steps = every_steps
        #: collections run by :meth:`after_step` and their total seconds (for the log)
        self.collections = 0
        self.seconds = 0.0
        self._active = False

    def start(self) -> None:
        if not self.every_steps or self._active:
            return
        began = time.perf_counter()
        gc.collect()
        gc.freeze()
        gc.disable()
        self._active = True
        log.info("garbage collection every %d steps (%d objects frozen in %.2f s)", self.every_steps,
                 gc.get_freeze_count(), time.perf_counter() - began)

    def after_step(self, step: int) -> None:
        if self._active and step % self.every_steps == 0:
            began = time.perf_counter()
            gc.collect()
            self.collections += 1
            self.seconds += time.perf_counter() - began

    def stop(self) -> None:
        if not self._active:
            return
        self._active = False
        gc.enable()
        if self.collections:
            log.info("%d scheduled garbage collection(s), %.3f s in all", self.collections, self.seconds)
