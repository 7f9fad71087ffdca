"""Test helpers: await coordinator decisions on the control stream instead of sleeping."""

from __future__ import annotations

import json
import time
from pathlib import Path

import redis

from shoal.events.keys import job_keys
from shoal.events.models import ShardTable

#: the repository root
ROOT = Path(__file__).resolve().parent.parent


class ControlWatcher:
    """Reads a job's control stream (the coordinator's decisions) from the beginning."""

    def __init__(self, client: redis.Redis, job_id: str):
        self.client = client
        self.keys = job_keys(job_id)
        self.last = "0-0"
        self.seen: list[dict] = []
        self._pos = 0

    def wait_for(self, pred, timeout: float) -> dict:
        """The first decision after the previous match that satisfies ``pred``, blocking on
        XREAD until it arrives; AssertionError on timeout."""
        while self._pos < len(self.seen):
            d = self.seen[self._pos]
            self._pos += 1
            if pred(d):
                return d
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            resp = self.client.xread({self.keys.control: self.last}, count=100, block=max(1, int(min(left, 1.0) * 1000)))
            for _s, entries in resp or []:
                for sid, f in entries:
                    self.last = sid.decode()
                    d = {k.decode(): v.decode() for k, v in f.items()}
                    self.seen.append(d)
                    self._pos = len(self.seen)
                    if pred(d):
                        return d
        raise AssertionError(f"no matching decision within {timeout}s; saw: {[d['reason'] for d in self.seen][-10:]}")

    def table(self) -> ShardTable:
        return ShardTable.model_validate_json(self.client.get(self.keys.shard))

    def workers(self) -> dict[str, dict]:
        return {k.decode(): json.loads(v) for k, v in self.client.hgetall(self.keys.workers).items()}


def server_ms(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000
