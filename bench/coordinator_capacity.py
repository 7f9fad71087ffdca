"""Coordinator capacity: how many heartbeating workers one coordinator process can watch.

For each worker count N (spread over several jobs) the benchmark starts a private embedded
Redis and one real ``shoal coordinator`` process, joins N simulated workers through the
normal join protocol, heartbeats every one of them once a second (pipelined Lua calls from
load-generator processes, the same script real workers run), then "kills" a few workers
(stops their heartbeats) and measures, from the coordinator's own decisions, how long after
the kill each was declared failed. It reports detection latency against TTL + 1 s and the
coordinator's CPU use (process CPU seconds per wall second; 1.0 = one full core).

    python3 scripts/dev.py python bench/coordinator_capacity.py --workers 1000,5000,10000

``--one-job W --ha`` (issue 29): one job of W members, Redis under Sentinel (without ``--ha``: a
plain server, no fail-over), heartbeat TTL 10 s and interval 2 s unless given. All join (in
waves of 2,048: see ``one_job_point``); one in 100 stops heartbeating; the primary is kill -9'd
0.75 s later and a replica promoted. Above 4,096 workers the bench lifts ``core/jobspec.py``'s
``max_workers`` cap in its own processes (its coordinator's included). Prints
``detect_p99=`` (kill -> the control entry that removed it, Redis server time), the Redis
commands of the generation switch per worker (``switch_commands_per_worker=``: the commands the
primary ran from just before the removal until every survivor was active in the new
generation, less the heartbeats, the bench's own and the steady background), ``lost_writes=``
(confirmed writes missing after the fail-over), the coordinator's CPU and Redis's memory.

    .venv/bin/python bench/coordinator_capacity.py --one-job 16384 --ha
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


import psutil
import redis


from shoal.events.keys import COORDINATOR_GROUP, job_keys
from shoal.events.models import JoinRequest, encode_event
from shoal.events.records import JobStatus, WorkerRecord
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
    script(keys=["x{a}", "y{a}", "z{a}", "v{a}"], args=["w", "{}", 1000, -1, 0])  # load it once
    sha = script.sha
    while not stop.is_set():
        start = time.monotonic()
        dead = set(killed)
        pipe = client.pipeline(transaction=False)
        for n, (job, wid) in enumerate(members):
            if f"{job}/{wid}" in dead:
                continue
            k = job_keys(job)
            # the script's keys and arguments as Heartbeater.beat sends them (not busy: -1; pid 0: not checked)
            pipe.evalsha(sha, 4, k.heartbeat(wid), k.last_seen, k.busy, k.workers,
                         wid, json.dumps({"worker_id": wid, "step": 1}), ttl_ms, -1, 0)
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


# ---- one job of many workers, optionally under Sentinel with a fail-over (issue 29) ----------
#
# ``--one-job W [--ha]``: one job of W members against one real coordinator. The simulated
# workers live in a few load-generator processes; each simulated worker follows the worker
# protocol: it joins (JoinRequest, then its reply), heartbeats with the real Lua script (keys
# and arguments as Heartbeater.beat sends them, its pid checked), reads every new generation
# table through a confirmed read (as Membership.next_table) and sends Ready for it. What a
# generator shares between its workers: one pipeline per chunk of beats with one confirmation
# (marker + WAIT) per chunk under Sentinel, where a real worker confirms each beat; one read
# of each new table, where each real worker reads it itself (docs/benchmarks.md, issue 29).

#: per-generator counters (shared memory): what each load generator sent
GEN_FIELDS = ("beats", "unwatched", "confirms", "script_loads", "gen_polls", "table_reads", "readies", "joins",
              "join_polls", "errors", "late_rounds")
#: Redis commands one watched beat runs (EVALSHA and the script's calls: TIME, ZSCORE, HGET of
#: the record (pid checked), ZADD, SET, ZREM of busy); an unwatched one stops after ZSCORE
BEAT_COMMANDS = {"evalsha": 1, "time": 1, "zscore": 1, "hget": 1, "zadd": 1, "set": 1, "zrem": 1}
UNWATCHED_COMMANDS = {"evalsha": 1, "time": 1, "zscore": 1}
CHUNK = 256
#: joins let in at once (see one_job_point)
WAVE = 2048
#: every KILL_EVERY-th member of each generator (by join order) is killed
KILL_EVERY = 100


def _raise_worker_cap(limit: int) -> None:
    """``core/jobspec.py`` caps ``max_workers`` at MAX_WORKERS (4096); this mode needs one job
    of more. Lift the cap in this process only (the bench's own and its coordinator's): the
    coordinator's code runs unchanged, it just reads a spec it would otherwise refuse."""
    import annotated_types

    from shoal.core.jobspec import MAX_WORKERS, JobSpec

    if limit <= MAX_WORKERS:
        return
    field = JobSpec.model_fields["max_workers"]
    field.metadata = [m for m in field.metadata if not isinstance(m, annotated_types.Le)] + [annotated_types.Le(limit)]
    JobSpec.model_rebuild(force=True)


