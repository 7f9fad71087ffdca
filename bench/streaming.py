"""Streaming datasets: throughput against an in-memory copy, bytes per epoch, join latency.

    python3 scripts/dev.py python bench/streaming.py --quick      # < 5 min on 2 cores

Data: the digits glyphs (5000 samples, each with a 2 KiB payload standing in for an encoded
image: 11.9 MB) packed into 46 shards of ~256 KiB in a bucket of a local S3 server (moto's S3 in
waitress with keep-alive, the tests' server, on loopback: ``bench/s3_server.py``). Every
sample's decode burns ``SHOAL_BENCH_ITEM_MS`` (default 1 ms) of CPU in both variants, so the
jobs are data-bound.

Figures (one line each):

- ``throughput ratio=<x>``: steady steps/s of 2 workers streaming from S3 (prefetch, one
  loader each, the split by shard owner) / the same job reading an in-memory copy of the same
  samples (a map-style dataset, the plain order); A/B interleaved, the median of the pairs'
  ratios. Steady: 240 steps (3 epochs), the first fifth skipped; ``--quick`` runs 3 pairs,
  the full run 5 (a pair's ratio moves by +-0.02 from run to run on 2 shared cores: the
  median of more pairs moves less). (``--quick`` once ran 100 steps: its window then lay
  mostly in the first epoch, which downloads every shard - warm-up, not the steady state.)
  Each pair's line also gives the CPU milliseconds a step over that steady window of the
  training processes, of their loaders and of this process (which runs the S3 server), and
  the stream side's remote samples a step and shard downloads: on 2 shared cores every CPU
  millisecond the streaming spends (downloads, ranged reads, the server answering them) is
  taken from the loaders.
- ``first epoch throughput ratio=<x>``: the same runs over the first epoch alone (its first
  fifth skipped): the cold cache's epoch, every shard downloaded during it.
- ``bytes per epoch ratio=<y>``: bytes all workers downloaded in one epoch (whole shards and
  ranged reads) / the dataset's bytes, 3 workers, no membership change; then the same with
  one of the 3 leaving mid-epoch (``leave ratio=``).
- ``join to first step s=<z>``: from starting a third worker (whose cache is empty) to its
  first committed step.
- ``mosaicml throughput ratio=<x>``: shoal's streaming steps/s / MosaicML ``mosaicml-streaming``'s
  on the same samples (MDS shards of the same size in the same S3 server, 2 torchrun nodes of
  one process, one loader each, global batch 64), run as a third variant of each interleaved
  pair; ``mosaicml bytes per epoch ratio=<y>``: bytes its 3 nodes' caches hold after one epoch /
  the MDS dataset's bytes. See ``bench/streaming_mosaic.py`` (installed on demand into
  ``.bench-deps/`` with ``--no-deps``; when it cannot be, one line says why and the rest runs).

Target: throughput ratio >= 0.95, bytes per epoch <= 1.1 (with a leave <= 1.5). Say what else
ran on the machine when quoting figures (2 shared cores here).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import re
import resource
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
ITEM_COST_S = float(os.environ.get("SHOAL_BENCH_ITEM_MS", "1")) / 1000
_BLOCK = bytes(range(256)) * 64
ACCESS, SECRET = "bench-access", "bench-secret-not-printed"
PAYLOAD = 2048
SHARD_BYTES = 256 * 1024
GLOBAL_BATCH = 64


def _burn() -> None:
    end = time.thread_time() + ITEM_COST_S
    while time.thread_time() < end:
        hashlib.sha256(_BLOCK).digest()


def decode(sample: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed glyph -> (image, label), after the per-sample decode cost."""
    _burn()
    return torch.as_tensor(np.asarray(sample["x"], dtype=np.float32)), torch.tensor(int(sample["y"]))


