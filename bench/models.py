"""The benchmark model: the digits data with a wider MLP, so a step costs tens of
milliseconds on a CPU and the comparison measures training, not Python overhead. Used by
both the shoal run (entrypoint ``bench.models:build``) and the plain DDP baseline."""

from __future__ import annotations

import torch
from torch import nn

from shoal.examples.digits import DigitGlyphs
from shoal.worker.userapi import TrainingSetup

HIDDEN = 1024
LR = 0.05


def make_model() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def build() -> TrainingSetup:
    model = make_model()
    return TrainingSetup(
        model=model,
        optimizer=make_optimizer(model),
        dataset=DigitGlyphs(train=True),
        loss_fn=lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum"),
    )