def _counter(counters, g: int, name: str, n: int = 1) -> None:
    counters[g * len(GEN_FIELDS) + GEN_FIELDS.index(name)] += n


def _counts(counters, n_gen: int) -> dict[str, int]:
    out = dict.fromkeys(GEN_FIELDS, 0)
    for g in range(n_gen):
        for i, name in enumerate(GEN_FIELDS):
            out[name] += counters[g * len(GEN_FIELDS) + i]
    return out


def generator(url: str, job: str, g: int, n: int, interval: float, ttl_ms: int, allowed, assembled, kill, stop,
              hold, held, counters, out) -> None:
    """``n`` simulated workers of ``job``: join (the first ``allowed.value`` of them; more as it
    grows), heartbeat every ``interval``, read every new generation table, send Ready for the
    newest one that names them once ``assembled`` is set, stop beating the doomed ones (every
    KILL_EVERY-th, from the 50th) once ``kill`` is set. Reports on ``out``."""
    from shoal.core.connection import connect, replicas_to_wait
    from shoal.core.durable import execute_confirmed
    from shoal.events.models import Ready

    try:
        client = connect(url, ride_out=60, timeout=10)
        confirm = replicas_to_wait(client) > 0
        keys = job_keys(job)
        sha = client.script_load(_BEAT)
        _counter(counters, g, "script_loads")
        last = client.xrevrange(keys.generations, count=1)
        gen_cursor = last[0][0].decode() if last else "0-0"
        pids = [1_000_000 + g * 100_000 + i for i in range(n)]
        sent = 0  # join requests sent
        waiting: list[tuple[int, str]] = []  # (local index, reply key), in the order sent
        t_join0 = None
        members: list[tuple[str, int]] = []  # (worker id, pid) in join order
        doomed: set[str] = set()
        dead: set[str] = set()
        gen, ready_gen, table_ids = 0, 0, []
        next_poll = next_gen_poll = time.monotonic()
        pos, round_start = 0, time.monotonic()
        peek = 16
        while not stop.is_set():
            if hold.is_set():  # the bench reads Redis's counters and ours: nothing of ours in flight
                held[g] = 1
                while hold.is_set() and not stop.is_set():
                    time.sleep(0.001)
                held[g] = 0
            now = time.monotonic()
            target = min(n, allowed.value)
            if sent < target:  # join: every request allowed now at once (pipelined)
                t_join0 = t_join0 or time.time()
                pipe = client.pipeline(transaction=False)
                for i in range(sent, target):
                    ev = JoinRequest(job_id=job, host=f"bench-g{g}", pid=pids[i])
                    pipe.xadd(keys.events, encode_event(ev))
                    waiting.append((i, keys.join_reply(ev.event_id)))
                    if len(pipe) >= 500:
                        pipe.execute()
                        pipe = client.pipeline(transaction=False)
                pipe.execute()
                _counter(counters, g, "joins", target - sent)
                sent = target
            if waiting and now >= next_poll:  # the replies, in order, stopping at the first missing
                batch = waiting[:peek]
                pipe = client.pipeline(transaction=False)
                for _i, key in batch:
                    pipe.lpop(key)
                got = 0
                for (i, _key), raw in zip(batch, pipe.execute()):
                    if raw is None:
                        break
                    reply = json.loads(raw)
                    if not reply["accepted"]:
                        raise RuntimeError(f"join rejected: {reply['reason']}")
                    members.append((reply["worker_id"], pids[i]))
                    if i % KILL_EVERY == KILL_EVERY // 2:
                        doomed.add(reply["worker_id"])
                    got += 1
                _counter(counters, g, "join_polls", len(batch))
                del waiting[:got]
                peek = min(500, max(16, 2 * got))
                next_poll = now if got == len(batch) else now + 0.1
                if not waiting:
                    out.put(("joined", g, len(members), t_join0, time.time()))
            if kill.is_set() and not dead:
                dead = set(doomed)
                out.put(("killed", g, time.time(), sorted(dead)))
            if now >= next_gen_poll:  # a new generation table? (Membership.next_table: then a confirmed read)
                next_gen_poll = now + 0.25
                _counter(counters, g, "gen_polls")
                newer = False
                for _s, entries in client.xread({keys.generations: gen_cursor}, count=100) or []:
                    for sid, _f in entries:
                        gen_cursor = sid.decode()
                        newer = True
                if newer:
                    p = client.pipeline(transaction=False)
                    p.get(keys.shard)
                    (raw,) = execute_confirmed(client, p, "generation table")
                    _counter(counters, g, "table_reads")
                    table = json.loads(raw)
                    if table["generation"] > gen:
                        gen = table["generation"]
                        table_ids = [] if table["paused"] else [m["worker_id"] for m in table["members"]]
                        out.put(("table", g, gen, table["world_size"], len(raw), time.time()))
                if assembled.is_set() and gen > ready_gen:  # switch to the newest generation
                    ready_gen = gen
                    mine = {w for w, _p in members} - dead
                    ids = [w for w in table_ids if w in mine]
                    pipe = client.pipeline(transaction=False)
                    for wid in ids:
                        pipe.xadd(keys.events, encode_event(Ready(job_id=job, worker_id=wid, generation=gen)))
                        if len(pipe) >= 500:
                            pipe.execute()
                            pipe = client.pipeline(transaction=False)
                    pipe.execute()
                    _counter(counters, g, "readies", len(ids))
                    out.put(("ready", g, gen, len(ids), time.time()))
            if not members:
                time.sleep(0.05)
                continue
            due = round_start + interval * pos / len(members)
            if now < due:
                time.sleep(min(due - now, 0.02))
                continue
            chunk = [(w, p) for w, p in members[pos:pos + CHUNK] if w not in dead]
            pos += CHUNK
            if pos >= len(members):
                pos = 0
                round_start += interval
                if round_start < now - interval / 2:  # fell behind by half a round: count it, start afresh
                    _counter(counters, g, "late_rounds")
                    round_start = now
            if not chunk:
                continue
            for _attempt in range(3):
                pipe = client.pipeline(transaction=False)
                for wid, pid in chunk:
                    value = json.dumps({"worker_id": wid, "step": 0, "generation": ready_gen, "pid": pid})
                    pipe.evalsha(sha, 4, keys.heartbeat(wid), keys.last_seen, keys.busy, keys.workers, wid, value, ttl_ms, -1, pid)
                if confirm:  # as execute_confirmed: a marker, then WAIT for a replica
                    pipe.set("shoal:durable", str(time.time()), px=60_000)
                    pipe.execute_command("WAIT", 1, 500)
                res = pipe.execute(raise_on_error=False)
                if any(isinstance(r, redis.exceptions.NoScriptError) for r in res):
                    sha = client.script_load(_BEAT)  # a promoted replica has not cached it
                    _counter(counters, g, "script_loads")
                    continue
                beats = res[:len(chunk)]
                _counter(counters, g, "beats", sum(1 for r in beats if r == 1))
                _counter(counters, g, "unwatched", sum(1 for r in beats if r == 0))
                _counter(counters, g, "errors", sum(1 for r in res if isinstance(r, Exception)))
                if confirm:
                    _counter(counters, g, "confirms")
                break
    except Exception as exc:  # noqa: BLE001 - reported to the bench, which fails the run
        out.put(("error", g, f"{type(exc).__name__}: {exc}"))
        raise


