"""Entrypoints used by tests: the digits example with a slower custom step function, so a
test has time to kill, add and drain workers in the middle of an epoch."""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from shoal.examples.digits import build as build_digits
from shoal.worker.userapi import TrainingSetup


class Points(torch.utils.data.Dataset):
    """``n`` random points of 5 features (seed 1), labelled by the sign of their sum: a tiny
    dataset for engine and layout tests that build their own model."""

    def __init__(self, n: int = 40) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 5, generator=g)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def _held(hold: str | None) -> None:
    """While the file ``hold`` (``SHOAL_TEST_HOLD_FILE``) exists, wait (at most 120 s): a test
    holds the members inside a step until something it awaits has happened, whatever the
    machine's load (a joiner's start-up, which took longer than the rest of the job on a
    loaded machine)."""
    if hold:
        deadline = time.monotonic() + 120
        while os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.01)


def slow_digits() -> TrainingSetup:
    """The digits example whose every step sleeps ``SHOAL_TEST_STEP_DELAY`` s (default 0.1)
    and, while the file ``SHOAL_TEST_HOLD_FILE`` names exists, waits for it to go (a test holds
    the job's progress, e.g. until a joiner has joined: :func:`_held`)."""
    setup = build_digits()
    delay = float(os.environ.get("SHOAL_TEST_STEP_DELAY", "0.1"))
    hold = os.environ.get("SHOAL_TEST_HOLD_FILE")

    def step_fn(model, batch):
        inputs, targets = batch
        _held(hold)
        time.sleep(delay)
        return F.cross_entropy(model(inputs), targets, reduction="sum")

    setup.step_fn, setup.loss_fn = step_fn, None
    return setup


def per_sample_double() -> TrainingSetup:
    """The digits example in float64 (``build_double``) whose loss sleeps
    ``SHOAL_TEST_SAMPLE_DELAY`` seconds (default 0.002) per sample of each micro-batch: a
    member's own work grows with its slice, and a process started with a larger delay is a
    slower machine (slices by speed). The arithmetic is exactly ``build_double``'s."""
    from shoal.examples.digits import build_double

    setup = build_double()
    delay = float(os.environ.get("SHOAL_TEST_SAMPLE_DELAY", "0.002"))
    summed = setup.loss_fn

    def loss_fn(outputs, targets):
        time.sleep(delay * len(targets))
        return summed(outputs, targets)

    setup.loss_fn = loss_fn
    return setup


def first_step_digits() -> TrainingSetup:
    """:func:`slow_digits` whose first step writes the weights the worker starts training
    from (before any update) to ``$SHOAL_TEST_FIRST_DIR/first-<pid>.pt``, whole: a sharded
    model's are gathered (a collective the members of its replica group make together, at
    their first step)."""
    import torch

    setup = slow_digits()
    inner = setup.step_fn
    done = False

    def step_fn(model, batch):
        nonlocal done
        out = os.environ.get("SHOAL_TEST_FIRST_DIR")
        if out and not done:
            done = True
            whole = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
                     for k, v in model.state_dict().items()}
            os.makedirs(out, exist_ok=True)
            torch.save(whole, os.path.join(out, f"first-{os.getpid()}.pt"))
        return inner(model, batch)

    setup.step_fn = step_fn
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


def steady_digits(width: int, pace: float = 0.0, eval_pause: float = 0.0,
                  tokens_per_sample: int | None = None) -> TrainingSetup:
    """The digits task with the job spec's ``params``: an MLP 64 -> ``width`` -> 64 -> 10 (its
    forward and backward, as torch's FLOP counter counts them - no input gradient for the
    first layer - are 640 x ``width`` + 3840 FLOPs per sample), a ``pace`` s pause in every
    step and an ``eval_pause`` s one in every evaluation (an evaluation step much longer than
    the others), declaring ``tokens_per_sample`` (the 64 pixels, say). ``width`` has no
    default: a job without it is refused."""
    from torch import nn

    from shoal.examples.digits import evaluate

    setup = build_digits()
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 10))
    summed = nn.CrossEntropyLoss(reduction="sum")

    def loss_fn(outputs, targets):
        time.sleep(pace)
        return summed(outputs, targets)

    def eval_fn(m):
        time.sleep(eval_pause)
        return evaluate(m)

    import torch

    setup.model, setup.loss_fn, setup.eval_fn = model, loss_fn, eval_fn
    setup.optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    setup.tokens_per_sample = tokens_per_sample
    return setup


def steady_digits_flops(width: int) -> float:
    """FLOPs of one sample's forward and backward of :func:`steady_digits`' model."""
    params = 64 * width + width * 64 + 64 * 10
    return 2 * params * 2 + 2 * (width * 64 + 64 * 10)


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


def digits_split_eval_large() -> TrainingSetup:
    """:func:`digits_split_eval` with 40,000 held-out glyphs (``bench/eval_split.py``)."""
    import torch

    from shoal.examples.digits import DigitGlyphs

    setup = digits_split_eval()
    big = DigitGlyphs(train=False, size=40_000)
    big.x = big.x.double()
    setup.eval_dataset, setup.eval_batch_size = big, 1000
    return setup


def diloco_digits() -> TrainingSetup:
    """:func:`slow_digits` with AdamW as the inner optimizer (DiLoCo's usual one): the DiLoCo
    process tests' job. ``SHOAL_TEST_STEP_DELAY`` s in each inner step's forward."""
    import torch

    setup = slow_digits()
    setup.optimizer = torch.optim.AdamW(setup.model.parameters(), lr=1e-3)
    return setup


class _Ballasted(torch.nn.Module):
    """A model plus a flat ballast parameter: its size sets the bytes of an outer exchange."""

    def __init__(self, inner: torch.nn.Module, n: int) -> None:
        super().__init__()
        self.inner = inner
        self.ballast = torch.nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return self.inner(x)


def diloco_ballast() -> TrainingSetup:
    """:func:`slow_digits` whose model carries ``SHOAL_TEST_BALLAST`` more parameters (default
    1,000,000: 4 MB of fp32 outer gradient per member), trained with plain SGD (no optimizer
    state to copy): the slow-link DiLoCo tests size their outer exchange with it. The ballast
    gets a small constant gradient, so its outer gradient is not zero."""
    setup = slow_digits()
    model = _Ballasted(setup.model, int(os.environ.get("SHOAL_TEST_BALLAST", "1000000")))
    digits_step = setup.step_fn

    def step_fn(m, batch):
        return digits_step(m.inner, batch) + 1e-3 * m.ballast.sum()

    setup.model, setup.step_fn = model, step_fn
    setup.optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return setup
