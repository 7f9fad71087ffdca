"""Entrypoints used by tests: the digits example with a slower custom step function, so a
test has time to kill, add and drain workers in the middle of an epoch."""

from __future__ import annotations

import os
import time

import torch.nn.functional as F

from shoal.examples.digits import build as build_digits
from shoal.worker.userapi import TrainingSetup


def slow_digits() -> TrainingSetup:
    setup = build_digits()
    delay = float(os.environ.get("SHOAL_TEST_STEP_DELAY", "0.1"))

    def step_fn(model, batch):
        inputs, targets = batch
        time.sleep(delay)
        return F.cross_entropy(model(inputs), targets, reduction="sum")

    setup.step_fn, setup.loss_fn = step_fn, None
    return setup


class _CorruptAt:
    """A map-style dataset that raises at one index, like a corrupt record in a data file."""

    def __init__(self, inner, bad: int):
        self.inner, self.bad = inner, bad

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        if i == self.bad:
            raise ValueError(f"corrupt sample {i}")
        return self.inner[i]


def corrupt_digits() -> TrainingSetup:
    """The digits example whose dataset raises at index ``SHOAL_TEST_CORRUPT_AT`` (default
    100, in the second global batch of 64)."""
    setup = build_digits()
    setup.dataset = _CorruptAt(setup.dataset, int(os.environ.get("SHOAL_TEST_CORRUPT_AT", "100")))
    return setup


def empty_dataset() -> TrainingSetup:
    """Imports fine; only calling it shows the problem (``submit --dry-build``)."""
    setup = build_digits()
    setup.dataset = []
    return setup


def stream_digits_store() -> TrainingSetup:
    """The slow digits job reading the glyphs packed as a streaming dataset at
    ``SHOAL_TEST_STREAM_URI`` (see ``tests.stream_data``)."""
    from tests.stream_data import dataset_from_env

    setup = slow_digits()
    setup.dataset = dataset_from_env()
    return setup


def stream_blobs_store() -> TrainingSetup:
    """A tiny model reading the large blob dataset streamed from ``SHOAL_TEST_STREAM_URI``
    (``tests.stream_data.pack_blobs``): the cache limit test."""
    from tests.stream_data import blob_setup

    return blob_setup()


def digits_split_eval() -> TrainingSetup:
    """The digits example in float64 (paced), evaluated by a distributed evaluation of its
    1000 held-out glyphs (``eval_dataset``): the summed loss and the number correct."""
    import torch

    from shoal.examples.digits import DigitGlyphs, build_double_paced

    setup = build_double_paced()
    test = DigitGlyphs(train=False)
    test.x = test.x.double()

    def sums(model, batch):
        inputs, targets = batch
        logits = model(inputs)
        return {"loss": F.cross_entropy(logits, targets, reduction="sum"),
                "accuracy": (logits.argmax(1) == targets).sum().to(torch.float64)}

    setup.eval_fn, setup.eval_dataset, setup.eval_sums, setup.eval_batch_size = None, test, sums, 50
    return setup
