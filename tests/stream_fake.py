"""An in-memory stand-in for :class:`shoal.storage.streaming.StreamingDataset` (its interface,
no storage): the digits glyphs cut into shards. It counts a whole shard's bytes the first time
a process reads one of its samples as owner, and one sample's bytes for each remote read, so
tests of the order, the assignment and the wiring run without an S3 server. Counters live in
a directory of per-process JSON files when ``SHOAL_TEST_STREAM_STATS`` names one."""

from __future__ import annotations

import json
import os
from pathlib import Path

from shoal.examples.digits import DigitGlyphs

SAMPLE_BYTES = 64 * 4 + 8


class FakeStream:
    def __init__(self, shard_size: int = 50, predownload: int = 64) -> None:
        self.base = DigitGlyphs(train=True)
        n = len(self.base)
        self.shard_samples = [min(shard_size, n - s) for s in range(0, n, shard_size)]
        self.shard_size = shard_size
        self.predownload = predownload
        self._cached: set[int] = set()
        self._counts = {"bytes_downloaded": 0, "remote_bytes": 0, "remote_reads": 0, "cache_hits": 0,
                        "cache_misses": 0}

    def __len__(self) -> int:
        return len(self.base)

    def _shard(self, i: int) -> int:
        return i // self.shard_size

    def __getitem__(self, i: int):
        s = self._shard(i)
        if s in self._cached:
            self._counts["cache_hits"] += 1
        else:
            self._counts["cache_misses"] += 1
            self._counts["bytes_downloaded"] += self.shard_samples[s] * SAMPLE_BYTES
            self._cached.add(s)
        self._save()
        return self.base[i]

    def get_remote(self, i: int):
        self._counts["remote_reads"] += 1
        self._counts["remote_bytes"] += SAMPLE_BYTES
        self._save()
        return self.base[i]

    def read(self, ids, owned):
        return [self[i] if self._shard(i) in owned or self._shard(i) in self._cached else self.get_remote(i)
                for i in ids]

    def plan(self, upcoming, owned) -> None:
        self.planned = (list(upcoming), set(owned))

    def _save(self) -> None:
        d = os.environ.get("SHOAL_TEST_STREAM_STATS")
        if d:
            Path(d).mkdir(parents=True, exist_ok=True)
            (Path(d) / f"{os.getpid()}.json").write_text(json.dumps(self._counts))

    def stats(self) -> dict:
        return dict(self._counts)


def total_stats(directory: Path) -> dict:
    """The counters of every process that wrote them, summed."""
    out: dict[str, int] = {}
    for f in Path(directory).glob("*.json"):
        for k, v in json.loads(f.read_text()).items():
            out[k] = out.get(k, 0) + v
    return out
