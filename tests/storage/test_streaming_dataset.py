"""StreamingDataset against the real S3 server (moto) and local directories: the same samples
from packed and WebDataset shards, ranged reads, prefetch by plan, the cache limit under two
forked readers, corrupt and missing shards, and retries through a flaky endpoint."""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from tests.helpers import wait_until
from tests.storage import streaming_data
from tests.storage.support import make_s3_store, s3_env

from shoal.storage.errors import ObjectNotFound, ShardCorrupt
from shoal.storage.streaming import StreamingDataset
from shoal.storage.streaming_pack import pack


@pytest.fixture(autouse=True)
def _s3_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_env().items():
        monkeypatch.setenv(k, v)


def _s3_dataset(n: int, *, fmt: str = "packed", shard_size: int | None = 8000, payload: int = 64,
                shard_samples: int | None = None):
    store = make_s3_store("data/set")
    index = pack(streaming_data.samples(n, payload), store, format=fmt, shard_size=shard_size,
                 shard_samples=shard_samples)
    return store, index, f"s3://{store.bucket}/data/set"


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a
    )


def test_webdataset_and_packed_give_the_same_samples_for_the_same_ids(tmp_path: Path) -> None:
    _, _, packed_uri = _s3_dataset(400, fmt="packed", shard_size=6000)
    _, _, tar_uri = _s3_dataset(400, fmt="webdataset", shard_size=20000)
    a = StreamingDataset(packed_uri, cache_dir=tmp_path / "a")
    b = StreamingDataset(tar_uri, cache_dir=tmp_path / "b")
    assert len(a) == len(b) == 400
    assert a.shard_samples != b.shard_samples  # different shard boundaries, same global ids
    for i in np.random.default_rng(0).permutation(400)[:120]:
        assert _equal(a[int(i)], b[int(i)]), i
        assert _equal(a.get_remote(int(i)), b.get_remote(int(i))), i
    # cut by sample count, both formats get the same boundaries (so the same shard-aware order)
    _, _, packed_even = _s3_dataset(400, fmt="packed", shard_size=None, shard_samples=37)
    _, _, tar_even = _s3_dataset(400, fmt="webdataset", shard_size=None, shard_samples=37)
    c = StreamingDataset(packed_even, cache_dir=tmp_path / "c")
    d = StreamingDataset(tar_even, cache_dir=tmp_path / "d")
    assert c.shard_samples == d.shard_samples == [37] * 10 + [30]
    assert all(_equal(c[i], d[i]) for i in (0, 36, 37, 399))


def test_locate_and_shard_of_follow_index_order(tmp_path: Path) -> None:
    _, index, uri = _s3_dataset(250, shard_size=3000)
    ds = StreamingDataset(uri, cache_dir=tmp_path / "c")
    counts = [s.samples for s in index.shards]
    assert ds.shard_samples == counts and len(ds) == 250
    starts = np.cumsum([0] + counts)
    ids = np.arange(250)
    shards = ds.shard_of(ids)
    for i in ids:
        shard, pos = ds.locate(int(i))
        assert shard == shards[i] and starts[shard] + pos == i
    with pytest.raises(IndexError):
        ds.locate(250)


def test_ranged_reads_return_the_same_samples_and_count_bytes(tmp_path: Path) -> None:
    _, index, uri = _s3_dataset(200, shard_size=4000, payload=200)
    ds = StreamingDataset(uri, cache_dir=tmp_path / "c")
    ids = [3, 4, 150, 5]
    remote = [ds.get_remote(i) for i in ids]
    st = ds.stats()
    assert st["bytes_downloaded"] == 0 and st["downloads"] == 0 and st["remote_reads"] == 4
    # two shards touched: one offsets table read each, then one ranged read per sample
    shard_a, shard_b = ds.locate(3)[0], ds.locate(150)[0]
    tables = sum(16 + 8 * (index.shards[s].samples + 1) for s in (shard_a, shard_b))
    assert st["remote_bytes"] > tables
    assert st["remote_bytes"] < tables + 4 * 400  # records of ~300 bytes, nothing else
    assert st["remote_bytes"] < (index.shards[shard_a].size + index.shards[shard_b].size) / 2
    for i, got in zip(ids, remote):
        assert _equal(got, ds[i])
    # read(): owned shards come whole, others by ranged reads
    before = ds.stats()
    out = ds.read([0, 199, 1], owned={0})
    after = ds.stats()
    assert [o["cls"] for o in out] == [0, 9, 1]
    assert after["remote_reads"] - before["remote_reads"] == 1  # sample 199 (shard 0 is cached now)
    # many remote samples: read in parallel, returned in the order asked
    ids = [120, 61, 199, 0, 77, 140]
    got = ds.read(ids, owned=set())
    assert [g["__key__"] for g in got] == [f"{i:09d}" for i in ids]
    assert all(_equal(g, ds.get_remote(i)) for g, i in zip(got, ids))
    ds.close()