class InMemory(torch.utils.data.Dataset):
    """The same samples, decoded from memory (the baseline)."""

    def __init__(self, samples: list[dict]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        return decode(self.samples[i])


def _samples():
    from shoal.examples.digits import DigitGlyphs

    base = DigitGlyphs(train=True)
    rng = np.random.default_rng(0)
    for i in range(len(base)):
        x, y = base[i]
        # a 2 KiB payload stands in for an encoded image: samples of a realistic size, so a
        # shard holds a few steps' worth and each request's cost is spread over them
        yield {"x": x.numpy(), "y": int(y), "payload": rng.bytes(PAYLOAD)}


def _setup(dataset):
    from shoal.examples.digits import build

    setup = build()
    setup.dataset = dataset
    return setup


def build_stream():
    """Workers import this: the digits job on the S3 dataset at ``SHOAL_BENCH_STREAM_URI``."""
    from shoal.storage.streaming import StreamingDataset

    root = os.environ.get("SHOAL_BENCH_CACHE_ROOT")
    return _setup(StreamingDataset(os.environ["SHOAL_BENCH_STREAM_URI"], decode=decode, predownload=512,
                                   cache_dir=Path(root) / str(os.getpid()) if root else None))


def build_memory():
    """Workers import this: the same job on an in-memory copy of the same samples."""
    return _setup(InMemory(list(_samples())))


# --- running jobs ------------------------------------------------------------------------------


def _moto() -> str:
    """The local S3 server: moto's S3 in waitress (``bench/s3_server.py``)."""
    from s3_server import start_moto_s3  # the sibling module (this script's folder is sys.path[0])

    return start_moto_s3()[0]


def _pack(env: dict) -> tuple[str, int, int, int]:
    from shoal.storage.s3 import S3Store
    from shoal.storage.s3_config import S3Config
    from shoal.storage.streaming_pack import pack

    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    index = pack(_samples(), S3Store(bucket, "digits", S3Config.from_env(env), create_bucket=True),
                 shard_size=SHARD_BYTES)
    return f"s3://{bucket}/digits", sum(s.size for s in index.shards), len(index.shards), \
        sum(int(s.samples or 0) for s in index.shards)


def _wait_done(client, job: str, timeout: float = 600) -> None:
    from shoal.events.records import JobStatus
    from shoal.events.states import JobState
    from shoal.events.keys import job_keys

    deadline = time.monotonic() + timeout
    while True:
        status = JobStatus.from_hash(client.hgetall(job_keys(job).state))
        if status.state in (JobState.COMPLETED, JobState.FAILED, JobState.STOPPED):
            if status.state != JobState.COMPLETED:
                raise RuntimeError(f"job {job} {status.state.value}: {status.reason}")
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job} still {status.state.value} after {timeout:.0f} s")
        time.sleep(0.1)


def _job(client, job: str, entrypoint: str, workers: int, **kw) -> None:
    from shoal.core.jobspec import JobSpec
    from shoal.core.registry import create_job

    base = dict(name=job, entrypoint=entrypoint, global_batch_size=GLOBAL_BATCH, epochs=1, min_workers=workers,
                max_workers=3, loader_workers=1, prefetch_steps=2, seed=1)
    create_job(client, JobSpec(**(base | kw)))


def _commit_times(tmp: Path, job: str) -> list[float]:
    """Commit times of one worker's steps, in order."""
    from shoal.worker import ledger

    entries = ledger.read(tmp / f"ledger-{job}")
    first = min(e["worker"] for e in entries)
    return sorted(e["t"] for e in entries if e["worker"] == first)


