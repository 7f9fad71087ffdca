"""The digits glyphs as a streaming dataset: pack them into a store (packed or WebDataset
shards) and decode them back to ``(image, label)`` tensors, as the map-style digits dataset
gives them. Used by the streaming process tests and ``bench/streaming.py``."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import torch

from shoal.examples.digits import DigitGlyphs
from shoal.storage.backend import ObjectStore
from shoal.storage.datasets import DatasetIndex
from shoal.storage.streaming_pack import pack

#: 61 samples per shard: 82 shards for the 5000 glyphs
SHARD_SAMPLES = 61


def digit_samples():
    base = DigitGlyphs(train=True)
    for i in range(len(base)):
        x, y = base[i]
        yield {"x": x.numpy(), "y": int(y)}


def pack_digits(store: ObjectStore, fmt: str = "packed", shard_samples: int = SHARD_SAMPLES) -> DatasetIndex:
    """Shards cut by sample count: a packed and a WebDataset copy share their boundaries."""
    return pack(digit_samples(), store, format=fmt, shard_size=None, shard_samples=shard_samples)


def _field(sample: dict, name: str):
    key = name if name in sample else next(k for k in sample if k.split(".")[0] == name)
    value = sample[key]
    if isinstance(value, (bytes, bytearray, memoryview)):  # a WebDataset member's raw bytes
        raw = bytes(value)
        return np.load(io.BytesIO(raw), allow_pickle=False) if raw.startswith(b"\x93NUMPY") else int(raw)
    return value


def decode_digits(sample: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed or WebDataset sample -> ``(image float32[64], label int64)``."""
    x, y = _field(sample, "x"), _field(sample, "y")
    return torch.as_tensor(np.asarray(x, dtype=np.float32)), torch.tensor(int(y))


def dataset_from_env():
    """A StreamingDataset of ``SHOAL_TEST_STREAM_URI``; its cache in
    ``SHOAL_TEST_CACHE_ROOT/<pid>`` (so a test reads every worker's counters afterwards),
    ``SHOAL_TEST_CACHE_LIMIT`` bytes and ``SHOAL_TEST_PREDOWNLOAD`` samples when set."""
    from shoal.storage.streaming import StreamingDataset

    root = os.environ.get("SHOAL_TEST_CACHE_ROOT")
    limit = os.environ.get("SHOAL_TEST_CACHE_LIMIT")
    return StreamingDataset(os.environ["SHOAL_TEST_STREAM_URI"], decode=decode_digits,
                            cache_dir=Path(root) / str(os.getpid()) if root else None,
                            cache_limit=int(limit) if limit else None,
                            predownload=int(os.environ.get("SHOAL_TEST_PREDOWNLOAD", "256")))