def test_a_ranged_read_of_a_shard_with_a_large_table_fetches_only_its_offsets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.storage import streaming_remote

    _, index, uri = _s3_dataset(200, shard_size=40_000, payload=200)
    monkeypatch.setattr(streaming_remote, "OFFSETS_TABLE_MAX", 0)
    ds = StreamingDataset(uri, cache_dir=tmp_path / "c")
    got = ds.get_remote(33)
    st = ds.stats()
    assert _equal(got, ds[33]) and st["remote_reads"] == 1
    assert 16 < st["remote_bytes"] < 16 + 400  # the two offsets, then the ~300-byte record
    # a whole copy of such a shard is read through its own table in the map (not kept as a list)
    ids = [0, 33, 199, 100, 34]
    local = ds.read(ids, owned=set(range(len(index.shards))))
    assert [g["__key__"] for g in local] == [f"{i:09d}" for i in ids]
    assert all(_equal(g, ds.get_remote(i)) for g, i in zip(local, ids))
    assert all(m[3] is None for m in ds._proc().local.maps.values())


def test_fixed_size_records_are_read_remotely_with_one_request_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pack notes a shard's record size when all its records have one (fixed-size samples:
    tensors, tokenised text of one length); a ranged read then computes where its record lies:
    one GET a sample, no offsets table and no offset pair read first. An index whose
    record_size does not fit the shard's size is refused."""
    from pydantic import ValidationError

    from shoal.storage.datasets import ShardEntry
    from shoal.storage.s3 import S3Store

    store = make_s3_store("data/fixed")
    index = pack(({"x": np.full(16, i, np.float32), "y": i} for i in range(300)), store, shard_size=4000)
    varied = pack(streaming_data.samples(60), make_s3_store("data/varied"), shard_size=4000)
    assert len(index.shards) > 2 and all(s.record_size for s in index.shards)
    assert all(s.record_size is None for s in varied.shards)
    ds = StreamingDataset(f"s3://{store.bucket}/data/fixed", cache_dir=tmp_path / "c")
    asked: list[tuple[int, int]] = []
    real = S3Store.get_range
    monkeypatch.setattr(S3Store, "get_range",
                        lambda self, key, start, length: asked.append((start, length)) or real(self, key, start, length))
    ids = [5, 250, 6, 299]
    got = [ds.get_remote(i) for i in ids]
    assert len(asked) == len(ids) and {n for _, n in asked} == {index.shards[0].record_size}
    assert [g["y"] for g in got] == ids and np.array_equal(got[1]["x"], np.full(16, 250, np.float32))
    assert all(_equal(g, ds[i]) for g, i in zip(got, ids))  # as from the whole shard
    entry = index.shards[0].model_dump()
    with pytest.raises(ValidationError, match="record_size"):
        ShardEntry(**(entry | {"record_size": entry["record_size"] + 1}))
    with pytest.raises(ValidationError, match="record_size"):
        ShardEntry(**(entry | {"format": "webdataset"}))


