"""Redis commands and time per generation switch vs world size: the O(W) rendezvous of
issue 17 side by side with the one before it, in one run.

    .venv/bin/python -m bench.rendezvous_bench [--worlds 2,4,8,16] [--repeat 2] [--quick]

For each rendezvous (``new``; ``legacy``: ``SHOAL_RENDEZVOUS_LEGACY=1``, every peer address
read key by key and a barrier polled every 2 ms) one job of ``max(worlds) + 1`` worker
processes trains a tiny model; then, one at a time, a member is killed (``kill -9``, reported
at once as a node agent would) until ``min(worlds)`` remain: every kill is one switch into
the world size left. Jobs alternate between the two rendezvous (A/B, ``--repeat`` times).
Per switch:

- **commands**: every command Redis executed (``INFO commandstats``, commands run inside
  Lua scripts included) from the kill until every survivor committed a step in the new
  generation (+ 0.5 s for the switch's trailing writes), minus the job's background rate
  (heartbeats, watchers, coordinator ticks, training) measured over a quiet second just
  before the kill; ``reads``: the rendezvous' blocking reads alone (``BLMOVE`` + ``BLPOP``,
  no background; the legacy barrier's polls are ``SCARD`` + ``GET`` + ``HGET`` in ``commands``);
- **switch**: the kill -> the first committed step of the new generation (any survivor), and
  -> every survivor's (``all``), from the workers' ledgers.

Prints one line per world size and rendezvous, then the exponent of commands vs W for
each (log-log least squares, over every W and over the two largest: a fixed cost per switch -
the coordinator's decision, events - bends the fit over small W below 1), and the fit
``a + b W + c W^2`` of the blocking reads, whose ``c`` is their quadratic part.
``--quick``: W = 2, 4, 8, one job each (about 3 minutes on 2 cores; the default, about 12).
Processes share this machine's cores: switch times are inflated by every other process
running; commands are not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from shoal.worker.userapi import TrainingSetup

BATCH = 64
#: the rendezvous' blocking reads (the store's, the barrier's): nothing else sends them while
#: a job trains
READS = ("blmove", "blpop")
QUIET_S = 1.0  # the background window before each kill
SETTLE_S = 0.5  # after the last survivor's first step: the switch's trailing writes


def build() -> TrainingSetup:
    """The tiny model every worker trains (a switch costs what it costs, not the model)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4096, 16, generator=g), torch.randint(0, 4, (4096,), generator=g)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return TrainingSetup(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                         dataset=torch.utils.data.TensorDataset(x, y),
                         loss_fn=lambda out, target: nn.functional.cross_entropy(out, target, reduction="sum"))


