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
