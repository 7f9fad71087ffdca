"""Streaming datasets of the tests: the digits glyphs (pack them into a store as packed or
WebDataset shards, decode them back to ``(image, label)`` tensors as the map-style digits
dataset gives them; used by the streaming process tests and ``bench/streaming.py``), and a
large dataset of seeded random bytes for the cache limit test (:func:`pack_blobs`)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import torch

from shoal.examples.digits import DigitGlyphs
from shoal.worker.userapi import TrainingSetup
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


#: the large dataset: 3200 samples of 64 KiB (200 MiB of payload, 200.2 MiB packed)
BLOB_SAMPLES = 3200
BLOB_BYTES = 64 * 1024
#: features decoded from the start of each payload
BLOB_FEATURES = 8


def blob_samples(n: int = BLOB_SAMPLES, size: int = BLOB_BYTES, seed: int = 15):
    """``n`` samples ``{"x": size seeded random bytes, "y": 1 if x[0] >= 128 else 0}``: the
    bytes come from one numpy draw (about a second for 200 MiB), the same on every call."""
    raw = np.random.default_rng(seed).bytes(n * size)
    for i in range(n):
        x = raw[i * size : (i + 1) * size]
        yield {"x": x, "y": int(x[0] >= 128)}


def pack_blobs(store: ObjectStore, shard_size: int, n: int = BLOB_SAMPLES) -> DatasetIndex:
    """The blob samples packed into shards of at most ``shard_size`` bytes."""
    return pack(blob_samples(n), store, format="packed", shard_size=shard_size)


def decode_blob(sample: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A blob sample -> ``(float32[BLOB_FEATURES] from its first bytes, label int64)``: the
    payload is read (the whole record's crc32 checked) but only a few bytes become features."""
    head = np.frombuffer(sample["x"], dtype=np.uint8, count=BLOB_FEATURES)
    return torch.as_tensor(head.astype(np.float32) / 255.0), torch.tensor(sample["y"])


def blob_setup() -> TrainingSetup:
    """A tiny linear classifier of the blob dataset at ``SHOAL_TEST_STREAM_URI`` (see
    :func:`dataset_from_env`); no pause in its steps: the input is what takes time."""
    model = torch.nn.Linear(BLOB_FEATURES, 2)
    return TrainingSetup(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         dataset=dataset_from_env(decode_blob),
                         loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"))


def dataset_from_env(decode=decode_digits):
    """A StreamingDataset of ``SHOAL_TEST_STREAM_URI`` decoded by ``decode``; its cache in
    ``SHOAL_TEST_CACHE_ROOT/<pid>`` (so a test reads every worker's counters afterwards),
    ``SHOAL_TEST_CACHE_LIMIT`` bytes and ``SHOAL_TEST_PREDOWNLOAD`` samples when set."""
    from shoal.storage.streaming import StreamingDataset

    root = os.environ.get("SHOAL_TEST_CACHE_ROOT")
    limit = os.environ.get("SHOAL_TEST_CACHE_LIMIT")
    return StreamingDataset(os.environ["SHOAL_TEST_STREAM_URI"], decode=decode,
                            cache_dir=Path(root) / str(os.getpid()) if root else None,
                            cache_limit=int(limit) if limit else None,
                            predownload=int(os.environ.get("SHOAL_TEST_PREDOWNLOAD", "256")))
