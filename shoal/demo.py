"""``shoal demo``: the whole system on one machine in about a minute.

Starts an embedded Redis (AOF on) in a temporary run directory, one coordinator and three
workers; prints every membership decision and shard table as it happens; part way through
``kill -9``s a worker, later adds one and SIGTERMs another; then stops the job and prints
a summary. Needs nothing but the installed package.
"""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

import redis

from events import bus
from events.keys import job_keys
from events.models import ShardTable, StopJob
from shoal.embedded import start_server
from shoal.jobs import create_job
from shoal.jobspec import JobSpec
from shoal.localproc import LocalProcs
from shoal.status import format_status, job_status


class ControlFeed:
    """Prints the job's control log (decisions with reasons) and returns new entries."""

    def __init__(self, client: redis.Redis, job: str):
        self.client = client
        self.keys = job_keys(job)
        self.last = "0-0"
        self.t0 = time.monotonic()

    def pump(self, block_ms: int) -> list[dict]:
        resp = self.client.xread({self.keys.control: self.last}, count=100, block=block_ms)
        out = []
        for _s, entries in resp or []:
            for sid, f in entries:
                self.last = sid.decode()
                d = {k.decode(): v.decode() for k, v in f.items()}
                out.append(d)
                print(f"[{time.monotonic() - self.t0:6.2f}s] gen {d['generation']:>2} {d['job_state']:<8} {d['reason']}")
        return out

    def until(self, pred, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for d in self.pump(200):
                if pred(d):
                    return True
        return False


def _print_table(client: redis.Redis, job: str) -> None:
    raw = client.get(job_keys(job).shard)
    if not raw:
        return
    t = ShardTable.model_validate_json(raw)
    print(f"         shard table, generation {t.generation}, world size {t.world_size}, {t.strategy} over {t.num_samples} samples:")
    for m in t.members:
        print(f"           rank {m.rank} {m.worker_id}: " + " ".join(f"[{a},{b})" for a, b, _ in m.ranges))


def run_demo(duration: float | None = None) -> int:
    job = "demo"
    with tempfile.TemporaryDirectory(prefix="shoal-demo-") as tmp:
        tmpdir = Path(tmp)
        server = start_server(tmpdir / "redis", appendonly=True)
        print(f"embedded Redis at {server.url} (AOF on, {tmpdir / 'redis'})")
        client = redis.Redis.from_url(server.url, socket_timeout=10)
        spec = JobSpec(name=job, entrypoint="simulate", min_workers=2, max_workers=3, global_batch_size=96,
                       heartbeat_interval=0.3, heartbeat_ttl=1.5, simulate_step_time=0.1)
        create_job(client, spec)
        feed = ControlFeed(client, job)
        procs = LocalProcs(server.url, tmpdir / "logs")
        try:
            procs.coordinator("coordinator")
            workers = [procs.worker(job, f"worker-{i}") for i in range(3)]
            print("started a coordinator and 3 workers")
            feed.until(lambda d: "generation" in d["reason"] and "world size 3" in d["reason"], 60)
            _print_table(client, job)
            feed.until(lambda d: False, 2.0)
            victim = workers[1]
            print(f"--- kill -9 worker-1 (pid {victim.pid})")
            killed_at = time.monotonic()
            victim.signal(signal.SIGKILL)
            feed.until(lambda d: "failed" in d["reason"], 30)
            detect = time.monotonic() - killed_at
            _print_table(client, job)
            print("--- a new worker joins")
            workers.append(procs.worker(job, "worker-3"))
            feed.until(lambda d: "world size 3" in d["reason"], 30)
            _print_table(client, job)
            print("--- SIGTERM worker-0 (graceful drain)")
            workers[0].signal(signal.SIGTERM)
            feed.until(lambda d: "left" in d["reason"], 30)
            _print_table(client, job)
            if duration:
                feed.until(lambda d: False, duration)
            bus.publish(client, job_keys(job).events, StopJob(job_id=job, reason="demo finished"))
            feed.until(lambda d: d["job_state"] == "stopped", 10)
            print()
            print(format_status(job_status(client, job)))
            print(f"\nfailure of worker-1 detected and re-planned {detect:.2f} s after kill -9 (heartbeat ttl {spec.heartbeat_ttl} s)")
        finally:
            procs.stop_all()
            client.close()
            server.stop()
    return 0
