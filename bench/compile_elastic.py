"""A compiled model in an elastic job: the join's cost to the survivors, and cold vs warm compile.

    python3 scripts/dev.py python -m bench.compile_elastic [--steps 300]

The digits example in float64 (paced) with 2 workers, then a third joining; run twice, with
``compile: true`` and without, back to back. Every worker has an inductor cache directory of
its own (as on separate nodes), and the compiled run shares compile artifacts through the
checkpoint store (HMAC-signed: ``SHOAL_CHECKPOINT_HMAC_KEY`` is set here). Prints:

- ``join_pause_compiled=`` / ``join_pause_eager=``: the longest gap between two committed steps
  of the survivors around the join (the joiner compiles before it joins, so a compiled job's
  pause should be the uncompiled one's), and ``join_pause_diff=`` (target <= 0.1 s);
- ``recompiles=``: dynamo frames compiled after the warm-up, summed over the workers (target 0);
- ``cold=`` the first worker's compile with nothing cached anywhere, ``warm=`` the joiner's, with
  an empty local cache but the store's artifacts, and ``warm_over_cold=`` (target <= 0.25).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

from shoal.core.connection import connect
from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.ops.embedded import start_server
from shoal.ops.localproc import LocalProcs
from shoal.ops.status import job_status
from shoal.worker import ledger

COMPILED = re.compile(r"compiled for micro-batches of \d+ in ([0-9.]+) s")


def run(url: str, root: Path, name: str, compiled: bool, steps: int) -> dict:
    client = connect(url)
    create_job(client, JobSpec(name=name, entrypoint="shoal.examples.digits:build_double_paced", global_batch_size=48,
                               min_workers=2, max_workers=3, heartbeat_interval=0.2, heartbeat_ttl=1.5, seed=1,
                               epochs=10, max_steps=steps, compile=compiled, checkpoint_uri=f"file://{root / 'ckpt'}",
                               checkpoint_interval=10_000))
    base = {"SHOAL_LEDGER_DIR": str(root / "ledger"), "SHOAL_STEP_PACE": "0.05",
            "SHOAL_CHECKPOINT_HMAC_KEY": "bench-compile-key"}
    nodes = [LocalProcs(url, root / "logs", extra_env={**base, "TORCHINDUCTOR_CACHE_DIR": str(root / f"inductor{i}")})
             for i in range(4)]
    try:
        nodes[0].coordinator("coord")
        first = [nodes[i].worker(name, f"w{i}") for i in (1, 2)]
        while job_status(client, name)["world_size"] < 2 or int(client.hget(job_keys(name).state, "high_step") or 0) < 20:
            time.sleep(0.2)
        joined_at = time.time()
        joiner = nodes[3].worker(name, "w3")
        while job_status(client, name)["state"] not in ("completed", "failed"):
            time.sleep(0.5)
        for p in [*first, joiner]:
            p.wait(120)
    finally:
        for n in nodes:
            n.stop_all()
    entries = ledger.read(root / "ledger")
    survivors = {e["worker"] for e in entries if e["t"] < joined_at}
    times = sorted({round(e["t"], 4) for e in entries if e["worker"] in survivors and e["t"] > joined_at})
    pause = max((b - a for a, b in zip(times, times[1:])), default=0.0)
    logs = {p.name: p.log_tail(400) for p in [*first, joiner]}
    seconds = {k: float(m.group(1)) for k, v in logs.items() if (m := COMPILED.search(v))}
    recompiles = sum(v.count("recompiled") for v in logs.values())
    return {"pause": pause, "compile": seconds, "recompiles": recompiles,
            "exactly_once": ledger.verify(entries, 5000).ok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="shoal-bench-compile-") as t:
        tmp = Path(t)
        server = start_server(tmp / "redis", appendonly=False)
        try:
            compiled = run(server.url, tmp / "compiled", "compiled", True, args.steps)
            eager = run(server.url, tmp / "eager", "eager", False, args.steps)
        finally:
            server.stop()
    cold = compiled["compile"].get("w1") or 0.0
    warm = compiled["compile"].get("w3") or 0.0
    print(f"join_pause_compiled={compiled['pause']:.3f} join_pause_eager={eager['pause']:.3f} "
          f"join_pause_diff={compiled['pause'] - eager['pause']:.3f}")
    print(f"recompiles={compiled['recompiles']} exactly_once={compiled['exactly_once'] and eager['exactly_once']}")
    print(f"cold={cold:.1f} warm={warm:.1f} warm_over_cold={warm / cold if cold else float('nan'):.2f} "
          f"(compile seconds per worker: {compiled['compile']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
