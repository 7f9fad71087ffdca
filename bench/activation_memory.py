"""Peak memory of elastic HSDP's members with and without activation checkpointing (issue 37).

    python3 scripts/dev.py python -m bench.activation_memory [--seq 256]

The LM example at 340 M parameters (``examples/lm.py:build_large``) trained by one replica
group of ``shard_size`` 2 for a few steps, once with ``activation_checkpointing: true`` and
once without, back to back; prints each run's peak RSS per worker (what ``shoal status``
shows, from each worker's heartbeat) as ``peak_mib_ac=`` / ``peak_mib_plain=`` and their ratio.
Activations grow with the context and the batch: ``--seq`` and ``--batch`` set them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from shoal.core.connection import connect
from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.ops.embedded import start_server
from shoal.ops.localproc import LocalProcs
from shoal.ops.status import job_status


def peak(url: str, root: Path, name: str, ac: bool, seq: int, batch: int) -> float:
    client = connect(url)
    create_job(client, JobSpec(name=name, entrypoint="shoal.examples.lm:build_large", global_batch_size=batch,
                               epochs=1, max_steps=3, seed=0, min_workers=2, max_workers=2, shard_size=2,
                               heartbeat_interval=0.5, heartbeat_ttl=30.0, step_timeout=900, activation_checkpointing=ac))
    peaks: dict[str, float] = {}
    with LocalProcs(url, root / name, extra_env={"SHOAL_LM_SEQ_LEN": str(seq)}) as procs:
        procs.coordinator("coord")
        workers = [procs.worker(name, f"{name}-w{i}") for i in range(2)]
        while True:
            s = job_status(client, name)
            for w in s["workers"]:
                if w["peak_rss_mb"] is not None:
                    peaks[w["worker_id"]] = max(peaks.get(w["worker_id"], 0.0), w["peak_rss_mb"])
            if s["state"] in ("completed", "failed"):
                break
            time.sleep(0.2)
        for w in workers:
            w.wait(120)
    if s["state"] != "completed":
        raise SystemExit(f"{name}: {s['state']}: {s['reason']}")
    return max(peaks.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="shoal-bench-ac-") as t:
        server = start_server(Path(t) / "redis", appendonly=False)
        try:
            plain = peak(server.url, Path(t), "plain", False, args.seq, args.batch)
            ac = peak(server.url, Path(t), "ac", True, args.seq, args.batch)
        finally:
            server.stop()
    print(f"seq={args.seq} batch={args.batch} peak_mib_plain={plain:.0f} peak_mib_ac={ac:.0f} ratio={ac / plain:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
