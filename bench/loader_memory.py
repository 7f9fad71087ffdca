"""Memory of a worker and its loader processes: the 340 M-parameter LM example (issue 35).

    python3 scripts/dev.py python -m bench.loader_memory [--steps 6] [--loaders 2]

One data-parallel worker of ``examples/lm.py:build_large`` (seq 32, global batch 4) trains a
few steps against the embedded Redis; every 0.2 s this samples, from ``/proc``, the worker's
resident memory and each loader process's resident (``Rss``) and private (``Private_Clean`` +
``Private_Dirty``) memory. A loader forked after the model is built shares its pages; once the
worker writes its parameters (every step), each page it writes is copied, and a loader that
kept the old page holds it alone: its private memory grows toward the model's size. Prints
``name=value`` lines: the worker's peak RSS, the loaders' peak RSS and private memory (sum over
loaders), and the worker plus its loaders in all (peak of worker RSS + loaders' private).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from shoal.core.connection import connect
from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.ops.embedded import start_server
from shoal.ops.localproc import LocalProcs


def _mem(pid: int) -> tuple[int, int]:
    """(Rss, private) of ``pid`` in KiB, from /proc/<pid>/smaps_rollup; (0, 0) once it is gone."""
    rss = private = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == "Rss":
                rss = int(rest.split()[0])
            elif name in ("Private_Clean", "Private_Dirty"):
                private += int(rest.split()[0])
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return rss, private


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--loaders", type=int, default=2)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shoal-loader-mem-") as tmp:
        root = Path(tmp)
        server = start_server(root / "redis")
        try:
            client = connect(server.url)
            create_job(client, JobSpec(name="mem", entrypoint="shoal.examples.lm:build_large", global_batch_size=4,
                                       epochs=1, max_steps=args.steps, seed=0, min_workers=1, max_workers=1,
                                       heartbeat_interval=0.5, heartbeat_ttl=30.0, loader_workers=args.loaders))
            env = {"SHOAL_LM_SEQ_LEN": "32", "OMP_NUM_THREADS": "2"}
            peak = {"worker": 0, "loaders_rss": 0, "loaders_private": 0, "total": 0}
            with LocalProcs(server.url, root / "logs", extra_env=env) as procs:
                procs.coordinator("coord")
                w = procs.worker("mem", "w")
                while w.popen.poll() is None:
                    rss, _ = _mem(w.pid)
                    loaders = [_mem(c) for c in _children(w.pid)]
                    lr, lp = sum(x[0] for x in loaders), sum(x[1] for x in loaders)
                    peak["worker"] = max(peak["worker"], rss)
                    peak["loaders_rss"] = max(peak["loaders_rss"], lr)
                    peak["loaders_private"] = max(peak["loaders_private"], lp)
                    peak["total"] = max(peak["total"], rss + lp)
                    time.sleep(0.2)
                code = w.popen.returncode
            if code != 0:
                print(f"the worker exited with {code}:\n{w.log_tail(20)}", file=sys.stderr)
                return 1
        finally:
            server.stop()
    mib = lambda kib: f"{kib / 1024:.0f}"  # noqa: E731
    print(f"loaders={args.loaders} steps={args.steps} (340 M-parameter LM, one data-parallel worker)")
    print(f"worker_peak_rss_mib={mib(peak['worker'])}")
    print(f"loaders_peak_rss_mib={mib(peak['loaders_rss'])}")
    print(f"loaders_peak_private_mib={mib(peak['loaders_private'])}")
    print(f"worker_plus_loaders_peak_mib={mib(peak['total'])}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
