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


def test_a_fenced_batch_writes_a_hash_of_thousands_of_fields_whole(r: redis.Redis, job_id: str) -> None:
    """A generation adding 5,000 workers writes their 5,000 records in one fenced batch (Lua's
    unpack takes ~8,000 values: one HSET of them all failed, half applied)."""
    keys = job_keys(job_id)
    r.set(keys.lease, "tok")
    r.set(keys.epoch, "1")
    writer = FencedWriter(r, keys, "tok", 1)
    records = {f"w{i}": f'{{"worker_id": "w{i}"}}' for i in range(5000)}
    writer.commit(FencedBatch(keys).hset(keys.workers, records).add("SET", keys.base + ":after", "1"))
    assert r.hlen(keys.workers) == 5000 and r.get(keys.base + ":after") == b"1"
