"""The coordinator's fenced write of the LATEST pointer only ever moves it forwards (real Redis)."""

from __future__ import annotations

import redis

from shoal.coordinator.fenced import FencedBatch, FencedWriter
from shoal.events.keys import job_keys
from shoal.storage.latest import LatestPointer


def _write(writer: FencedWriter, step: int) -> None:
    pointer = LatestPointer(step=step, store="file:///ckpt", generation=1)
    writer.commit(FencedBatch(writer.keys).add("SETLATEST", writer.keys.latest, step, pointer.to_json()))


def test_a_fenced_latest_write_never_moves_the_pointer_back(r: redis.Redis, job_id: str) -> None:
    keys = job_keys(job_id)
    r.set(keys.lease, "tok")
    r.set(keys.epoch, "3")
    writer = FencedWriter(r, keys, "tok", 3)

    _write(writer, 20)
    assert LatestPointer.from_json(r.get(keys.latest)).step == 20
    _write(writer, 10)  # a late report of an older checkpoint (e.g. a slow async save)
    assert LatestPointer.from_json(r.get(keys.latest)).step == 20
    _write(writer, 20)  # the same step rewrites
    _write(writer, 30)
    assert LatestPointer.from_json(r.get(keys.latest)).step == 30

    r.set(keys.latest, "not json")  # an unparsable value is replaced
    _write(writer, 5)
    assert LatestPointer.from_json(r.get(keys.latest)).step == 5
