"""The cyclic garbage collector under the training loop's control (``gc_every_steps``,
:mod:`shoal.worker.collector`) and in forked loader processes, with the real ``gc`` module."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from torch.utils.data import default_collate

from shoal.core.jobspec import JobSpec
from shoal.worker.collector import StepCollector
from shoal.worker.data import DataOrder
from shoal.worker.prefetch import Prefetcher


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def gc_restored():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()


def test_collects_only_at_its_steps_with_the_start_frozen(gc_restored) -> None:
    c = StepCollector(50)
    c.start()
    assert not gc.isenabled() and gc.get_freeze_count() > 1000  # the interpreter's and torch's objects
    cycle = _Cycle()
    alive = weakref.ref(cycle)
    del cycle
    for step in range(1, 50):
        c.after_step(step)
    assert alive() is not None and c.collections == 0  # cyclic garbage waits for the 50th step
    c.after_step(50)
    assert alive() is None and c.collections == 1
    c.stop()
    assert gc.isenabled()


def test_zero_keeps_pythons_automatic_collection(gc_restored) -> None:
    c = StepCollector(0)
    c.start()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    c.after_step(50)
    assert c.collections == 0
    assert JobSpec(name="j", entrypoint="m:f").gc_every_steps == 50  # the default: on


class GcState(torch.utils.data.Dataset):
    """Sample ``i``: where and under which collector it was read."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        return torch.tensor([int(gc.isenabled()), gc.get_freeze_count(), os.getpid()]), torch.tensor(i)


def test_a_loader_forked_from_a_collecting_worker_collects_by_itself_with_what_it_inherited_frozen(gc_restored) -> None:
    gc.disable()  # as the training loop has it (a loader may be forked again later, e.g. after a crash)
    assert gc.get_freeze_count() == 0
    p = Prefetcher(GcState(), default_collate, num_samples=16, seed=3, global_batch=8, workers=1, steps=1,
                   start_method="fork")
    try:
        p.start_step(0, [[0, 8, 1]])
        chunk = DataOrder(16, 3, 8).batch(0).for_rank([[0, 8, 1]]).tolist()
        enabled, frozen, pid = p.fetch(chunk)[0][0].tolist()
    finally:
        p.close()
    assert pid != os.getpid()  # read in the loader process, not inline
    assert enabled == 1 and frozen > 1000
    assert not gc.isenabled() and gc.get_freeze_count() == 0  # the worker's own state is its own
