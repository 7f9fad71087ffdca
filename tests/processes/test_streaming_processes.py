"""Streaming datasets with real workers (issue 15): the shard-aware order and the split of each
global batch by shard owner, through joins, kills and leaves mid-epoch.

Checked on the end state: the ledgers (every sample exactly once per epoch, each step's slices
partitioning its batch), the global batches step by step against a run with another, fixed
world size, and the shard owners in the tables (sticky: only a leaver's shards move).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from shoal.coordinator.owners import from_ranges
from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.events.models import ShardTable
from shoal.ops.localproc import LocalProcs
from shoal.storage.errors import StorageError
from shoal.storage.streaming_cache import file_lock
from shoal.worker import ledger
from tests.helpers import ControlWatcher, job_spec, run_job, wait_until

pytestmark = pytest.mark.slow

NUM_SAMPLES = 5000


#: the streamed digits job (job_spec: over the tests' common defaults)
STREAM_JOB = dict(entrypoint="tests.entrypoints:stream_digits_store", min_workers=1, global_batch_size=64, epochs=2,
                  seed=11, loader_workers=1, prefetch_steps=2)


def _tables(r, job: str) -> list[ShardTable]:
    return [ShardTable.model_validate_json(f[b"data"]) for _id, f in r.xrange(job_keys(job).generations)]


# ---- from the real S3 server -----------------------------------------------------------------


def _s3_dataset(tmp: Path, fmt: str = "packed", store_out: list | None = None) -> tuple[str, int]:
    """Pack the glyphs into a fresh bucket of the moto server: (uri, dataset bytes); the
    store is appended to ``store_out`` when given."""
    import uuid

    from shoal.storage.s3 import S3Store
    from shoal.storage.s3_config import S3Config
    from tests.storage.support import s3_env
    from tests.stream_data import pack_digits

    bucket = f"ds-{uuid.uuid4().hex[:12]}"
    store = S3Store(bucket, "digits", S3Config.from_env(s3_env()), create_bucket=True)
    index = pack_digits(store, fmt)
    if store_out is not None:
        store_out.append((store, index))
    return f"s3://{bucket}/digits", sum(s.size for s in index.shards)


def _downloaded(cache_root: Path) -> dict[str, dict[str, int]]:
    """Every worker's dataset counters (its cache directory's), by worker pid."""
    from shoal.storage.streaming_cache import sum_counters

    return {d.name: sum_counters(d) for d in cache_root.iterdir() if d.is_dir()}


def _s3_run(r, redis_url, tmp: Path, spec: JobSpec, workers: int, uri: str, script=None, **env):
    from tests.storage.support import s3_env

    extra = {"SHOAL_LEDGER_DIR": str(tmp / "ledger"), "SHOAL_TEST_STEP_DELAY": "0.03",
             "SHOAL_TEST_STREAM_URI": uri, "SHOAL_TEST_CACHE_ROOT": str(tmp / "cache"), **s3_env(), **env}
    return run_job(r, redis_url, tmp, spec, workers, extra, script, end_states=("completed", "failed"))


def test_s3_bytes_per_epoch_three_workers_and_after_a_leave(r, redis_url, tmp_path):
    """Acceptance 2: one epoch with 3 workers and no membership change downloads at most 1.1x
    the dataset's bytes (each shard once by its owner, a few samples by ranged reads); with a
    worker leaving mid-epoch, at most 1.5x."""
    uri, size = _s3_dataset(tmp_path)
    job = "s3bytes-" + tmp_path.name[-8:]
    spec = job_spec(job, STREAM_JOB, entrypoint="tests.entrypoints:stream_digits_store", epochs=1, min_workers=3)
    shown: dict = {}

    def visible(watch, procs, ws):  # shoal status (text, --json) and the metrics show the input
        from shoal.ops.metrics import MetricsServer
        from shoal.ops.status import format_status, job_status

        def streaming() -> bool:
            s = job_status(r, job)
            live = [w for w in s["workers"] if w.get("bytes_downloaded")]
            if len(live) == 3 and all(w["shards_owned"] for w in live):
                shown.update(json=s, text=format_status(s), metrics=MetricsServer(r).render())
                return True
            return False

        wait_until(streaming, 120, "3 workers' streaming figures in status")

    _s3_run(r, redis_url, tmp_path / "steady", spec, 3, uri, visible)
    assert "streaming input (downloaded / cache hits / shards owned" in shown["text"], shown["text"]
    assert sum(w["shards_owned"] for w in shown["json"]["workers"]) == 82
    assert 'shoal_stream_bytes_downloaded{job="' in shown["metrics"]
    assert "shoal_stream_balance_error{" in shown["metrics"]
    per = _downloaded(tmp_path / "steady" / "cache")
    total = sum(c["bytes_downloaded"] + c["remote_bytes"] for c in per.values())
    remote = sum(c["remote_reads"] for c in per.values())
    print(f"3 workers: {total / size:.3f}x the dataset ({size} bytes), {remote} remote samples")
    assert len(per) == 3 and all(c["bytes_downloaded"] > 0 for c in per.values())
    assert total <= 1.1 * size
    assert ledger.verify(ledger.read(tmp_path / "steady" / "ledger"), NUM_SAMPLES).ok

    job2 = job + "-leave"

    def leave(watch, procs, ws):
        wait_until(lambda: len(ledger.read(tmp_path / "leave" / "ledger")) >= 3 * 25, 120, "25 steps")
        ws[2].signal(signal.SIGTERM)
        watch.wait_for(lambda d: d.kind == "left", 60)

    _, _, codes = _s3_run(r, redis_url, tmp_path / "leave", job_spec(job2, STREAM_JOB, entrypoint=spec.entrypoint,
                                                                      epochs=1, min_workers=2), 3, uri, leave)
    assert codes["p2"] == 0
    per = _downloaded(tmp_path / "leave" / "cache")
    total = sum(c["bytes_downloaded"] + c["remote_bytes"] for c in per.values())
    print(f"3 workers, one leaving mid-epoch: {total / size:.3f}x the dataset")
    assert total <= 1.5 * size
    verdict = ledger.verify(ledger.read(tmp_path / "leave" / "ledger"), NUM_SAMPLES)
    assert verdict.ok and verdict.epochs_complete == 1, verdict.problem


def test_kill_join_and_leave_mid_epoch_exactly_once_and_same_batches_as_a_fixed_world(r, redis_url, tmp_path):
    """Acceptance 1, from the real S3 server."""
    uri, _ = _s3_dataset(tmp_path)
    job = "stream-" + tmp_path.name[-8:]

    def script(watch, procs, ws):
        watch.wait_for(lambda d: d.world_size == 2, 120)
        joiner = procs.worker(job, "joiner")  # a join mid-epoch
        watch.wait_for(lambda d: d.world_size == 3, 60)
        watch.wait_for(lambda d: d.kind == "ready" and "w2 active" in d.reason, 60)
        wait_until(lambda: any(e["world"] == 3 for e in ledger.read(tmp_path / "elastic" / "ledger")), 60,
                   "a step committed by three workers")
        joiner.signal(signal.SIGKILL)  # a failure
        watch.wait_for(lambda d: "w2" in d.failed, 60)
        ws[0].signal(signal.SIGTERM)  # a graceful leave
        watch.wait_for(lambda d: d.kind == "left", 60)

    # 0.1 s a step: the script's join, kill and leave must all land before the 158 steps end;
    # on 2 busy cores the joiner alone takes 5-10 s to start (0.03 s a step: the job finished
    # first, once, under the parallel suite)
    _, _, codes = _s3_run(r, redis_url, tmp_path / "elastic", job_spec(job, STREAM_JOB), 2, uri, script, SHOAL_TEST_STEP_DELAY="0.1")
    assert codes["p0"] == 0 and codes["p1"] == 0
    entries = ledger.read(tmp_path / "elastic" / "ledger")
    verdict = ledger.verify(entries, NUM_SAMPLES)
    assert verdict.ok, verdict.problem
    assert verdict.epochs_complete == 2 and verdict.steps == 2 * 79
    assert {e["world"] for e in entries} >= {2, 3, 1}  # trained at three world sizes

    # owners: every table covers each shard once, and membership changes move only what they must
    tables = [t for t in _tables(r, job) if not t.paused]
    assert all(t.shard_owners is not None for t in tables)
    for t in tables:
        shards = sorted(s for ranges in t.shard_owners.values() for s in from_ranges(ranges))
        assert shards == list(range(82))
    for before, after in zip(tables, tables[1:]):
        left = set(before.shard_owners) - set(after.shard_owners)
        joined = set(after.shard_owners) - set(before.shard_owners)
        if left and not joined:  # survivors keep all theirs
            for w in after.shard_owners:
                assert set(from_ranges(before.shard_owners[w])) <= set(from_ranges(after.shard_owners[w]))

    # the same job with one worker, no membership change: identical global batches step by step
    fixed = job + "-w1"
    _s3_run(r, redis_url, tmp_path / "fixed", job_spec(fixed, STREAM_JOB, max_workers=1), 1, uri, SHOAL_TEST_STEP_DELAY="0")
    ref = {e["step"]: e["batch"] for e in ledger.read(tmp_path / "fixed" / "ledger")}
    got = {e["step"]: e["batch"] for e in entries}
    assert len(ref) == len(got) == 2 * 79
    assert got == ref


def test_corrupt_shard_fails_the_job_naming_it_and_keeps_the_latest_checkpoint(r, redis_url, tmp_path):
    """Acceptance 5: a shard whose bytes no longer match the index (same size, other content)
    fails the job with a one-line reason naming the shard; the checkpoints written before
    stay, and LATEST still loads."""
    from shoal.storage.checkpoint import load_latest
    from shoal.storage.uri import open_store
    from shoal.worker.stream_order import epoch_windows
    from tests.storage.support import s3_env

    got: list = []
    uri, _ = _s3_dataset(tmp_path, store_out=got)
    store, index = got[0]
    # a shard of the epoch's last window: first read well after the first checkpoints
    last = int(epoch_windows([s.samples for s in index.shards], 11, 0, 16)[-1][0])
    name = index.shards[last].name
    key = next(k for k in store.list() if k.endswith(name))
    store.put_bytes(key, bytes(len(store.get_bytes(key))))
    job = "corrupt-" + tmp_path.name[-8:]
    ckpt = f"file://{tmp_path / 'ckpt'}"
    spec = job_spec(job, STREAM_JOB, epochs=1, min_workers=2, max_workers=2, checkpoint_uri=ckpt, checkpoint_interval=10)
    create_job(r, spec)
    watch = ControlWatcher(r, job)
    env = {"SHOAL_TEST_STEP_DELAY": "0.02", "SHOAL_TEST_STREAM_URI": uri, **s3_env()}
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        agent = procs.start("agent", "agent", job, "--workers", "2", "--max-restarts", "0", "--backoff", "0.1",
                            "--node", "n1", "--run-dir", str(tmp_path / "agent"))
        try:
            failed = watch.wait_for(lambda d: d.job_state == "failed", 180)
            agent.wait(60)
        except BaseException:
            for p in procs.procs:
                print(f"===== {p.name}\n{p.log_tail(30)}")
            raise
    status = r.hgetall(job_keys(job).state)
    first = status[b"first_failure"].decode()
    print(first)
    assert name in first and "\n" not in first, first
    assert failed.job_state == "failed"
    state, _ = load_latest(open_store(ckpt))
    assert state.step >= 10  # a checkpoint from before the corrupt shard, loadable


#: acceptance 3's sizes: a 50 MiB cache, a dataset of at least 200 MiB in 4 MiB shards
CACHE_LIMIT = 50 * 2**20
BLOB_SHARD_SIZE = 4 * 2**20


class _CacheWatch:
    """Samples every worker's cache directory (``<root>/<pid>``, see
    ``tests.stream_data.dataset_from_env``) every ``every`` seconds on a thread, until the
    block ends. A sample is the bytes of the cached shards plus the ``.part`` reservations of
    downloads in flight, listed under the cache's own ``.lock`` (every change of what the
    directory holds takes it, so the listing is a state the cache was in; without it a
    listing racing an eviction and the reservation it made room for counts both). A shard
    seen both as ``.part`` and renamed into place (the rename takes no lock) counts once.

    Also sampled: the bytes of evicted shard copies that the worker or its loader processes
    still map (``/proc/<pid>/maps``, "(deleted)"): disk space the directory listing no longer
    shows (``shoal.storage.streaming_local.MAPPED_SHARDS``)."""

    def __init__(self, root: Path, every: float = 0.02) -> None:
        import threading

        self.root, self.every = root, every
        self.peak: dict[str, int] = {}  # worker pid -> largest sample (shards + reservations)
        self.peak_mapped: dict[str, int] = {}  # ... of shards + reservations + evicted copies still mapped
        self.samples: dict[str, int] = {}
        self.gaps: list[float] = []  # seconds between successive sampling rounds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cache-watch")

    def __enter__(self) -> _CacheWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        import time

        last = None
        while not self._stop.is_set():
            now = time.monotonic()
            if last is not None:
                self.gaps.append(now - last)
            last = now
            dirs = [d for d in self.root.iterdir() if d.is_dir()] if self.root.exists() else []
            for d in dirs:
                try:
                    used = self._held(d)
                except (FileNotFoundError, StorageError):
                    continue
                mapped = used + self._mapped_evicted(d)
                self.peak[d.name] = max(self.peak.get(d.name, 0), used)
                self.peak_mapped[d.name] = max(self.peak_mapped.get(d.name, 0), mapped)
                self.samples[d.name] = self.samples.get(d.name, 0) + 1
            self._stop.wait(max(0.0, self.every - (time.monotonic() - now)))

    @staticmethod
    def _held(d: Path) -> int:
        """Bytes of the shards and reservations in ``d``, listed under the cache's own lock
        (a listing racing an eviction and its reservation would count both)."""
        per_shard: dict[str, int] = {}
        with file_lock(d / ".lock", 1.0, f"the cache lock of {d}"), os.scandir(d) as entries:
            for e in entries:
                if e.name.startswith(".part-"):
                    sha = e.name.split("-")[1]
                elif e.name.startswith("."):
                    continue  # bookkeeping: locks, counters, the plan
                else:
                    sha = e.name.split(".")[0]
                try:
                    size = e.stat().st_size
                except FileNotFoundError:
                    continue
                per_shard[sha] = max(per_shard.get(sha, 0), size)
        return sum(per_shard.values())

    @staticmethod
    def _mapped_evicted(d: Path) -> int:
        """Bytes of deleted files of ``d`` mapped by its worker (pid = its name) and children."""
        pids = [d.name]
        for children in Path(f"/proc/{d.name}/task").glob("*/children"):
            try:
                pids += children.read_text().split()
            except OSError:
                pass
        files: dict[tuple[str, str], int] = {}
        prefix = f"{d}/"
        for pid in pids:
            try:
                lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
            except OSError:
                continue
            for line in lines:
                if not line.endswith(" (deleted)") or prefix not in line:
                    continue
                span, _perms, _off, dev, inode = line.split(maxsplit=5)[:5]
                lo, hi = (int(x, 16) for x in span.split("-"))
                files[(dev, inode)] = max(files.get((dev, inode), 0), hi - lo)
        return sum(files.values())


def test_a_50_mib_cache_on_a_200_mib_dataset_is_never_exceeded_and_training_completes(r, redis_url, tmp_path):
    """Acceptance 3: 2 workers train one epoch of a 200 MiB dataset (3200 samples of 64 KiB
    in 4 MiB shards, from the real S3 server) with a 50 MiB cache each. Each worker reads
    about half the dataset whole, twice its cache, so it must evict; the bytes in each cache
    (shards and reservations, sampled every 20 ms) never exceed the limit, the counters show
    the evictions, the job completes with every sample exactly once, and the bytes downloaded
    stay within acceptance 2's 1.1x the dataset."""
    import uuid

    from shoal.storage.s3 import S3Store
    from shoal.storage.s3_config import S3Config
    from shoal.storage.streaming_cache import sum_counters
    from tests.storage.support import s3_env
    from tests.stream_data import BLOB_SAMPLES, pack_blobs

    bucket = f"ds-{uuid.uuid4().hex[:12]}"
    index = pack_blobs(S3Store(bucket, "blobs", S3Config.from_env(s3_env()), create_bucket=True), BLOB_SHARD_SIZE)
    size = sum(s.size for s in index.shards)
    largest = max(s.size for s in index.shards)
    assert size >= 200 * 2**20 and largest <= BLOB_SHARD_SIZE
    job = "cache-" + tmp_path.name[-8:]
    spec = job_spec(job, STREAM_JOB, entrypoint="tests.entrypoints:stream_blobs_store", epochs=1, min_workers=2, max_workers=2)
    cache_root = tmp_path / "run" / "cache"

    def until_the_workers_exit(watch, procs, ws):  # a worker failing ends the test at once
        def exited() -> bool:
            codes = [w.popen.poll() for w in ws]
            bad = [(w.name, c) for w, c in zip(ws, codes) if c not in (None, 0)]
            assert not bad, f"worker exited {bad}: {ws[codes.index(bad[0][1])].log_tail(5)}"
            return None not in codes

        wait_until(exited, 240, "the workers to finish the epoch")

    with _CacheWatch(cache_root) as cw:
        watch, _, codes = _s3_run(r, redis_url, tmp_path / "run", spec, 2, f"s3://{bucket}/blobs",
                                  until_the_workers_exit, SHOAL_TEST_CACHE_LIMIT=str(CACHE_LIMIT))
    states = {d.job_state for d in watch.seen}
    assert "completed" in states and "failed" not in states, watch.seen[-3:]
    assert set(codes.values()) == {0}, codes
    verdict = ledger.verify(ledger.read(tmp_path / "run" / "ledger"), BLOB_SAMPLES)
    assert verdict.ok and verdict.epochs_complete == 1, verdict.problem

    counters = {d.name: sum_counters(d) for d in cache_root.iterdir() if d.is_dir()}
    gaps = sorted(cw.gaps)
    for pid, c in counters.items():
        print(f"worker {pid}: {cw.samples.get(pid, 0)} samples, peak {cw.peak.get(pid, 0)} bytes "
              f"(with evicted copies still mapped: {cw.peak_mapped.get(pid, 0)}) of {CACHE_LIMIT}; "
              f"downloaded {c['bytes_downloaded']} in {c['downloads']} shards, {c['evictions']} evictions, "
              f"{c['remote_reads']} remote samples")
    print(f"dataset {size} bytes in {len(index.shards)} shards; sampling gaps median {gaps[len(gaps) // 2]:.3f} s, "
          f"p99 {gaps[int(len(gaps) * 0.99)]:.3f} s, max {gaps[-1]:.3f} s")
    assert len(counters) == 2 and set(cw.peak) == set(counters)
    assert gaps[len(gaps) // 2] <= 0.05
    for pid, c in counters.items():
        assert cw.samples[pid] > 50 and cw.peak[pid] > CACHE_LIMIT // 2, (pid, cw.samples[pid], cw.peak[pid])
        assert cw.peak[pid] <= CACHE_LIMIT, (pid, cw.peak[pid])
        # more than the cache downloaded: at least the excess was evicted, shard by shard
        assert c["bytes_downloaded"] > 1.5 * CACHE_LIMIT
        assert c["evictions"] * largest >= c["bytes_downloaded"] - CACHE_LIMIT, c
    # and the limit costs no extra downloads: each shard once, by its owner (a loader reading
    # ahead of the plan once evicted what it had just downloaded: 1.7x)
    total = sum(c["bytes_downloaded"] + c["remote_bytes"] for c in counters.values())
    print(f"downloaded {total / size:.3f}x the dataset")
    assert total <= 1.1 * size


def test_webdataset_and_packed_copies_train_the_same_loss_curve(r, redis_url, tmp_path):
    """Acceptance 4: the same samples as WebDataset tars and as packed shards (same samples per
    shard, so the same order) train the same model to the same losses, step by step."""
    curves, finals, batches = {}, {}, {}
    for fmt in ("packed", "webdataset"):
        uri, _ = _s3_dataset(tmp_path / fmt, fmt)
        job = f"{fmt[:4]}-" + tmp_path.name[-8:]
        _s3_run(r, redis_url, tmp_path / fmt, job_spec(job, STREAM_JOB, epochs=1, max_steps=40, min_workers=2,
                                                       max_workers=2), 2,
                uri, SHOAL_TEST_STEP_DELAY="0", SHOAL_EXPORT_DIR=str(tmp_path / fmt / "final"))
        # the progress history samples the losses; the final weights sum up every step
        curves[fmt] = {int(f[b"step"]): float(f[b"loss"]) for _id, f in r.xrange(job_keys(job).progress)
                       if b"loss" in f and f.get(b"kind", b"step") != b"eval"}
        finals[fmt] = [torch.load(f, weights_only=True) for f in sorted((tmp_path / fmt / "final").glob("final-*.pt"))]
        batches[fmt] = {e["step"]: e["batch"] for e in ledger.read(tmp_path / fmt / "ledger")}
    assert batches["packed"] == batches["webdataset"] and len(batches["packed"]) == 40  # the same order
    common = sorted(set(curves["packed"]) & set(curves["webdataset"]))
    assert common and all(curves["packed"][s] == curves["webdataset"][s] for s in common), curves
    assert len(finals["packed"]) == len(finals["webdataset"]) == 2
    for name, value in finals["packed"][0].items():
        assert torch.equal(value, finals["webdataset"][0][name]), name  # bit-identical training


def test_full_restart_resumes_at_the_cursors_shard_and_position_without_replaying_the_epoch(r, redis_url, tmp_path):
    """Every process killed mid-epoch, Redis wiped, one worker instead of two: the resumed run
    starts at the checkpoint's cursor, together the runs use every sample of the epoch once,
    and the restarted worker downloads only the shards of the windows still ahead (not the
    epoch from its start)."""
    from shoal.storage.checkpoint import load_latest
    from shoal.storage.uri import open_store
    from tests.storage.support import s3_env

    uri, size = _s3_dataset(tmp_path)
    job = "sresume-" + tmp_path.name[-8:]
    ckpt = f"file://{tmp_path / 'ckpt'}"
    spec = job_spec(job, STREAM_JOB, epochs=1, min_workers=2, max_workers=2, checkpoint_uri=ckpt, checkpoint_interval=20)
    create_job(r, spec)
    watch = ControlWatcher(r, job)
    env = {"SHOAL_TEST_STEP_DELAY": "0.05", "SHOAL_TEST_STREAM_URI": uri, **s3_env()}
    with LocalProcs(redis_url, tmp_path / "logs1", extra_env=env | {"SHOAL_LEDGER_DIR": str(tmp_path / "l1")}) as procs:
        procs.coordinator("coord")
        procs.worker(job, "a")
        procs.worker(job, "b")
        watch.wait_for(lambda d: d.latest_step == 40, 180)
        for p in procs.procs:  # lose every process at once
            p.signal(signal.SIGKILL)
    state, _ = load_latest(open_store(ckpt))
    assert 40 <= state.step < 79
    r.flushdb()  # and the Redis data
    create_job(r, spec.model_copy(update={"min_workers": 1}))
    watch = ControlWatcher(r, job)
    extra = env | {"SHOAL_LEDGER_DIR": str(tmp_path / "l2"), "SHOAL_TEST_CACHE_ROOT": str(tmp_path / "cache2")}
    with LocalProcs(redis_url, tmp_path / "logs2", extra_env=extra) as procs:
        procs.coordinator("coord")
        w = procs.worker(job, "c")
        watch.wait_for(lambda d: d.job_state == "completed", 180)
        assert w.wait(60) == 0
    second = sorted(ledger.read(tmp_path / "l2"), key=lambda e: e["step"])
    assert second[0]["step"] == state.step + 1 and second[0]["cursor"] == int(state.data_cursor)
    first = [e for e in ledger.read(tmp_path / "l1") if e["step"] <= state.step]
    verdict = ledger.verify(first + second, NUM_SAMPLES)
    assert verdict.ok and verdict.epochs_complete == 1, verdict.problem
    downloaded = sum(c["bytes_downloaded"] + c["remote_bytes"] for c in _downloaded(tmp_path / "cache2").values())
    ahead = 1 - int(state.data_cursor) / NUM_SAMPLES
    print(f"resumed at step {state.step} ({ahead:.0%} of the epoch ahead): downloaded {downloaded / size:.2f}x")
    assert downloaded < min(0.75, ahead + 0.3) * size
