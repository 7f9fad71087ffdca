"""StreamingDataset against the real S3 server (moto) and local directories: the same samples
from packed and WebDataset shards, ranged reads, prefetch by plan, the cache limit under two
forked readers, corrupt and missing shards, and retries through a flaky endpoint."""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
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


def _s3_dataset(n: int, *, fmt: str = "packed", shard_size: int = 8000, payload: int = 64):
    store = make_s3_store("data/set")
    index = pack(streaming_data.samples(n, payload), store, format=fmt, shard_size=shard_size)
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


def test_local_directory_is_read_in_place(tmp_path: Path) -> None:
    from shoal.storage.local import LocalStore

    pack(streaming_data.samples(100), LocalStore(tmp_path / "ds"), shard_size=3000)
    ds = StreamingDataset(f"file://{tmp_path / 'ds'}", cache_dir=tmp_path / "c")
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


def _reader(uri: str, cache: str, limit: int, ids: list[int], done, out) -> None:
    try:
        ds = StreamingDataset(uri, cache_dir=cache, cache_limit=limit)
        for i in ids:
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

    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    done = [ctx.Value("l", 0, lock=False) for _ in range(2)]
    halves = [order[0::2].tolist(), order[1::2].tolist()]
    kids = [ctx.Process(target=_reader, args=(uri, str(cache), limit, h, d, out)) for h, d in zip(halves, done)]
    for k in kids:  # forked before this process has threads of its own, as the prefetcher's loaders
        k.start()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    owned = set(range(len(index.shards)))
    results: list = []

    def replan() -> bool:
        ds.plan(order[2 * min(d.value for d in done):].tolist(), owned)
        while not out.empty():
            results.append(out.get())
        return len(results) == 2

    wait_until(replan, timeout=120, what="both readers finished")
    for k in kids:
        k.join(10)
    stop.set()
    watcher.join(5)
    ds.close()
    assert all(r[0] == "ok" for r in results), results
    assert samples_taken[0] > 50
    assert 0 < peak[0] <= limit, (peak[0], limit)
    st = ds.stats()
    assert st["cache_hits"] + st["cache_misses"] == 1200  # both children's counters summed
    assert st["evictions"] > 0 and st["cached_bytes"] <= limit
    # each shard downloaded about once (the two readers and the prefetch share the downloads)
    assert st["bytes_downloaded"] <= 1.1 * total, (st["bytes_downloaded"], total)


class _FlakyProxy:
    """A TCP forwarder to ``target`` that resets the first ``fail`` connections."""

    def __init__(self, target_port: int, fail: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.fail = fail
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
            if self.accepted <= self.fail:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()
                continue
            up = socket.create_connection(self.target, timeout=10)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
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