class LedgerTail:
    """Follows the workers' ledgers (local files: no Redis traffic) incrementally."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._pos: dict[Path, int] = {}
        #: worker id -> [(t, step, generation, pid)]
        self.by_worker: dict[str, list[tuple[float, int, int, int]]] = defaultdict(list)

    def poll(self) -> None:
        for f in self.directory.glob("ledger-*.jsonl"):
            with open(f, "rb") as fh:
                fh.seek(self._pos.get(f, 0))
                data = fh.read()
            end = data.rfind(b"\n") + 1  # a line being written is read next time
            self._pos[f] = self._pos.get(f, 0) + end
            for line in data[:end].splitlines():
                e = json.loads(line)
                self.by_worker[e["worker"]].append((e["t"], e["step"], e["generation"], e["pid"]))

    def generation(self) -> int:
        return max((es[-1][2] for es in self.by_worker.values() if es), default=0)


def _stats(client) -> tuple[float, dict[str, int]]:
    raw = client.info("commandstats")
    return time.time(), {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in raw.items() if k != "cmdstat_info"}


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b)}


def _wait(pred, timeout: float, what: str, interval: float = 0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(interval)
    raise TimeoutError(f"bench: no {what} within {timeout:.0f} s")


def run_job(url: str, tmp: Path, mode: str, worlds: list[int], tag: str, verbose: bool = False) -> list[dict]:
    """One job of ``max(worlds) + 1`` workers, killed one by one down to ``min(worlds)``;
    one row per switch."""
    import redis

    from shoal.core.jobspec import JobSpec
    from shoal.core.registry import create_job
    from shoal.events import bus
    from shoal.events.keys import job_keys
    from shoal.events.models import StopJob, WorkerExited
    from shoal.ops.localproc import LocalProcs
    from shoal.worker.store import LEGACY_ENV
    from tests.helpers import ControlWatcher

    client = redis.Redis.from_url(url)
    job = f"rdzv-{mode}-{tag}"
    n = max(worlds) + 1
    create_job(client, JobSpec(name=job, entrypoint="bench.rendezvous_bench:build", global_batch_size=BATCH,
                               min_workers=1, max_workers=n, epochs=10_000, heartbeat_interval=1.0, heartbeat_ttl=10.0))
    watch = ControlWatcher(client, job)
    lg = tmp / f"ledger-{job}"
    env = {"SHOAL_LEDGER_DIR": str(lg), LEGACY_ENV: "1" if mode == "legacy" else ""}
    rows: list[dict] = []
    with LocalProcs(url, tmp / f"logs-{job}", extra_env=env) as procs:
        procs.coordinator(f"coord-{job}")
        for i in range(n):
            procs.worker(job, f"w{i}")
        watch.wait_for(lambda d: d.world_size == n, 600)
        tail = LedgerTail(lg)
        alive = n
        while alive > min(worlds):
            def steady() -> bool:  # every member committed 3 steps in the newest generation
                tail.poll()
                gen = tail.generation()
                live = [w for w, es in tail.by_worker.items() if sum(1 for e in es if e[2] == gen) >= 3]
                return len(live) == alive

            _wait(steady, 300, f"steady state at world size {alive}", interval=0.05)
            gen = tail.generation()
            members = sorted((w for w, es in tail.by_worker.items() if es[-1][2] == gen), key=lambda w: int(w[1:]))
            victim = members[-1]
            pid = tail.by_worker[victim][-1][3]
            t0, s0 = _stats(client)
            time.sleep(QUIET_S)
            t1, s1 = _stats(client)
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            bus.publish(client, job_keys(job).events, WorkerExited(job_id=job, worker_id=victim, signal=9, pid=pid))
            survivors = [w for w in members if w != victim]

            def switched() -> dict[str, float] | None:
                tail.poll()
                first = {w: next((e[0] for e in tail.by_worker[w] if e[2] > gen), None) for w in survivors}
                return first if all(v is not None for v in first.values()) else None

            first = _wait(switched, 120, f"switch into world size {alive - 1}")
            time.sleep(SETTLE_S)
            t2, s2 = _stats(client)
            bg, window = _delta(s0, s1), _delta(s1, s2)
            rate = {k: v / (t1 - t0) for k, v in bg.items()}
            commands = sum(window.values()) - sum(rate.values()) * (t2 - t1)
            reads = sum(window.get(k, 0) - rate.get(k, 0.0) * (t2 - t1) for k in READS)
            alive -= 1
            rows.append({"mode": mode, "world": alive, "commands": commands, "reads": reads,
                         "background": sum(rate.values()) * (t2 - t1),
                         "switch_s": min(first.values()) - killed, "all_s": max(first.values()) - killed})
            print(f"  {mode:6} W={alive:2}: {commands:7.0f} commands ({reads:6.0f} reads; background "
                  f"{rows[-1]['background']:.0f} subtracted), switch {rows[-1]['switch_s']:.3f} s "
                  f"(all {rows[-1]['all_s']:.3f} s)", flush=True)
            if verbose:
                net = {k: window.get(k, 0) - rate.get(k, 0.0) * (t2 - t1) for k in window}
                print("          " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(net.items(), key=lambda kv: -kv[1])[:12]))
        bus.publish(client, job_keys(job).events, StopJob(job_id=job, reason="bench done"))
        watch.wait_for(lambda d: d.job_state == "stopped", 120)
    client.close()
    return rows


def exponent(points: list[tuple[int, float]]) -> float:
    """Slope of log(y) over log(W), least squares."""
    xs = [math.log(w) for w, _ in points]
    ys = [math.log(max(y, 1.0)) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def quadratic(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """``(a, b, c)`` of ``y = a + b W + c W^2``, least squares (three or more world sizes)."""
    rows = [[1.0, float(w), float(w * w)] for w, _ in points]
    ys = [y for _, y in points]
    # normal equations, 3x3, by Cramer's rule
    m = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    v = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(3)]

    def det(a: list[list[float]]) -> float:
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1]) - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))

    d = det(m)
    return tuple(det([[v[r] if c == k else m[r][c] for c in range(3)] for r in range(3)]) / d for k in range(3))


def main() -> int:
    ap = argparse.ArgumentParser(description="Redis commands and time per generation switch vs world size")
    ap.add_argument("--worlds", default="2,4,8,16", help="world sizes after the switch (default 2,4,8,16)")
    ap.add_argument("--repeat", type=int, default=2, help="jobs per rendezvous, A/B interleaved (default 2)")
    ap.add_argument("--quick", action="store_true", help="W = 2, 4, 8 and one job each (a few minutes)")
    ap.add_argument("--verbose", action="store_true", help="print each switch's busiest commands")
    args = ap.parse_args()
    worlds = [2, 4, 8] if args.quick else sorted(int(w) for w in args.worlds.split(","))
    repeat = 1 if args.quick else args.repeat
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from shoal.ops.embedded import start_server

    print(f"rendezvous bench: W = {worlds}, {repeat} job(s) per rendezvous, {os.cpu_count()} cores, "
          f"load average before {os.getloadavg()[0]:.2f}", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="shoal-rdzv-bench-") as t:
        tmp = Path(t)
        server = start_server(tmp / "redis", appendonly=False)
        try:
            for rep in range(repeat):
                for mode in (("new", "legacy") if rep % 2 == 0 else ("legacy", "new")):
                    rows += run_job(server.url, tmp, mode, worlds, str(rep), args.verbose)
        finally:
            server.stop()
    print(f"\nper generation switch (median of {repeat} job(s) per rendezvous; kill -9 of one member, reported at once):")
    print(f"{'W':>3} {'commands new':>13} {'legacy':>8} {'ratio':>6}  {'reads new':>9} {'legacy':>7}  "
          f"{'switch new':>10} {'legacy':>8}  {'all new':>8} {'legacy':>8}")
    med: dict[tuple[str, int], dict[str, float]] = {}
    for mode in ("new", "legacy"):
        for w in worlds:
            mine = [r for r in rows if r["mode"] == mode and r["world"] == w]
            med[mode, w] = {k: statistics.median(r[k] for r in mine) for k in ("commands", "reads", "switch_s", "all_s")}
    for w in worlds:
        a, b = med["new", w], med["legacy", w]
        print(f"{w:>3} {a['commands']:>13.0f} {b['commands']:>8.0f} {a['commands'] / b['commands']:>6.3f}  "
              f"{a['reads']:>9.0f} {b['reads']:>7.0f}  {a['switch_s']:>9.3f}s {b['switch_s']:>7.3f}s  "
              f"{a['all_s']:>7.3f}s {b['all_s']:>7.3f}s")
    top = worlds[-2:]
    for mode in ("new", "legacy"):
        cmds = [(w, med[mode, w]["commands"]) for w in worlds]
        reads = [(w, med[mode, w]["reads"]) for w in worlds]
        line = (f"exponent of commands vs W, {mode}: {exponent(cmds):.2f} (W {worlds[0]}-{worlds[-1]}), "
                f"{exponent(cmds[-2:]):.2f} (W {top[0]}-{top[1]}); reads: {exponent(reads):.2f}, {exponent(reads[-2:]):.2f}")
        if len(worlds) >= 3:
            a, b, c = quadratic(reads)
            line += f"; reads = {a:.1f} + {b:.2f} W + {c:.2f} W^2"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
