"""What the chaos soak samples while faults fly: LATEST validity and Redis's footprint.

Every ``interval`` seconds, from a background thread:

- the store's LATEST object names a checkpoint whose manifest parses and whose files all
  have the recorded size and sha256 (read back and hashed); the job's Redis LATEST pointer,
  when set, names a checkpoint that verifies too. A sample during which LATEST moved (and
  retention removed what it named a moment ago) is read again, not counted invalid;
- Redis ``used_memory`` and the length of every stream of the job.

A sample that cannot reach Redis (it is being restarted) is counted as skipped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import redis

from shoal.events.keys import JobKeys
from shoal.storage.backend import ObjectStore
from shoal.storage.errors import StorageError
from shoal.storage.latest import LatestPointer
from shoal.storage.latest_object import read_latest_step
from shoal.storage.verify import read_manifest, read_verified_files

STREAMS = ("events", "control", "generations", "logs", "progress", "dead", "failures")


@dataclass
class Samples:
    latest_ok: int = 0
    latest_bad: list[str] = field(default_factory=list)
    skipped: int = 0
    max_memory: int = 0
    max_xlen: dict[str, int] = field(default_factory=dict)


class Sampler:
    def __init__(self, client: redis.Redis, keys: JobKeys, store: ObjectStore, *, interval: float = 0.5):
        self.client = client
        self.keys = keys
        self.store = store
        self.interval = interval
        self.samples = Samples()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> Samples:
        self._stop.set()
        self._thread.join(timeout)
        return self.samples

    def _verify(self, step: int) -> None:
        read_verified_files(self.store, read_manifest(self.store, step))

    def sample_latest(self) -> None:
        for _attempt in range(3):
            try:
                step = read_latest_step(self.store)
                raw = self.client.get(self.keys.latest)
                if step is not None:
                    self._verify(step)
                if raw:
                    self._verify(LatestPointer.from_json(raw).step)
                self.samples.latest_ok += 1
                return
            except StorageError as exc:
                moved = read_latest_step(self.store) != step
                if not moved:
                    self.samples.latest_bad.append(str(exc))
                    return
        self.samples.latest_bad.append("LATEST kept moving during 3 reads")

    def sample_footprint(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.info("memory")
        for name in STREAMS:
            pipe.xlen(getattr(self.keys, name))
        info, *lens = pipe.execute()
        self.samples.max_memory = max(self.samples.max_memory, int(info["used_memory"]))
        for name, n in zip(STREAMS, lens):
            self.samples.max_xlen[name] = max(self.samples.max_xlen.get(name, 0), int(n))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample_footprint()
                self.sample_latest()
            except (redis.ConnectionError, redis.TimeoutError):
                self.samples.skipped += 1
