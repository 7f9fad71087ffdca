"""A user exception keeps its file and line in the one-line error (issue 14): ``training step
raised ValueError: corrupt sample 5`` said what, not where."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shoal.worker.engine import StepEngine
from shoal.worker.errors import UserCodeError


class Corrupt(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        if i == 5:
            raise ValueError(f"corrupt sample {i}")  # the line the message must name
        return torch.zeros(3), torch.tensor(0)


def test_a_dataset_error_names_the_users_file_and_line() -> None:
    model = nn.Linear(3, 2)
    engine = StepEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), Corrupt(),
                        loss_fn=nn.CrossEntropyLoss(reduction="sum"), require_group=False)
    with pytest.raises(UserCodeError) as err:
        engine.step(list(range(8)), 8, 0)
    line = Corrupt.__getitem__.__code__.co_firstlineno + 2
    assert str(err.value) == (f"training step raised ValueError: corrupt sample 5 "
                              f"(at {__file__}:{line} in __getitem__)")