def _steady_times(tmp: Path, job: str, steps: int) -> list[float]:
    """Commit times of one worker's steps, the first fifth (start-up) skipped."""
    return _commit_times(tmp, job)[steps // 5:]


def _rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


class CpuSampler:
    """CPU seconds of this process (the S3 server and the bench's Redis polling) and of the
    given worker processes with their children (the loaders), sampled every 0.1 s from
    ``/proc`` on a thread, so that :meth:`per_step` can take the difference over the steady
    window alone (start-up excluded)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.snaps: list[tuple[float, float, float]] = []  # (time, this process, workers)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-sampler")
        self._thread.start()

    @staticmethod
    def _tree_seconds(pid: int, seen: dict[int, float]) -> None:
        """Record in ``seen`` (process id -> CPU seconds) ``pid``'s and its descendants' (the
        loaders') CPU seconds now."""
        todo = [pid]
        while todo:
            p = todo.pop()
            try:
                stat = Path(f"/proc/{p}/stat").read_text()
                fields = stat[stat.rfind(")") + 2 :].split()
                seen[p] = max(seen.get(p, 0.0), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
                for children in Path(f"/proc/{p}/task").glob("*/children"):
                    todo += [int(c) for c in children.read_text().split()]
            except (OSError, ValueError):
                continue

    def _run(self) -> None:
        # every process ever seen keeps its last reading: a loader missed by one sample (its
        # parent's thread list read while changing) or gone since still counts what it spent,
        # instead of a snapshot without it (once: a pair's loaders at 24 ms a step, not 66)
        seen: dict[int, float] = {}
        while not self._stop.is_set():
            me = resource.getrusage(resource.RUSAGE_SELF)
            for p in self.pids:
                self._tree_seconds(p, seen)
            own = sum(seen.get(p, 0.0) for p in self.pids)
            self.snaps.append((time.time(), me.ru_utime + me.ru_stime, own, sum(seen.values()) - own))
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def per_step(self, t0: float, t1: float, steps: int) -> tuple[float, float, float]:
        """(this process, the training processes, their loaders) CPU milliseconds per step
        between wall times t0 and t1."""
        a = min(self.snaps, key=lambda s: abs(s[0] - t0))
        b = min(self.snaps, key=lambda s: abs(s[0] - t1))
        return tuple((b[k] - a[k]) / steps * 1000 for k in (1, 2, 3))


def _logged_at(log: str, text: str) -> float | None:
    """The wall time of the first log line containing ``text`` (the workers' log format:
    ``2026-11-24 10:20:18,106 logger LEVEL message``, local time)."""
    import datetime

    for line in log.splitlines():
        if text in line:
            try:
                return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                return None
    return None


def _counters(root: Path) -> dict[str, int]:
    """The streaming counters of every worker's cache under ``root``, summed."""
    from shoal.storage.streaming_cache import sum_counters

    total: dict[str, int] = {}
    for d in root.iterdir():
        for name, n in sum_counters(d).items():
            total[name] = total.get(name, 0) + n
    return total


def _downloaded(root: Path) -> int:
    c = _counters(root)
    return c["bytes_downloaded"] + c["remote_bytes"]


def main() -> int:
    ap = argparse.ArgumentParser(description="streaming datasets: throughput, bytes per epoch, join latency")
    ap.add_argument("--quick", action="store_true", help="3 interleaved pairs instead of 5 (< 5 min)")
    args = ap.parse_args()
    pairs, steps = (3, 240) if args.quick else (5, 240)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.chdir(ROOT)
    import redis

    from shoal.ops.embedded import start_server
    from shoal.ops.localproc import LocalProcs

    s3 = {"S3_ENDPOINT": _moto(), "S3_ACCESS_KEY": ACCESS, "S3_SECRET_KEY": SECRET}
    uri, size, shards, samples = _pack(s3)
    epoch_steps = -(-samples // GLOBAL_BATCH)
    import streaming_mosaic as mosaic  # the sibling module (this script's folder is sys.path[0])

    mosaic_env = mosaic.s3_env(s3["S3_ENDPOINT"], ACCESS, SECRET)
    mosaic_uri = f"s3://mds-{uuid.uuid4().hex[:10]}/digits"
    why_not = mosaic.ensure_installed()
    if why_not is None:
        try:
            mosaic_size = mosaic.write_mds(mosaic_uri, mosaic_env, SHARD_BYTES)
        except RuntimeError as e:
            why_not = str(e)
    if why_not:
        print(f"mosaicml: not compared ({why_not})", flush=True)
    print(f"streaming: digits + {PAYLOAD} B payload a sample, {size} bytes in {shards} shards in S3 (moto on "
          f"loopback), {ITEM_COST_S * 1000:.1f} ms decode per sample, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-streaming-") as t:
        tmp = Path(t)
        server = start_server(tmp / "redis", appendonly=False)
        client = redis.Redis.from_url(server.url)
        try:
            with LocalProcs(server.url, tmp / "logs") as procs:
                procs.coordinator("coord")

                def run(job: str, entrypoint: str, workers: int, script=None, sampler=None, **kw) -> list:
                    procs.extra_env = {"SHOAL_LEDGER_DIR": str(tmp / f"ledger-{job}"), "SHOAL_BENCH_STREAM_URI": uri,
                                       "SHOAL_BENCH_CACHE_ROOT": str(tmp / f"cache-{job}"), **s3}
                    _job(client, job, entrypoint, workers, **kw)
                    started = [procs.worker(job, f"{job}-{i}") for i in range(workers)]
                    if sampler is not None:
                        sampler.append(CpuSampler([p.pid for p in started]))
                    if script:
                        started += script(job, started)
                    try:
                        _wait_done(client, job)
                    finally:
                        if sampler:
                            sampler[-1].stop()
                    for p in started:
                        p.wait(60)
                    return started

                def run_mosaic(name: str, workers: int, steps: int, epochs: int) -> dict:
                    return mosaic.run_job(mosaic_uri, mosaic_env, tmp / f"mosaic-{name}", workers, steps, epochs,
                                          global_batch=GLOBAL_BATCH)

                ratios, mosaic_ratios, cold_ratios = [], [], []
                for k in range(pairs):  # A/B interleaved
                    rates, waits, cpu, cold = {}, {}, {}, {}
                    kinds = ("stream", "memory", "mosaic") if k % 2 == 0 else ("mosaic", "memory", "stream")
                    for kind in kinds:
                        if kind == "mosaic":
                            if not why_not:
                                t = run_mosaic(f"tp-{k}", 2, steps, 10)["times"][steps // 5:]
                                rates["mosaic"] = (len(t) - 1) / (t[-1] - t[0])
                            continue
                        job = f"tp-{kind}-{k}"
                        sampler: list[CpuSampler] = []
                        ran = run(job, f"bench.streaming:build_{kind}", 2, sampler=sampler, max_steps=steps,
                                  epochs=10, max_workers=2)
                        t = _steady_times(tmp, job, steps)
                        rates[kind] = _rate(t)
                        cold[kind] = _rate(_commit_times(tmp, job)[epoch_steps // 5 : epoch_steps])
                        cpu[kind] = sampler[0].per_step(t[0], t[-1], len(t) - 1)
                        waits[kind] = [m for p in ran for m in re.findall(r"([0-9.]+) s waited for batches",
                                                                          p.log_tail(400))]
                        if kind == "stream":
                            counts = _counters(tmp / f"cache-{job}")
                            reads = f"{counts['remote_reads'] / steps:.2f} remote samples and " \
                                    f"{counts['downloads']} shard downloads"
                    ratios.append(rates["stream"] / rates["memory"])
                    cold_ratios.append(cold["stream"] / cold["memory"])
                    if "mosaic" in rates:
                        mosaic_ratios.append(rates["stream"] / rates["mosaic"])
                    print(f"  pair {k}: stream {rates['stream']:.2f} / memory {rates['memory']:.2f} steps/s"
                          + (f" (mosaicml {rates['mosaic']:.2f})" if "mosaic" in rates else "") + "; "
                          f"input wait (s, per worker): stream {' '.join(waits['stream'])}, "
                          f"memory {' '.join(waits['memory'])}; steady CPU ms a step: training processes + loaders "
                          f"stream {cpu['stream'][1]:.1f} + {cpu['stream'][2]:.1f} memory {cpu['memory'][1]:.1f} + "
                          f"{cpu['memory'][2]:.1f}, this process (the S3 server) "
                          f"stream {cpu['stream'][0]:.1f} memory {cpu['memory'][0]:.1f}; stream read {reads} "
                          f"over {steps} steps; first epoch alone {cold_ratios[-1]:.3f}", flush=True)
                print(f"throughput ratio={statistics.median(ratios):.3f}  pairs {' '.join(f'{x:.3f}' for x in ratios)}"
                      f"  (2 workers, {steps} steps, global batch {GLOBAL_BATCH})", flush=True)
                print(f"first epoch throughput ratio={statistics.median(cold_ratios):.3f}  pairs "
                      f"{' '.join(f'{x:.3f}' for x in cold_ratios)}  (the same runs' steps {epoch_steps // 5}-"
                      f"{epoch_steps}: the cold cache's epoch, every shard downloaded during it)", flush=True)

                run("bytes", "bench.streaming:build_stream", 3)
                steady = _downloaded(tmp / "cache-bytes") / size

                def leave(job, started):
                    from shoal.worker import ledger

                    while len(ledger.read(tmp / f"ledger-{job}")) < 3 * 25:
                        time.sleep(0.05)
                    started[2].signal(15)
                    return []

                run("leave", "bench.streaming:build_stream", 3, script=leave, min_workers=2)
                left = _downloaded(tmp / "cache-leave") / size
                print(f"bytes per epoch ratio={steady:.3f}  leave ratio={left:.3f}  (3 workers, one epoch; "
                      f"then one of them leaving after 25 steps)", flush=True)
                if mosaic_ratios:
                    print(f"mosaicml throughput ratio={statistics.median(mosaic_ratios):.3f}  pairs "
                          f"{' '.join(f'{x:.3f}' for x in mosaic_ratios)}  (shoal streaming / mosaicml-streaming "
                          f"{mosaic.VERSION} steps/s, 2 workers, {steps} steps, global batch {GLOBAL_BATCH})", flush=True)
                    mosaic_bytes = run_mosaic("bytes", 3, 10**9, 1)["bytes"] / mosaic_size
                    print(f"mosaicml bytes per epoch ratio={mosaic_bytes:.3f}  (shoal {steady:.3f}; 3 nodes of "
                          f"one process, one epoch, each node its own cache; no resize)", flush=True)

                joined: dict = {}

                def join(job, started):
                    from shoal.worker import ledger

                    while len(ledger.read(tmp / f"ledger-{job}")) < 2 * 20:
                        time.sleep(0.05)
                    joined["t"] = time.time()
                    joined["pid"] = None
                    p = procs.worker(job, f"{job}-joiner")
                    joined["pid"], joined["proc"] = p.pid, p
                    return [p]

                run("join", "bench.streaming:build_stream", 2, script=join, epochs=3)  # runs past the join
                from shoal.worker import ledger

                firsts = [e["t"] for e in ledger.read(tmp / "ledger-join") if e["pid"] == joined["pid"]]
                joined_at = _logged_at(joined["proc"].log_tail(400), "joined job")
                after = (f"; {min(firsts) - joined_at:.2f} s of it from the join (its membership) on, the rest "
                         "is the process starting (imports, the dataset's index) on the 2 busy cores"
                         if firsts and joined_at else "")
                print(f"join to first step s={min(firsts) - joined['t']:.2f}  (a third worker, empty cache, "
                      f"joining 2 after 20 steps: from starting its process{after})" if firsts
                      else "join to first step: the joiner committed no step", flush=True)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
