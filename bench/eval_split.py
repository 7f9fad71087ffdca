"""A distributed evaluation's time against the number of workers (issue 37).

    python3 scripts/dev.py python -m bench.eval_split [--workers 1,2]

The digits example in float64 with 40,000 held-out glyphs as its ``eval_dataset``
(``tests.entrypoints:digits_split_eval_large``), evaluated every 10 steps for 30 steps, by 1
worker and then by 2 (each ``OMP_NUM_THREADS=1``: one core each). Prints per world size the
median seconds of one evaluation (the workers' own log lines, "evaluated step N ... in X s"),
``speedup=`` (1 worker's time over W's) and the reported ``val_loss`` (the same at every W).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

from shoal.core.connection import connect
from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.events.records import JobStatus
from shoal.ops.embedded import start_server
from shoal.ops.localproc import LocalProcs

EVALUATED = re.compile(r"evaluated step \d+ \(epoch \d+\) in ([0-9.]+) s")


def run(url: str, root: Path, workers: int) -> tuple[float, float]:
    client = connect(url)
    name = f"eval{workers}"
    create_job(client, JobSpec(name=name, entrypoint="tests.entrypoints:digits_split_eval_large", global_batch_size=48,
                               epochs=10, max_steps=30, seed=1, eval_every_steps=10, min_workers=workers,
                               max_workers=workers))
    with LocalProcs(url, root / name, extra_env={"SHOAL_STEP_PACE": "0"}) as procs:
        procs.coordinator("coord")
        ws = [procs.worker(name, f"{name}-w{i}") for i in range(workers)]
        for w in ws:
            w.wait(600)
        times = [float(m.group(1)) for w in ws for m in EVALUATED.finditer(w.log_path.read_text())]
    status = JobStatus.from_hash(client.hgetall(job_keys(name).state))
    return statistics.median(times), status.eval.metrics["val_loss"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2")
    args = ap.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="shoal-bench-eval-") as t:
        server = start_server(Path(t) / "redis", appendonly=False)
        try:
            results = {w: run(server.url, Path(t), w) for w in counts}
        finally:
            server.stop()
    base = results[counts[0]][0]
    for w, (seconds, loss) in results.items():
        print(f"workers={w} eval_s={seconds:.3f} speedup={base / seconds:.2f} val_loss={loss:.15f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
