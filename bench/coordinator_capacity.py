"""Coordinator capacity: how many heartbeating workers one coordinator process can watch.

For each worker count N (spread over several jobs) the benchmark starts a private embedded
Redis and one real ``shoal coordinator`` process, joins N simulated workers through the
normal join protocol, heartbeats every one of them once a second (pipelined Lua calls from
load-generator processes, the same script real workers run), then "kills" a few workers
(stops their heartbeats) and measures, from the coordinator's own decisions, how long after
the kill each was declared failed. It reports detection latency against TTL + 1 s and the
coordinator's CPU use (process CPU seconds per wall second; 1.0 = one full core).

    python3 scripts/dev.py python bench/coordinator_capacity.py --workers 1000,5000,10000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


import psutil
import redis


from shoal.events.keys import job_keys
from shoal.events.models import JoinRequest, encode_event
from shoal.events.records import WorkerRecord
from shoal.events.states import WorkerState
from shoal.events.streams import ControlEntry
from shoal.ops.embedded import start_server
from shoal.core.registry import create_job
from shoal.core.jobspec import JobSpec
from shoal.ops.localproc import LocalProcs
from shoal.worker.heartbeat import _BEAT


def _ms(client: redis.Redis) -> int:
    s, us = client.time()
    return int(s) * 1000 + int(us) // 1000


def join_all(client: redis.Redis, jobs: list[str], per_job: int, timeout: float) -> dict[str, list[str]]:
    """Send every join request (pipelined), then collect the coordinator's replies."""
    pending: dict[str, tuple[str, str]] = {}
    pipe = client.pipeline(transaction=False)
    for job in jobs:
        for i in range(per_job):
            ev = JoinRequest(job_id=job, host="bench", pid=i)
            pipe.xadd(job_keys(job).events, encode_event(ev))
            pending[ev.event_id] = (job, job_keys(job).join_reply(ev.event_id))
    pipe.execute()
    out: dict[str, list[str]] = {j: [] for j in jobs}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        items = list(pending.items())
        pipe = client.pipeline(transaction=False)
        for _eid, (_job, key) in items:
            pipe.lpop(key)
        for (eid, (job, _key)), raw in zip(items, pipe.execute()):
            if raw is not None:
                reply = json.loads(raw)
                if not reply["accepted"]:
                    raise SystemExit(f"join rejected: {reply['reason']}")
                out[job].append(reply["worker_id"])
                del pending[eid]
        if pending:
            time.sleep(0.2)
    if pending:
        raise SystemExit(f"{len(pending)} joins unanswered after {timeout}s")
    return out


def heartbeat_loop(url: str, members: list[tuple[str, str]], interval: float, ttl_ms: int, stop, killed) -> None:
    """Beat every (job, worker) once per ``interval``, skipping those in ``killed``."""
    client = redis.Redis.from_url(url)
    script = client.register_script(_BEAT)
    script(keys=["x{a}", "y{a}"], args=["w", "{}", 1000])  # load it once
    sha = script.sha
    while not stop.is_set():
        start = time.monotonic()
        dead = set(killed)
        pipe = client.pipeline(transaction=False)
        for n, (job, wid) in enumerate(members):
            if f"{job}/{wid}" in dead:
                continue
            k = job_keys(job)
            pipe.evalsha(sha, 2, k.heartbeat(wid), k.last_seen, wid, json.dumps({"worker_id": wid, "step": 1}), ttl_ms)
            if n % 1000 == 999:
                pipe.execute()
                pipe = client.pipeline(transaction=False)
        pipe.execute()
        stop.wait(max(0.0, interval - (time.monotonic() - start)))


