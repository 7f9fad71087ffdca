"""The digits example: an MLP learning to read noisy 8x8 digit glyphs.

The data needs no download: :class:`DigitGlyphs` renders the ten digits of a 5x7 pixel font
into 8x8 images at random positions, with random stroke strength, thickened strokes, erased
and spurious pixels and Gaussian noise - a small but real classification task (a linear
model gets about two thirds of the held-out glyphs right; the MLP close to 90 % after 3
epochs).

:func:`evaluate` is the job's ``eval_fn``: ``examples/job.yaml`` runs it after every epoch
(``eval_every_epochs: 1``; ``shoal status`` shows the last one) and at the end.

Run it on shoal with ``shoal submit examples/job.yaml`` (entrypoint ``shoal.examples.digits:build``),
or locally, single process, with ``python -m shoal.examples.digits``. ``examples/torchrun_ddp.py``
is the same training as a plain torchrun DDP script; ``examples/README.md`` compares them.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

from shoal import TrainingSetup, envvars

_FONT = {
    0: [".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."],
    1: ["..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."],
    2: [".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"],
    3: ["#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."],
    4: ["...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."],
    5: ["#####", "#....", "####.", "....#", "....#", "#...#", ".###."],
    6: ["..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."],
    7: ["#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."],
    8: [".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."],
    9: [".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."],
}
GLYPHS = np.array(
    [[[c == "#" for c in row] for row in _FONT[d]] for d in range(10)], dtype=np.float32
)  # (10, 7, 5)

TRAIN_SEED = 20240
TEST_SEED = 777
NOISE = 0.15


def render(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Noisy 8x8 images (float32, flattened to 64) of the digits in ``labels``."""
    n = len(labels)
    out = np.zeros((n, 8, 8), dtype=np.float32)
    for i, d in enumerate(labels):
        g = GLYPHS[d].copy()
        if rng.random() < 0.3:  # thicker vertical strokes
            g[:, 1:] = np.maximum(g[:, 1:], g[:, :-1] * 0.8)
        g *= rng.uniform(0.6, 1.0)  # stroke strength
        g *= rng.random(g.shape) > 0.12  # erased pixels
        dy, dx = rng.integers(0, 2), rng.integers(0, 4)
        out[i, dy : dy + 7, dx : dx + 5] = g
    out += (rng.random(out.shape) < 0.04) * rng.uniform(0.3, 1.0, out.shape)  # spurious pixels
    out += rng.normal(0.0, NOISE, out.shape)
    return out.reshape(n, 64).astype(np.float32)


class DigitGlyphs(torch.utils.data.Dataset):
    """Map-style dataset of ``(image[64] float32, label int)``; deterministic for a seed.

    ``train=True`` gives 5000 samples, ``train=False`` 1000 other ones (another seed). The
    data does not depend on the job seed, so every worker holds the same dataset.
    """

    def __init__(self, train: bool = True, size: int | None = None) -> None:
        seed = TRAIN_SEED if train else TEST_SEED
        n = size or (5000 if train else 1000)
        rng = np.random.default_rng(seed)
        labels = rng.integers(0, 10, n)
        self.x = torch.from_numpy(render(labels, rng))
        self.y = torch.from_numpy(labels.astype(np.int64))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


_TEST: DigitGlyphs | None = None


def evaluate(model: nn.Module) -> dict[str, float]:
    """Accuracy and mean cross-entropy on the 1000 held-out glyphs."""
    global _TEST
    if _TEST is None:
        _TEST = DigitGlyphs(train=False)
    with torch.no_grad():
        logits = model(_TEST.x.to(next(model.parameters()).device)).cpu()
    return {
        "accuracy": float((logits.argmax(1) == _TEST.y).float().mean()),
        "loss": float(nn.functional.cross_entropy(logits, _TEST.y)),
    }


def build() -> TrainingSetup:
    """The shoal entrypoint (``shoal.examples.digits:build``)."""
    model = make_model()
    return TrainingSetup(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        dataset=DigitGlyphs(train=True),
        loss_fn=nn.CrossEntropyLoss(reduction="sum"),  # SUM: shoal divides by the global batch
        eval_fn=evaluate,
    )


class _Float64(nn.Module):
    """``make_model()`` in float64; takes the dataset's float32 images."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model().double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.double())


def build_double() -> TrainingSetup:
    """``build`` in float64. The chaos soak trains this: summation-order rounding (the only
    thing a changing world size may alter) is then ~1e-16 instead of ~1e-7, so comparing the
    final weights to a failure-free run stays sharp over a long run."""
    setup = build()
    model = _Float64()
    setup.model = model
    setup.optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return setup


def build_double_paced() -> TrainingSetup:
    """``build_double`` with a pause in every step: the chaos soak's job (``shoal chaos``)."""
    return paced(build_double())


def paced(setup: TrainingSetup) -> TrainingSetup:
    """Sleep in every step, so that steps/s hardly depends on how busy a shared machine is.
    The pause is ``SHOAL_STEP_PACE`` seconds (default 0.03), or, when ``SHOAL_STEP_PACE_FILE``
    names a file, the number in it, read again every second (the chaos soak steers it so the
    job ends with its fault window). The arithmetic is exactly the unpaced setup's."""
    pace = float(envvars.STEP_PACE.get())
    path = envvars.STEP_PACE_FILE.get()
    summed = setup.loss_fn
    state = {"pace": pace, "read_at": 0.0}

    def current() -> float:
        now = time.monotonic()
        if path and now - state["read_at"] >= 1.0:
            state["read_at"] = now
            try:
                with open(path) as f:
                    state["pace"] = min(1.0, max(0.0, float(f.read().strip())))
            except (OSError, ValueError):
                pass  # keep the last pace
        return state["pace"]

    def loss_fn(outputs, targets):
        time.sleep(current())
        return summed(outputs, targets)

    setup.loss_fn = loss_fn
    return setup


def train_locally(epochs: int = 3, global_batch: int = 64, seed: int = 0, log=print) -> list[dict[str, float]]:
    """Train single-process with shoal's engine and data order (no Redis); per-epoch metrics."""
    from shoal import DataOrder, StepEngine, load_entrypoint

    setup = load_entrypoint("shoal.examples.digits:build", seed)
    engine = StepEngine.from_setup(setup, require_group=False)
    order = DataOrder(len(setup.dataset), seed, global_batch)
    cursor, history = 0, []
    for epoch in range(epochs):
        total, count = 0.0, 0
        for _ in range(order.steps_per_epoch()):
            batch = order.batch(cursor)
            result = engine.step(batch.indices, batch.count, generation=0)
            cursor = batch.next_cursor
            total, count = total + result.loss_sum, count + result.count
        metrics = {"epoch": epoch, "train_loss": total / count, **engine.evaluate(setup.eval_fn)}
        log(f"epoch {epoch}: train loss {metrics['train_loss']:.4f}  "
            f"test loss {metrics['loss']:.4f}  test accuracy {metrics['accuracy']:.3f}")
        history.append(metrics)
    return history


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    train_locally(args.epochs, args.batch, args.seed)