def _snapshot(client: redis.Redis) -> tuple[dict[str, int], float]:
    """The primary's calls by command (INFO commandstats) and its CPU seconds, in one INFO."""
    info = client.info("all")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items() if k.startswith("cmdstat_")}
    return calls, float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) - a.get(k, 0)}


def _minus(total: dict[str, float], *parts: dict[str, float]) -> dict[str, float]:
    out = dict(total)
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) - v
    return {k: v for k, v in out.items() if v}


def _generated(c0: dict[str, int], c1: dict[str, int], confirm: bool) -> dict[str, int]:
    """Redis commands the generators' background (heartbeats, generation polls) ran between
    two counter snapshots, by command."""
    out: dict[str, int] = {}
    def add(cmds: dict[str, int], times: int) -> None:
        for k, v in cmds.items():
            out[k] = out.get(k, 0) + v * times
    add(BEAT_COMMANDS, c1["beats"] - c0["beats"])
    add(UNWATCHED_COMMANDS, c1["unwatched"] - c0["unwatched"])
    if confirm:
        add({"set": 1, "wait": 1}, c1["confirms"] - c0["confirms"])
    add({"xread": 1}, c1["gen_polls"] - c0["gen_polls"])
    add({"script|load": 1}, c1["script_loads"] - c0["script_loads"])
    return out


class Own:
    """The bench's own client, counting the commands it sends (subtracted from the switch)."""

    def __init__(self, client: redis.Redis):
        self.client = client
        self.sent: dict[str, int] = {}

    def __call__(self, name: str, n: int = 1):
        self.sent[name] = self.sent.get(name, 0) + n
        return self.client