def run_point(n_workers: int, n_jobs: int, ttl: float, interval: float, kills: int, log_dir: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        server = start_server(Path(tmp) / "redis", appendonly=False)
        client = redis.Redis.from_url(server.url, socket_timeout=30)
        per_job = n_workers // n_jobs
        jobs = [f"cap{i}" for i in range(n_jobs)]
        for job in jobs:
            create_job(client, JobSpec(name=job, entrypoint="simulate", min_workers=1, max_workers=per_job,
                                       global_batch_size=per_job * 4, heartbeat_ttl=ttl, heartbeat_interval=interval))
        procs = LocalProcs(server.url, log_dir)
        coord = procs.coordinator("capacity-coordinator", "--lease-ttl", "5")
        manager = mp.Manager()
        killed = manager.list()
        stop = mp.Event()
        loaders: list[mp.Process] = []
        try:
            t0 = time.monotonic()
            flat = []
            for job in jobs:  # like real workers, each starts heartbeating as soon as it joined
                members = join_all(client, [job], per_job, timeout=600)[job]
                chunk = [(job, w) for w in members]
                flat += chunk
                p = mp.Process(target=heartbeat_loop, args=(server.url, chunk, interval, int(ttl * 1000), stop, killed), daemon=True)
                p.start()
                loaders.append(p)
            join_s = time.monotonic() - t0
            time.sleep(3 * interval)  # every worker has beaten at least twice
            cpu_proc = psutil.Process(coord.pid)
            c0, w0 = cpu_proc.cpu_times(), time.monotonic()
            victims = [flat[(i * 7919) % len(flat)] for i in range(kills)]
            latencies = []
            for job, wid in victims:
                control = job_keys(job).control
                last = client.xrevrange(control, count=1)
                cursor = last[0][0].decode() if last else "0-0"
                killed.append(f"{job}/{wid}")
                kill_ms = _ms(client)  # heartbeats stop now; the last one was <= interval ago
                found = None
                deadline = time.monotonic() + ttl + 10
                while found is None and time.monotonic() < deadline:
                    for _s, entries in client.xread({control: cursor}, block=1000) or []:
                        for sid, f in entries:
                            cursor = sid.decode()
                            entry = ControlEntry.from_fields(f)
                            if wid in entry.failed:
                                found = entry.ts_ms
                latencies.append((found - kill_ms) / 1000 if found else float("inf"))
            c1, w1 = cpu_proc.cpu_times(), time.monotonic()
            cpu = ((c1.user + c1.system) - (c0.user + c0.system)) / (w1 - w0)
            info = client.info("cpu")
            failed = 0
            for job in jobs:
                failed += sum(1 for raw in client.hvals(job_keys(job).workers) if WorkerRecord.from_json(raw).state == WorkerState.FAILED)
            return {
                "workers": len(flat), "jobs": n_jobs, "ttl_s": ttl, "join_s": round(join_s, 2),
                "detect_median_s": round(statistics.median(latencies), 3), "detect_worst_s": round(max(latencies), 3),
                "within_ttl_plus_1s": all(x <= ttl + 1.0 for x in latencies) and failed == kills,
                "false_failures": failed - kills,
                "coordinator_cpu": round(cpu, 3), "redis_cpu_s": round(float(info["used_cpu_sys"]) + float(info["used_cpu_user"]), 1),
            }
        finally:
            stop.set()
            for p in loaders:
                p.join(10)
            procs.stop_all()
            manager.shutdown()
            client.close()
            server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1000,5000,10000", help="comma-separated worker counts")
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--ttl", type=float, default=3.0)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--kills", type=int, default=5)
    args = ap.parse_args()
    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="shoal-bench-logs-"))
    for n in [int(x) for x in args.workers.split(",")]:
        row = run_point(n, args.jobs, args.ttl, args.interval, args.kills, log_dir)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(f"{'workers':>8} {'jobs':>5} {'join s':>7} {'detect med':>11} {'detect worst':>13} {'false fail':>10} {'<= TTL+1s':>10} {'coord CPU':>10}")
    for r in rows:
        print(f"{r['workers']:>8} {r['jobs']:>5} {r['join_s']:>7} {r['detect_median_s']:>10}s {r['detect_worst_s']:>12}s "
              f"{r['false_failures']:>10} {str(r['within_ttl_plus_1s']):>10} {r['coordinator_cpu']:>9.0%}")
    ok = [r["workers"] for r in rows if r["within_ttl_plus_1s"]]
    print(f"\nlargest worker count detected within TTL + 1 s: {max(ok) if ok else 0} (cores: {os.cpu_count()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
