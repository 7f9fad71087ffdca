"""One job of ``bench/streaming.py`` alone: its steady steps/s and CPU a step, for comparing two
checkouts of the code (old against new), interleaved by the caller.

    python3 scripts/dev.py python bench/streaming_one.py stream     # or: memory

Prints one line: ``<checkout folder> <variant> steps/s <x> cpu ms/step server <a> train <b>
loaders <c>`` (the same steady window and CPU sampling as the bench's pairs). To compare
with an older commit, make a worktree of it with its own virtual environment (a copy whose
editable install points at the worktree) and run this script from each, alternately: the box
drifts by several per cent over minutes, so only interleaved runs compare.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    kind = sys.argv[1] if len(sys.argv) > 1 else "stream"
    if kind not in ("stream", "memory"):
        print(f"bench/streaming_one.py: variant must be stream or memory, not {kind!r}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.chdir(ROOT)
    import redis
    import streaming as bench  # the sibling module (this script's folder is sys.path[0])

    from shoal.ops.embedded import start_server
    from shoal.ops.localproc import LocalProcs

    s3 = {"S3_ENDPOINT": bench._moto(), "S3_ACCESS_KEY": bench.ACCESS, "S3_SECRET_KEY": bench.SECRET}
    uri, _, _, _ = bench._pack(s3)
    steps = 240
    with tempfile.TemporaryDirectory(prefix="shoal-bench-streaming-one-") as t:
        tmp = Path(t)
        server = start_server(tmp / "redis", appendonly=False)
        try:
            client = redis.Redis.from_url(server.url)
            with LocalProcs(server.url, tmp / "logs") as procs:
                procs.coordinator("coord")
                job = f"one-{kind}"
                procs.extra_env = {"SHOAL_LEDGER_DIR": str(tmp / f"ledger-{job}"), "SHOAL_BENCH_STREAM_URI": uri,
                                   "SHOAL_BENCH_CACHE_ROOT": str(tmp / f"cache-{job}"), **s3}
                bench._job(client, job, f"bench.streaming:build_{kind}", 2, max_steps=steps, epochs=10, max_workers=2)
                started = [procs.worker(job, f"{job}-{i}") for i in range(2)]
                sampler = bench.CpuSampler([p.pid for p in started])
                try:
                    bench._wait_done(client, job)
                finally:
                    sampler.stop()
                for p in started:
                    p.wait(60)
                times = bench._steady_times(tmp, job, steps)
                server_ms, train_ms, loaders_ms = sampler.per_step(times[0], times[-1], len(times) - 1)
                print(f"{ROOT.name} {kind} steps/s {bench._rate(times):.2f} cpu ms/step server {server_ms:.1f} "
                      f"train {train_ms:.1f} loaders {loaders_ms:.1f}", flush=True)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