def _log_time(line: str) -> float:
    """Unix time of a shoal log line (``%(asctime)s``: local time, milliseconds after a comma)."""
    stamp = " ".join(line.split(" ", 2)[:2])
    base, ms = stamp.split(",")
    return time.mktime(time.strptime(base, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000


def _settled(own: Own, keys, world: int, readies: dict[int, int]) -> int:
    """The generation once the job's current one has ``world`` members, every one of them sent
    Ready for it, and the coordinator applied every event (none pending, none unread); else 0."""
    c = own("hget", 1)
    raw = c.hget(keys.state, "generation")
    gen = int(raw or 0)
    if not gen or readies.get(gen, 0) < world:
        return 0
    groups = own("xinfo|groups").xinfo_groups(keys.events)
    g = next(x for x in groups if (x["name"].decode() if isinstance(x["name"], bytes) else x["name"]) == COORDINATOR_GROUP)
    if int(g["pending"]) or int(g.get("lag") or 0):
        return 0
    return gen


def one_job_point(w: int, ha: bool, ttl: float, interval: float, failover_at: float, n_gen: int, log_dir: Path) -> dict:
    from shoal.core.connection import connect
    from shoal.core.durable import execute_confirmed
    from shoal.ops.embedded import start_ha

    _raise_worker_cap(w)
    job = "onejob"
    keys = job_keys(job)
    row: dict = {"workers": w, "ha": ha, "ttl_s": ttl, "interval_s": interval}
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp, contextlib.ExitStack() as cleanup:
        # (undone in reverse: the generators, the coordinator, the client, the servers)
        hset = start_ha(Path(tmp) / "ha", replicas=2, sentinels=3, down_after_ms=1000) if ha else None
        server = None if ha else start_server(Path(tmp) / "redis", appendonly=False)
        cleanup.callback((hset or server).stop)
        url = hset.url if hset else server.url
        client = connect(url, ride_out=60, timeout=30)
        cleanup.callback(client.close)
        own = Own(client)
        spec = JobSpec(name=job, entrypoint="simulate", min_workers=max(1, min(WAVE // 2, w // 2)), max_workers=w,
                       global_batch_size=w * 4, heartbeat_ttl=ttl, heartbeat_interval=interval)
        create_job(client, spec)
        env = dict(os.environ, REDIS_URL=url, PYTHONUNBUFFERED="1")
        log_dir.mkdir(parents=True, exist_ok=True)
        coord_log = log_dir / f"one-job-{w}-coordinator.log"
        with open(coord_log, "wb") as fh:
            coord = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--as-coordinator", str(w), "coordinator",
                                      "--id", "one-job-coordinator", "--lease-ttl", "5"],
                                     env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        cleanup.callback(_end, coord)
        cpu_proc = psutil.Process(coord.pid)

        def cpu_s() -> float:
            t = cpu_proc.cpu_times()
            return t.user + t.system

        counters = mp.Array("q", n_gen * len(GEN_FIELDS), lock=False)
        kill, stop, assembled = mp.Event(), mp.Event(), mp.Event()
        allowed = mp.Value("i", 0, lock=False)
        hold, held = mp.Event(), mp.Array("i", n_gen, lock=False)
        out: mp.Queue = mp.Queue()
        sizes = [w // n_gen + (1 if g < w % n_gen else 0) for g in range(n_gen)]
        gens = [mp.Process(target=generator, args=(url, job, g, sizes[g], interval, int(ttl * 1000), allowed, assembled,
                                                   kill, stop, hold, held, counters, out), daemon=True) for g in range(n_gen)]
        cleanup.callback(_stop_generators, gens, stop)
        readies: dict[int, int] = {}
        tables: dict[int, tuple[int, int, float]] = {}  # generation -> (world size, bytes, first seen)
        killed_at: dict[str, float] = {}
        joined: dict[int, tuple] = {}  # generator -> its latest "all my allowed joins answered"

        def drain(timeout: float = 0.0) -> None:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    msg = out.get(timeout=max(0.0, deadline - time.monotonic())) if timeout else out.get_nowait()
                except Exception:  # queue.Empty
                    return
                if msg[0] == "error":
                    raise SystemExit(f"load generator {msg[1]} failed: {msg[2]}")
                if msg[0] == "joined":
                    joined[msg[1]] = msg
                elif msg[0] == "table":
                    _k, _g, gen, world, size, t = msg
                    tables.setdefault(gen, (world, size, t))
                elif msg[0] == "ready":
                    readies[msg[2]] = readies.get(msg[2], 0) + msg[3]
                elif msg[0] == "killed":
                    for wid in msg[3]:
                        killed_at[wid] = msg[2]

        def snapshot():
            """Redis's calls by command and CPU, the generators' counters and ours, at one instant:
            the generators pause between two pipelines while Redis is asked (a few ms)."""
            hold.set()
            deadline = time.monotonic() + 5
            while not all(held[g] for g in range(n_gen)) and time.monotonic() < deadline:
                time.sleep(0.001)
            try:
                calls, rcpu = _snapshot(own("info"))
                return calls, rcpu, _counts(counters, n_gen), dict(own.sent), time.monotonic(), cpu_s()
            finally:
                hold.clear()

        def wait_settled(world: int, limit: float) -> int:
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline:
                drain(0.2)
                if coord.poll() is not None:
                    raise SystemExit(f"the coordinator exited ({coord.returncode}); see {coord_log}")
                gen = _settled(own, keys, world, readies)
                if gen:
                    return gen
            raise SystemExit(f"no settled generation of {world} workers within {limit:.0f} s "
                             f"(readies {readies}); see {coord_log}")

        probe_stop = threading.Event()
        probe: dict = {"confirmed": [], "failed": [], "first_fail": None, "back": None}

        def probe_writer() -> None:
            """Confirmed writes of a counter through the fail-over: each one WAIT confirmed must
            be on the new primary."""
            pc = connect(url, ride_out=0, timeout=1, check=False)
            seq = 0
            while not probe_stop.is_set():
                seq += 1
                p = pc.pipeline(transaction=False)
                p.sadd("bench:probe", seq)
                try:
                    execute_confirmed(pc, p, "probe")
                    probe["confirmed"].append(seq)
                    if probe["first_fail"] is not None and probe["back"] is None:
                        probe["back"] = time.time()
                except redis.RedisError:
                    probe["failed"].append(seq)
                    if probe["first_fail"] is None:
                        probe["first_fail"] = time.time()
                    time.sleep(0.02)
                time.sleep(0.005)
            pc.close()

        try:
            # ---- join and form -----------------------------------------------------------
            # In waves of at most WAVE joins, each let in once a generation holds all the workers
            # before it: a generation that adds about 4,000 members or more at once fails in
            # the coordinator's fenced script (one HSET of every new member's record: Lua's
            # unpack limit, "too many results to unpack"). Until the last wave's generation
            # is out the simulated workers switch to none of them (each is superseded within
            # seconds); from then on they switch to every new one, as workers do.
            t0, c0 = time.monotonic(), cpu_s()
            for p in gens:
                p.start()
            deadline = time.monotonic() + 1800
            per_gen, waves = max(1, WAVE // n_gen), 0
            while True:
                waves += 1
                allowed.value = waves * per_gen
                expect = sum(min(n, allowed.value) for n in sizes)
                while not (len(joined) == n_gen and sum(m[2] for m in joined.values()) >= expect
                           and any(world >= expect for world, _b, _t in tables.values())):
                    drain(0.2)
                    if time.monotonic() > deadline or coord.poll() is not None:
                        raise SystemExit(f"wave {waves}: {sum(m[2] for m in joined.values())} of {expect} joined, "
                                         f"largest generation {max((t[0] for t in tables.values()), default=0)}; "
                                         f"see {coord_log}")
                if expect >= w:
                    break
            row["join_s"] = round(max(t for gen, (world, _b, t) in tables.items() if world >= w)
                                  - min(m[3] for m in joined.values()), 1)
            row["join_waves"] = waves
            row["join_generations"] = len(tables)
            row["join_cpu_s"] = round(cpu_s() - c0, 1)
            assembled.set()
            first_gen = wait_settled(w, 1800)
            row["form_s"] = round(time.monotonic() - t0, 1)
            row["form_cpu_s"] = round(cpu_s() - c0, 1)
            row["table_bytes"] = tables[first_gen][1]
            time.sleep(2 * interval)
            # ---- steady: the background's rate by command (heartbeats, ticks, polls) ----------
            base_len = max(5.0, 3 * interval)
            b0, rb0, g0, o0, tb0, cb0 = snapshot()
            psutil.cpu_percent()
            time.sleep(base_len)
            b1, rb1, g1, o1, tb1, cb1 = snapshot()
            row["steady_machine_cpu"] = round(psutil.cpu_percent() / 100 * (os.cpu_count() or 1), 2)
            row["steady_redis_cpu"] = round((rb1 - rb0) / (tb1 - tb0), 3)
            base_own = _delta(o0, o1)
            idle_rate = {k: v / (tb1 - tb0) for k, v in _minus(_delta(b0, b1), _generated(g0, g1, ha), base_own).items()}
            row["steady_cpu"] = round((cb1 - cb0) / (tb1 - tb0), 3)
            row["steady_commands_per_s"] = round(sum(_delta(b0, b1).values()) / (tb1 - tb0))
            row["idle_commands_per_s"] = round(sum(idle_rate.values()), 1)
            # ---- what a replica holds before the fail-over (a confirmed read) ----------------
            probe_thread = threading.Thread(target=probe_writer, daemon=True)
            probe_thread.start()
            time.sleep(0.5)
            p = client.pipeline(transaction=False)
            p.xrevrange(keys.control, count=50)
            p.hgetall(keys.state)
            p.hlen(keys.workers)
            p.get(keys.epoch)
            ctl_before, state_before, hlen_before, epoch_before = execute_confirmed(client, p, "bench: state before the fail-over")
            last = client.xrevrange(keys.control, count=1)
            cursor = last[0][0].decode() if last else "0-0"
            # ---- kill one in 100, then the primary -------------------------------------------
            kill_t, kill_cpu = time.time(), cpu_s()
            kill.set()
            failover = {}
            if hset is not None:
                time.sleep(failover_at)
                old = hset.kill_primary()
                failover["killed_primary"] = time.time()
                new = hset.wait_failover(old, timeout=60)
                failover["promoted"] = time.time()
                failover["new_port"] = new.port
            drain(1.0)
            # the coordinator's return: its log says when Redis answered it again
            back_t = None
            if hset is not None:
                deadline = time.monotonic() + 60
                while back_t is None and time.monotonic() < deadline:
                    # its return: the job taken again (state reloaded) after the outage it logged
                    down = False
                    for line in coord_log.read_text(errors="replace").splitlines():
                        if "Redis unreachable" in line and _log_time(line) >= kill_t:
                            down = True
                        elif down and "leading with epoch" in line:
                            back_t = _log_time(line)
                            break
                    if back_t is None:
                        time.sleep(0.2)
                time.sleep(1.0)
            probe_stop.set()
            probe_thread.join(10)
            drain(0.5)
            # every control entry a replica held before the fail-over is on the new primary
            p = client.pipeline(transaction=False)
            for sid, _f in ctl_before:
                p.xrange(keys.control, sid, sid)
            missing_ctl = sum(1 for r in (p.execute() if ctl_before else []) if not r)
            victims = set(killed_at)
            # window start: just before the removal is due (the coordinator counts a TTL from
            # its own return after an outage, from the last beat otherwise)
            due = (back_t or kill_t) + ttl - 2.0
            time.sleep(max(0.0, due - time.time()))
            s0, rs0, gs0, os0, ts0, cs0 = snapshot()
            # ---- detection, from the control stream ------------------------------------------
            detected: dict[str, int] = {}
            false_failed: list[str] = []
            removal_gens = []
            deadline = time.monotonic() + ttl + 120
            while len(detected) < len(victims) and time.monotonic() < deadline:
                for _s, entries in own("xread").xread({keys.control: cursor}, count=1000, block=1000) or []:
                    for sid, f in entries:
                        cursor = sid.decode()
                        entry = ControlEntry.from_fields(f)
                        if entry.removed:
                            removal_gens.append(entry.generation)
                        for wid in entry.failed:
                            if wid in victims:
                                detected.setdefault(wid, entry.ts_ms)
                            else:
                                false_failed.append(wid)
                drain()
            det_cpu = cpu_s()
            if len(detected) < len(victims):
                raise SystemExit(f"only {len(detected)} of {len(victims)} killed workers detected; see {coord_log}")
            # ---- the switch: every survivor active in the generation without them -------------
            survivors = w - len(victims) - len(false_failed)
            final_gen = wait_settled(survivors, 900)
            s1, rs1, gs1, os1, ts1, cs1 = snapshot()
            own_cmds = _delta(os0, os1)
            window = ts1 - ts0
            idle = {k: v * window for k, v in idle_rate.items()}
            gross = _minus(_delta(s0, s1), _generated(gs0, gs1, ha), own_cmds)
            switch = {k: round(v) for k, v in _minus(gross, idle).items() if abs(v) >= 0.5}
            state_end = client.hgetall(keys.state)
            unformed_end = JobStatus.from_hash(state_end).formation.unformed_since_ms
            # ---- what the new primary holds ---------------------------------------------------
            probe_set = {int(x) for x in client.smembers("bench:probe")}
            lost_probe = [s for s in probe["confirmed"] if s not in probe_set]
            # (the control entries read before: looked up right after the fail-over, before the
            # switch's entries could trim them; see ctl_check)
            state_after = client.hgetall(keys.state)
            gen_before, gen_after = int(state_before.get(b"generation", 0)), int(state_after.get(b"generation", 0))
            epoch_after = int(client.get(keys.epoch) or 0)
            regressions = int(gen_after < gen_before) + int(epoch_after < int(epoch_before or 0)) + int(client.hlen(keys.workers) < hlen_before)
            states: dict[str, int] = {}
            for rawrec in client.hvals(keys.workers):
                st = WorkerRecord.from_json(rawrec).state.value
                states[st] = states.get(st, 0) + 1
            mem = client.info("memory")
            p = client.pipeline(transaction=False)
            for key in (keys.generations, keys.workers, keys.control, keys.events, keys.shard):
                p.execute_command("MEMORY", "USAGE", key, "SAMPLES", "0")
            key_mem = dict(zip(("generations", "workers", "control", "events", "shard"), (int(x or 0) for x in p.execute())))
            coord_lines = coord_log.read_text(errors="replace").splitlines()
            end_cpu, end_t = cpu_s(), time.monotonic()
            lat = sorted((detected[wid] - killed_at[wid] * 1000) / 1000 for wid in victims)
            q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else lat * 99
            row.update({
                "killed": len(victims), "false_failures": states.get(WorkerState.FAILED.value, 0) - len(victims),
                "detect_p50_s": round(statistics.median(lat), 3), "detect_p99_s": round(q[98], 3), "detect_max_s": round(lat[-1], 3),
                "kill_lag_ms": round(1000 * (max(killed_at.values()) - kill_t)),
                "removal_generations": sorted(set(removal_gens)), "first_generation": first_gen, "final_generation": final_gen,
                "switch_s": round(window, 1), "switch_commands": sum(switch.values()),
                "switch_commands_per_worker": round(sum(switch.values()) / w, 2),
                "switch_commands_gross_per_worker": round(sum(gross.values()) / w, 2),
                "job_state_end": (state_end.get(b"state") or b"").decode(),
                "formation_clock_end_s": (round(unformed_end / 1000 - time.time(), 1) if unformed_end else None),
                "switch_by_command": dict(sorted(switch.items(), key=lambda kv: -kv[1])[:12]),
                "switch_cpu_s": round(cs1 - cs0, 1), "detect_cpu_s": round(det_cpu - kill_cpu, 1),
                "probe_confirmed": len(probe["confirmed"]), "probe_unconfirmed": len(probe["failed"]),
                "lost_probe": len(lost_probe), "lost_control_entries": missing_ctl, "regressions": regressions,
                "lost_writes": len(lost_probe) + missing_ctl + regressions,
                "states": states,
                "coordinator_cpu": round((end_cpu - c0) / (end_t - t0), 3), "coordinator_cpu_s": round(end_cpu - c0, 1),
                "wall_s": round(end_t - t0, 1),
                "redis_used_memory": mem["used_memory_human"], "redis_peak_memory": mem["used_memory_peak_human"],
                "redis_key_mib": {k: round(v / 2**20, 1) for k, v in key_mem.items()},
                "generations_kept": client.xlen(keys.generations),
                "lease_losses": sum("lease not held" in line for line in coord_lines),
                "takeovers": sum("leading with epoch" in line for line in coord_lines),
                "switch_redis_cpu_s": round(rs1 - rs0, 1),
                "late_rounds": _counts(counters, n_gen)["late_rounds"], "beat_errors": _counts(counters, n_gen)["errors"],
                "table_bytes_final": tables.get(final_gen, (0, 0, 0))[1],
            })
            if hset is not None:
                row["failover_s"] = round(failover["promoted"] - failover["killed_primary"], 2)
                row["primary_killed_after_s"] = round(failover["killed_primary"] - kill_t, 2)
                row["coordinator_back_after_s"] = round(back_t - failover["killed_primary"], 2) if back_t else None
                row["probe_outage_s"] = (round(probe["back"] - probe["first_fail"], 2)
                                         if probe["back"] and probe["first_fail"] else None)
                since = sorted(detected[wid] / 1000 - max(killed_at[wid], back_t or 0) for wid in victims)
                row["detect_after_return_p99_s"] = round(statistics.quantiles(since, n=100, method="inclusive")[98]
                                                         if len(since) > 1 else since[0], 3)
            return row
        finally:
            probe_stop.set()


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _stop_generators(gens: list, stop) -> None:
    stop.set()
    for p in gens:
        if p.pid is None:  # never started
            continue
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(5)


def print_one_job(row: dict) -> None:
    ttl = row["ttl_s"]
    print(f"workers={row['workers']} ha={row['ha']} ttl={ttl:g}s interval={row['interval_s']:g}s killed={row['killed']} "
          f"false_failures={row['false_failures']}")
    print(f"join_s={row['join_s']} ({row['join_waves']} waves, {row['join_generations']} generations; coordinator CPU "
          f"{row['join_cpu_s']} s) formed_s={row['form_s']} (all active; coordinator CPU {row['form_cpu_s']} s) "
          f"table_bytes={row['table_bytes']}")
    if row["ha"]:
        print(f"failover: primary killed {row['primary_killed_after_s']} s after the kills, a replica promoted "
              f"{row['failover_s']} s later, the coordinator back {row['coordinator_back_after_s']} s after the primary died "
              f"(workers get the return grace from there); probe writes failed for {row['probe_outage_s']} s")
    print(f"detect_p50={row['detect_p50_s']}s detect_p99={row['detect_p99_s']}s detect_max={row['detect_max_s']}s "
          f"ttl+1s={ttl + 1:g}s within={row['detect_p99_s'] <= ttl + 1}"
          + (f" (from the coordinator's return: p99 {row['detect_after_return_p99_s']}s)" if row["ha"] else ""))
    print(f"switch_commands_per_worker={row['switch_commands_per_worker']} ({row['switch_commands']} commands, "
          f"{row['switch_commands_gross_per_worker']} per worker with the coordinator's idle background "
          f"({row['idle_commands_per_s']}/s when steady) kept, "
          f"{row['switch_s']} s, generations {row['removal_generations']} -> {row['final_generation']}, "
          f"coordinator CPU {row['switch_cpu_s']} s) by command: {row['switch_by_command']}")
    print(f"lost_writes={row['lost_writes']} (probe: {row['probe_confirmed']} confirmed, {row['lost_probe']} missing; "
          f"control entries missing {row['lost_control_entries']}; regressions {row['regressions']})")
    print(f"coordinator_cpu={row['coordinator_cpu']} ({row['coordinator_cpu_s']} s over {row['wall_s']} s; steady "
          f"{row['steady_cpu']}) redis_memory={row['redis_used_memory']} (peak {row['redis_peak_memory']}) "
          f"primary CPU {row['steady_redis_cpu']} steady, {row['switch_redis_cpu_s']} s in the switch; "
          f"steady_commands_per_s={row['steady_commands_per_s']}, machine {row['steady_machine_cpu']} of "
          f"{os.cpu_count()} cores busy")
    print(f"redis memory by key (MiB): {row['redis_key_mib']} ({row['generations_kept']} generation tables kept)")
    print(f"coordinator: lease lost {row['lease_losses']} times (its batch outlasted the lease), took the job "
          f"{row['takeovers']} times")
    print(f"worker states: {row['states']}; late heartbeat rounds {row['late_rounds']}, beat errors {row['beat_errors']}")
    if row["formation_clock_end_s"] is not None:
        print(f"job {row['job_state_end']}; its formation clock still runs ({-row['formation_clock_end_s']} s so far): "
              "a generation that only removed members never counts as formed (a Ready from an Active member is "
              "ignored), so the job fails at formation_timeout unless a worker joins before")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--as-coordinator":  # the coordinator of --one-job
        _raise_worker_cap(int(sys.argv[2]))
        from shoal.ops.cli import main as shoal_main

        return shoal_main(sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1000,5000,10000", help="comma-separated worker counts")
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--ttl", type=float, default=None, help="heartbeat TTL, s (default 3; 10 with --one-job)")
    ap.add_argument("--interval", type=float, default=None, help="heartbeat interval, s (default 1; 2 with --one-job)")
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--one-job", default="", metavar="W[,W...]",
                    help="one job of W workers instead (comma-separated: one run per size); one in 100 killed")
    ap.add_argument("--ha", action="store_true",
                    help="with --one-job: Redis under Sentinel (a primary, 2 replicas, 3 sentinels), the primary "
                         "kill -9'd mid-detection")
    ap.add_argument("--failover-at", type=float, default=0.75, help="with --ha: s after the kills the primary dies")
    ap.add_argument("--generators", type=int, default=4, help="with --one-job: load-generator processes")
    args = ap.parse_args()
    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="shoal-bench-logs-"))
    if args.one_job:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up (the servers, the coordinator) on kill
        ttl, interval = args.ttl or 10.0, args.interval or 2.0
        for w in [int(x) for x in args.one_job.split(",")]:
            row = one_job_point(w, args.ha, ttl, interval, args.failover_at, args.generators, log_dir)
            rows.append(row)
            print(json.dumps(row), flush=True)
            print_one_job(row)
            print(flush=True)
        if len(rows) > 1:
            print(f"{'workers':>8} {'join s':>7} {'detect p99':>11} {'switch cmds/worker':>19} {'lost':>5} {'coord CPU':>10}")
            for r in rows:
                print(f"{r['workers']:>8} {r['join_s']:>7} {r['detect_p99_s']:>10}s {r['switch_commands_per_worker']:>19} "
                      f"{r['lost_writes']:>5} {r['coordinator_cpu']:>9.0%}")
        print(f"logs: {log_dir}")
        return 0
    args.ttl, args.interval = args.ttl or 3.0, args.interval or 1.0
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
