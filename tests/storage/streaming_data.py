"""Sample sources for the streaming-dataset tests (``module:function`` for ``shoal dataset pack``).

Every sample is a pure function of its index, with fields named by their WebDataset type
(``cls`` int, ``txt`` str, ``npy`` array, ``bin`` bytes), so a packed and a WebDataset copy
read back as equal dicts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np


def sample(i: int, payload: int = 64) -> dict[str, Any]:
    """Sample ``i``: its label, its name, a small array and ``payload`` pseudo-random bytes."""
    seed = hashlib.sha256(str(i).encode()).digest()
    return {
        "cls": i % 10,
        "txt": f"sample {i}",
        "npy": np.arange(i % 7 + 1, dtype=np.float32) * i,
        "bin": (seed * (payload // 32 + 1))[:payload],
    }


def samples(n: int = 300, payload: int = 64) -> Iterator[dict[str, Any]]:
    return (sample(i, payload) for i in range(n))


def small() -> Iterator[dict[str, Any]]:
    """``module:function`` source: 300 samples of about 150 bytes."""
    return samples(300)


def raises_midway() -> Iterator[dict[str, Any]]:
    """Yields 200 samples, then raises."""
    for i in range(200):
        yield sample(i, 256)
    raise RuntimeError("source broke at 200")


def unpackable() -> Iterator[dict[str, Any]]:
    """Sample 150 holds a set (not a packable type)."""
    for i in range(300):
        yield sample(i, 256) if i != 150 else {"cls": 1, "bad": {1, 2}}


def not_iterable() -> int:
    return 42