def test_plan_prefetches_owned_shards_in_need_order(tmp_path: Path) -> None:
    _, index, uri = _s3_dataset(300, shard_size=3000)
    ds = StreamingDataset(uri, cache_dir=tmp_path / "c", predownload=100)
    shards = ds.shard_of(np.arange(300))
    owned = {1, 3, 5, 8}
    upcoming = [int(i) for i in np.arange(300) if shards[i] in owned or shards[i] == 2]
    ds.plan(upcoming, owned)
    assert ds.wait_prefetched(30)
    horizon = {int(s) for s in ds.shard_of(upcoming[:100])} & owned
    st = ds.stats()
    assert st["prefetched"] == st["downloads"] == len(horizon) >= 2
    assert st["bytes_downloaded"] == sum(index.shards[s].size for s in horizon)
    first = upcoming[0]
    ds[first]
    assert ds.stats()["cache_hits"] == 1 and ds.stats()["cache_misses"] == 0
    ds.close()


def test_pickles_for_spawned_loaders(tmp_path: Path) -> None:
    import pickle

    _, _, uri = _s3_dataset(50)
    ds = StreamingDataset(uri, cache_dir=tmp_path / "c", decode=_label)
    assert ds[3] == 3
    again = pickle.loads(pickle.dumps(ds))
    assert again[13] == 3 and len(again) == 50
    assert again.stats()["cache_hits"] + again.stats()["cache_misses"] == 2  # one cache dir, one set of counters


def _label(sample: dict) -> int:
    return sample["cls"]


def test_local_directory_is_read_in_place(tmp_path: Path) -> None:
    from shoal.storage.local import LocalStore

    pack(streaming_data.samples(100), LocalStore(tmp_path / "ds"), shard_size=3000)
    ds = StreamingDataset(f"file://{tmp_path / 'ds'}", cache_dir=tmp_path / "c")
    with pytest.raises(ObjectNotFound, match="does not exist"):
        StreamingDataset(str(tmp_path / "nothing"), cache_dir=tmp_path / "c")
    assert not (tmp_path / "nothing").exists()
    assert _equal(ds[42], {"__key__": f"{42:09d}", **streaming_data.sample(42)})
    ds.plan(list(range(100)), {0, 1})
    st = ds.stats()
    assert st["bytes_downloaded"] == 0 and st["shards_cached"] == 0 and st["cache_hits"] == 1


def test_corrupt_shard_raises_naming_it_and_is_not_cached(tmp_path: Path) -> None:
    store, index, uri = _s3_dataset(120, shard_size=3000)
    name = index.shards[2].name
    key = f"{name}"
    data = bytearray(store.get_bytes(key))
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(key, bytes(data))
    ds = StreamingDataset(uri, cache_dir=tmp_path / "c")
    victim = int(np.flatnonzero(ds.shard_of(np.arange(120)) == 2)[0])
    with pytest.raises(ShardCorrupt) as info:
        ds[victim]
    msg = str(info.value)
    assert name in msg and "sha256" in msg and "\n" not in msg
    assert not [p for p in (tmp_path / "c").iterdir() if not p.name.startswith(".")]
    assert not list((tmp_path / "c").glob(".part-*"))
    assert ds[0]["cls"] == 0  # the other shards still read
    # prefetch does not hide it: the read that needs it still raises
    ds.plan([victim], {2})
    assert ds.wait_prefetched(10)
    with pytest.raises(ShardCorrupt, match=name):
        ds[victim]
    # a missing shard: one line naming it
    store.delete(index.shards[3].name)
    last = int(np.flatnonzero(ds.shard_of(np.arange(120)) == 3)[0])
    with pytest.raises(ObjectNotFound, match=index.shards[3].name):
        ds[last]
    with pytest.raises(ObjectNotFound, match=index.shards[3].name):
        ds.get_remote(last)


def test_a_ranged_read_checks_its_records_crc32_and_names_the_shard(tmp_path: Path) -> None:
    """A whole copy is verified against the index's sha256, which covers its records (their
    crc32s are not checked again when read from it); a ranged read has only the record's
    crc32: a flipped byte in the record fails it with one line naming the shard."""
    store, index, uri = _s3_dataset(120, shard_size=3000)
    name = index.shards[2].name
    data = bytearray(store.get_bytes(name))
    data[len(data) - 10] ^= 0xFF  # inside the shard's last record
    store.put_bytes(name, bytes(data))
    ds = StreamingDataset(uri, cache_dir=tmp_path / "c")
    ids = np.flatnonzero(ds.shard_of(np.arange(120)) == 2).tolist()
    with pytest.raises(ShardCorrupt, match="crc32") as info:
        ds.get_remote(ids[-1])
    assert name in str(info.value) and "\n" not in str(info.value)
    assert ds.get_remote(ids[0])["cls"] == ids[0] % 10  # the shard's other records read
    with pytest.raises(ShardCorrupt, match="sha256"):
        ds[ids[0]]  # the whole shard does not match the index


def _reader(ds: StreamingDataset, ids: list[int], done, out, half: int = 0, planned=None, ahead: int = 0) -> None:
    """A forked loader: reads through the dataset object it inherited from its worker. With
    ``planned``, the k-th id (position ``2 k + half`` of the order) waits until the worker's
    last plan starts less than ``ahead`` positions before it: a loader runs a bounded number
    of batches ahead of the step that re-plans."""
    try:
        for k, i in enumerate(ids):
            while planned is not None and 2 * k + half >= planned.value + ahead:
                time.sleep(0.001)
            assert ds[i]["cls"] == i % 10
            done.value += 1
        out.put(("ok", os.getpid()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put(("error", repr(exc)))


def test_cache_limit_is_never_exceeded_by_two_forked_readers(tmp_path: Path) -> None:
    """Two forked loader processes of one worker read a shard-aware stream through one cache
    dir of 1/4 of the dataset while the worker re-plans as they go (as the training worker does
    every step) and prefetches ahead; a watcher thread samples what the directory holds."""
    _, index, uri = _s3_dataset(1200, shard_size=20_000, payload=600)
    total = sum(s.size for s in index.shards)
    limit = total // 4
    cache = tmp_path / "cache"
    ds = StreamingDataset(uri, cache_dir=cache, cache_limit=limit, predownload=200)
    len(ds)  # index read before the fork, as the training worker does
    shards = ds.shard_of(np.arange(len(ds)))
    rng = np.random.default_rng(1)
    order = np.concatenate([rng.permutation(np.flatnonzero(shards == s)) for s in rng.permutation(len(index.shards))])
    peak = [0]
    samples_taken = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            used = 0
            for p in cache.iterdir():
                if not p.name.startswith(".") or p.name.startswith(".part-"):
                    try:
                        used += p.stat().st_size
                    except FileNotFoundError:
                        pass
            peak[0] = max(peak[0], used)
            samples_taken[0] += 1

    # the readers stay less than `ahead` positions past the last plan's start, so what they
    # read lies in its prefetch horizon, whose shards fit in the cache with room to spare
    ahead = 100
    horizon = max(len(set(shards[order[p:p + 200]].tolist())) for p in range(len(order)))
    assert ahead <= 200 and horizon * max(s.size for s in index.shards) <= limit - max(s.size for s in index.shards)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    done = [ctx.Value("l", 0, lock=False) for _ in range(2)]
    planned = ctx.Value("l", 0, lock=False)
    halves = [order[0::2].tolist(), order[1::2].tolist()]
    kids = [ctx.Process(target=_reader, args=(ds, h, d, out, n, planned, ahead))
            for n, (h, d) in enumerate(zip(halves, done))]
    for k in kids:  # forked before this process has threads of its own, as the prefetcher's loaders
        k.start()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    owned = set(range(len(index.shards)))
    results: list = []

    def replan() -> bool:
        start = 2 * min(d.value for d in done)
        ds.plan(order[start:].tolist(), owned)
        planned.value = start
        while not out.empty():
            results.append(out.get())
        return len(results) == 2

    wait_until(replan, timeout=120, what="both readers finished", interval=0.01)
    for k in kids:
        k.join(10)
    stop.set()
    watcher.join(5)
    ds.close()
    assert all(r[0] == "ok" for r in results), results
    assert samples_taken[0] > 50
    assert 0 < peak[0] <= limit, (peak[0], limit)
    st = ds.stats()
    assert st["cache_hits"] + st["cache_misses"] == 1200 and st["remote_reads"] == 0  # both children's counters summed
    assert st["evictions"] > 0 and st["cached_bytes"] <= limit
    # each shard downloaded exactly once: the two readers and the prefetch share the downloads,
    # and with the plan kept this fresh only shards nobody needs any more are evicted. (A plan
    # as stale as a whole cache of reads ranks shards already read as needed soonest, and a
    # read then evicts the shard its sibling is still reading: a plan must be renewed.)
    assert st["downloads"] == len(index.shards) and st["bytes_downloaded"] == total, st


class _FlakyProxy:
    """A TCP forwarder to ``target`` that resets the first ``fail`` connections, or with
    ``cut_after`` forwards them but drops each after that many response bytes."""

    def __init__(self, target_port: int, fail: int, cut_after: int | None = None) -> None:
        self.target = ("127.0.0.1", target_port)
        self.fail = fail
        self.cut_after = cut_after
        self.accepted = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(32)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.accepted <= self.fail and self.cut_after is None:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()
                continue
            up = socket.create_connection(self.target, timeout=10)
            cut = self.cut_after if self.accepted <= self.fail else None
            threading.Thread(target=self._pipe, args=(conn, up), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, conn, cut), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, cut: int | None = None) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                if cut is not None and sent + len(data) >= cut:
                    dst.sendall(data[: cut - sent])
                    break
                sent += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def test_transient_s3_errors_are_retried_with_backoff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, index, uri = _s3_dataset(100, shard_size=3000)
    moto_port = int(s3_env()["S3_ENDPOINT"].rsplit(":", 1)[1])
    proxy = _FlakyProxy(moto_port, fail=12)  # more than the HTTP client's own 3 retries
    monkeypatch.setenv("S3_ENDPOINT", f"http://127.0.0.1:{proxy.port}")
    try:
        ds = StreamingDataset(uri, cache_dir=tmp_path / "c", retry_timeout_s=30)
        assert _equal(ds[5], {"__key__": f"{5:09d}", **streaming_data.sample(5)})
        assert ds.get_remote(90)["cls"] == 0
        st = ds.stats()
        assert st["retries"] >= 1 and proxy.accepted > 12
        assert st["bytes_downloaded"] == index.shards[0].size
    finally:
        proxy.close()


def test_a_download_cut_mid_body_is_retried_and_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, index, uri = _s3_dataset(200, shard_size=100_000, payload=2000)
    assert index.shards[0].size > 60_000
    moto_port = int(s3_env()["S3_ENDPOINT"].rsplit(":", 1)[1])
    ds = StreamingDataset(uri, cache_dir=tmp_path / "c", retry_timeout_s=30)
    len(ds)  # the index through the direct endpoint
    proxy = _FlakyProxy(moto_port, fail=1000, cut_after=30_000)  # every body cut short
    monkeypatch.setenv("S3_ENDPOINT", f"http://127.0.0.1:{proxy.port}")
    try:
        fresh = StreamingDataset(uri, cache_dir=tmp_path / "c2", retry_timeout_s=1)
        with pytest.raises(Exception, match="gave up after 1 s of retries"):  # cut bodies are retried
            fresh[0]
        assert fresh.stats()["retries"] >= 1
        assert not list((tmp_path / "c2").glob(".part-*")) and fresh.stats()["shards_cached"] == 0
        proxy.fail = proxy.accepted + 2  # the next two connections are cut, then all is well
        again = StreamingDataset(uri, cache_dir=tmp_path / "c3", retry_timeout_s=30)
        assert _equal(again[1], {"__key__": f"{1:09d}", **streaming_data.sample(1, 2000)})
        st = again.stats()
        assert st["bytes_downloaded"] == index.shards[0].size and st["downloads"] == 1
        assert proxy.accepted > proxy.fail  # it got through the cut connections
    finally:
        proxy.close()


def test_gives_up_after_the_retry_budget_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, uri = _s3_dataset(20)
    proxy = _FlakyProxy(1, fail=10**9)
    monkeypatch.setenv("S3_ENDPOINT", f"http://127.0.0.1:{proxy.port}")
    try:
        ds = StreamingDataset(uri, cache_dir=tmp_path / "c", retry_timeout_s=1)
        with pytest.raises(Exception) as info:
            len(ds)
        assert "gave up after 1 s of retries" in str(info.value) and "\n" not in str(info.value)
        assert "SECRET" not in str(info.value)
    finally:
        proxy.close()


def test_a_demand_read_evicts_the_shards_its_plan_has_finished_not_the_next_ones(tmp_path: Path) -> None:
    """The plan (renewed from the committed cursor) still lists shards a loader reading ahead
    has finished: a demand read at a shard's first need evicts the shards last needed before
    it, not the shard needed right after it (which it would fetch again a moment later). A
    prefetch does not trust a stale plan that far: it still never evicts a listed shard."""
    from shoal.storage.streaming_cache import Counters, ShardCache

    cache = ShardCache(tmp_path / "c", 300)
    counters = Counters(cache.root)
    for sha in ("a1", "a2", "b1"):  # the cache full: two shards of the old window, one of the new
        cache.commit(cache.reserve(sha, 100, demand=True, counters=counters, label=sha), sha, ".shoal")
    os.utime(cache.path("a2", ".shoal"), (1, 1))  # a2 used longest ago
    cache.write_needs({"a1": (0, 5), "a2": (1, 6), "b1": (7, 9), "b2": (8, 10)})
    assert cache.reserve("b2", 100, demand=False, counters=counters, label="b2") is None
    part = cache.reserve("b2", 100, demand=True, counters=counters, label="b2")
    assert part is not None
    held = {p.name for p in cache.root.iterdir() if not p.name.startswith(".")}
    assert held == {"a1.shoal", "b1.shoal"}  # a2: finished, and used longest ago
    cache.commit(part, "b2", ".shoal")
    assert cache.usage() == (300, 3)


def test_a_copy_evicted_while_mapped_is_let_go_and_fetched_again(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy another process evicted stays mapped (and readable) until this process checks
    it again - at most once a second per shard, a syscall each - then is let go and fetched."""
    import shoal.storage.streaming_local as streaming_local

    now = [1000.0]
    monkeypatch.setattr(streaming_local.time, "monotonic", lambda: now[0])
    _, index, uri = _s3_dataset(100, shard_size=3000)
    ds = StreamingDataset(uri, cache_dir=tmp_path / "c")
    assert ds[0]["cls"] == 0 and ds.stats()["downloads"] == 1
    copy = next(p for p in (tmp_path / "c").iterdir() if not p.name.startswith("."))
    copy.unlink()  # what another process's eviction does
    assert ds[1]["cls"] == 1
    st = ds.stats()
    assert st["downloads"] == 2 and st["cache_misses"] == 2 and st["cache_hits"] == 0
    assert os.path.exists(copy)
    copy.unlink()  # evicted again: within the second, read from the map still
    assert ds[2]["cls"] == 2 and ds.stats()["downloads"] == 2 and not os.path.exists(copy)
    now[0] += 1.5
    assert ds[3]["cls"] == 3 and ds.stats()["downloads"] == 3 and os.path.exists(copy)
    ds.close()
    assert ds[4]["cls"] == 4  # still readable after close


def test_reading_a_shuffle_windows_shards_round_robin_maps_each_shard_once(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard-aware order interleaves the shards of a window (16) sample by sample, and a
    one-worker job reads them all: each stays mapped (mapping again per sample cost about 5x
    the per-sample read)."""
    import shoal.storage.streaming_local as streaming_local
    from shoal.worker.stream_order import DEFAULT_WINDOW

    _, index, uri = _s3_dataset(32 * DEFAULT_WINDOW, shard_samples=32)
    assert len(index.shards) == DEFAULT_WINDOW and streaming_local.MAPPED_SHARDS >= 2 * DEFAULT_WINDOW
    ds = StreamingDataset(uri, cache_dir=tmp_path / "c")
    mapped = []
    real = streaming_local.LocalReader._map
    monkeypatch.setattr(streaming_local.LocalReader, "_map", lambda self, shard, *rest: mapped.append(shard) or
                        real(self, shard, *rest))
    ids = [shard * 32 + k for k in range(32) for shard in range(DEFAULT_WINDOW)]  # round robin
    got = ds.read(ids, set(range(DEFAULT_WINDOW)))
    assert [s["cls"] for s in got] == [streaming_data.sample(i)["cls"] for i in ids]
    assert sorted(mapped) == list(range(DEFAULT_WINDOW))


def test_default_cache_dirs_of_killed_workers_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    monkeypatch.setenv("SHOAL_STREAM_CACHE_ROOT", str(tmp_path / "caches"))
    _, _, uri = _s3_dataset(30)
    code = ("import os, sys; from shoal.storage.streaming import StreamingDataset; "
            "d = StreamingDataset(sys.argv[1]); d[0]; print(d.cache_dir, flush=True); os.kill(os.getpid(), 9)")
    res = subprocess.run([sys.executable, "-c", code, uri], capture_output=True, text=True, timeout=60)
    left = Path(res.stdout.strip())
    assert res.returncode == -9 and left.parent == tmp_path / "caches" and any(left.iterdir())
    ds = StreamingDataset(uri)
    assert not left.exists() and ds.cache_dir.parent == tmp_path / "caches" and ds[1]["cls"] == 1


def test_a_dead_downloaders_reservation_is_reclaimed(tmp_path: Path) -> None:
    """A loader killed mid-download leaves a ``.part`` reservation; the next reservation
    removes it instead of waiting for space that never frees."""
    import subprocess
    import sys

    _, index, uri = _s3_dataset(100, shard_size=3000)
    limit = max(s.size for s in index.shards) + 10
    cache = tmp_path / "c"
    ds = StreamingDataset(uri, cache_dir=cache, cache_limit=limit)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = cache / f".part-{'0' * 64}-{int(dead.stdout)}-1"
    stale.write_bytes(b"\0" * (limit - 5))
    assert ds[0]["cls"] == 0  # needs the space the dead process had reserved
    assert not stale.exists()
    assert ds.stats()["cached_bytes"] <= limit


@pytest.mark.parametrize("kind", ["memory", "local", "s3"])
def test_get_range_on_every_backend(kind: str, tmp_path: Path) -> None:
    from tests.storage.support import make_store

    store = make_store(kind, tmp_path)
    data = bytes(range(256)) * 4
    store.put_bytes("a/obj", data)
    with store.open_read("a/obj") as f:
        assert f.read(100) + f.read(10_000) == data
    with pytest.raises(ObjectNotFound):
        with store.open_read("a/missing"):
            pass
    assert store.get_range("a/obj", 10, 20) == data[10:30]
    assert store.get_range("a/obj", 1000, 100) == data[1000:]  # fewer only at the end
    assert store.get_range("a/obj", 5, 0) == b""
    with pytest.raises(ObjectNotFound):
        store.get_range("a/missing", 0, 4)
    with pytest.raises(ValueError):
        store.get_range("a/obj", -1, 4)


def test_a_shard_whose_offsets_table_is_out_of_order_fails_naming_it(tmp_path: Path) -> None:
    """A packed shard's record offsets are checked once, when its copy is mapped (reads then
    slice records without checking each): a table that is not ascending inside the shard -
    written so by a broken writer, with an index whose sha256 matches it - fails the read with
    one line naming the shard, whatever sample of it is asked for."""
    import hashlib
    import json
    import struct

    from shoal.storage.uri import open_store

    folder = tmp_path / "set"
    folder.mkdir()
    index = pack(streaming_data.samples(60, 64), open_store(f"file://{folder}"), shard_size=2000)
    name = index.shards[1].name
    shard = folder / name
    data = bytearray(shard.read_bytes())
    first, second = struct.unpack_from("<QQ", data, 16 + 8)  # offsets[1], offsets[2]
    struct.pack_into("<QQ", data, 16 + 8, second, first)
    shard.write_bytes(bytes(data))
    doc = json.loads((folder / "index.json").read_text())
    doc["shards"][1]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (folder / "index.json").write_text(json.dumps(doc))
    ds = StreamingDataset(str(folder), cache_dir=tmp_path / "c")
    ids = np.flatnonzero(ds.shard_of(np.arange(60)) == 1)
    for i in (ids[0], ids[-1]):
        with pytest.raises(ShardCorrupt, match=f"{name}: its records' offsets are not ascending") as info:
            ds.read([int(i)], {1})
        assert "\n" not in str(info.value)
    assert ds.read([0], {0})[0]["cls"] == 0  # the other shards still read
