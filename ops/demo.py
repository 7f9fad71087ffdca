"""``shoal demo``: the whole system on one machine in about a minute.

Starts an embedded Redis (AOF on) in a temporary run directory, one coordinator and a node
agent running three workers that train the digits example. Every coordinator decision is
printed with its reason as it happens, with a live progress line. Part way through, one
worker is ``kill -9``'d: the agent reports the death at once, the survivors drop the
interrupted step and carry on in a new generation without restarting, and the agent
starts a replacement that joins mid-epoch and receives the weights by broadcast. Every epoch
ends with an evaluation on held-out glyphs (``eval_every_epochs: 1``). The demo ends with a
summary: final loss and accuracy, the last evaluation, generations, recovery time, and
whether every sample was used exactly once (checked from the workers' ledgers).
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, TextIO

import redis

from shoal.events import envvars
from shoal.coordinator.decide import format_metrics
from shoal.events.keys import job_keys
from shoal.events.records import JobStatus
from shoal.events.models import ShardTable
from shoal.events.streams import ControlEntry, ControlKind
from shoal.core.connection import connect
from shoal.ops.embedded import HASet, start_ha, start_server
from shoal.core.registry import create_job
from shoal.core.jobspec import JobSpec
from shoal.ops.localproc import LocalProcs
from shoal.ops.status import job_status
from shoal.worker import ledger
from shoal.events.states import PLANNED, WorkerState, is_terminal


class Console:
    """Where the demo writes. On a terminal the progress line is redrawn in place (carriage
    return, erase to end of line) and lines that stay are written above it. Anywhere else (a
    pipe, a CI log, a file) no control character is written: progress comes as plain lines,
    at most one every ``every`` seconds of ``clock``, so a log holds a readable record instead
    of thousands of redraws."""

    def __init__(self, stream: TextIO | None = None, *, every: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.stream = stream if stream is not None else sys.stdout
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.every = every
        self.clock = clock
        self._last: float | None = None
        self._dangling = False  # a progress line is drawn without its newline (terminal only)

    def line(self, text: str = "") -> None:
        """A line that stays, below any progress drawn so far."""
        if self._dangling:
            self.stream.write("\r\033[K")
            self._dangling = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def progress(self, text: str) -> None:
        """The current progress: redrawn on a terminal, else printed when ``every`` has passed."""
        if self.tty:
            self.stream.write("\r" + text + "\033[K")
            self._dangling = True
        else:
            now = self.clock()
            if self._last is not None and now - self._last < self.every:
                return
            self._last = now
            self.stream.write(text + "\n")
        self.stream.flush()

    def end(self) -> None:
        """Keeps the last progress drawn on a terminal (it ends its line)."""
        if self._dangling:
            self.stream.write("\n")
            self._dangling = False
            self.stream.flush()


class ControlFeed:
    """Prints the job's control log (decisions with reasons) as it grows."""

    def __init__(self, client: redis.Redis, job: str, t0: float, console: Console):
        self.console = console
        self.client = client
        self.keys = job_keys(job)
        self.last = "0-0"
        self.t0 = t0
        self.generations = 0

    def pump(self, block_ms: int) -> list[ControlEntry]:
        resp = self.client.xread({self.keys.control: self.last}, count=100, block=block_ms)
        out = []
        for _s, entries in resp or []:
            for sid, f in entries:
                self.last = sid.decode()
                d = ControlEntry.from_fields(f)
                out.append(d)
                if d.kind == ControlKind.READY:
                    continue
                self.console.line(f"[{time.monotonic() - self.t0:5.1f}s] gen {d.generation:>2} {d.job_state:<9} {d.reason}")
                if d.planned and not d.paused:
                    self._print_table()
        return out

    def _print_table(self) -> None:
        raw = self.client.get(self.keys.shard)
        if raw:
            t = ShardTable.model_validate_json(raw)
            self.generations = t.generation
            parts = ", ".join(f"{m.worker_id}=" + "+".join(f"[{a},{b})" for a, b, _ in m.ranges) for m in t.members)
            self.console.line(f"         shard table g{t.generation}: positions of each global batch of {t.num_samples}: {parts}")


def _progress(s: dict, t0: float, total_steps: int) -> str:
    active = [w for w in s["workers"] if w["state"] in PLANNED]
    step = max((w["step"] or 0 for w in active), default=0)
    loss = next((w["loss"] for w in active if w["loss"] is not None), None)
    bar = "#" * int(30 * step / max(1, total_steps))
    loss_s = f"{loss:.3f}" if loss is not None else "-"
    return f"[{time.monotonic() - t0:5.1f}s] [{bar:<30}] step {step}/{total_steps} loss {loss_s} workers {len(active)}"


def run_demo(duration: float | None = None, epochs: int = 8, report: str | None = "report.png",
             ha: bool = False) -> int:
    """``ha``: Redis is a Sentinel set (a primary, 2 replicas, 3 sentinels), two coordinator
    replicas run, and after the worker's kill the Redis primary is ``kill -9``'d too."""
    job = "demo"
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shoal-demo-") as tmp:
        tmpdir = Path(tmp)
        if ha:
            server = start_ha(tmpdir / "redis-ha")
            print(f"embedded Redis HA set: primary 127.0.0.1:{server.primary().port}, 2 replicas, 3 sentinels "
                  f"({server.url})")
            client = connect(server.url, ride_out=60, timeout=10)
        else:
            server = start_server(tmpdir / "redis", appendonly=True)
            print(f"embedded Redis at {server.url} (AOF on, in {tmpdir / 'redis'})")
            client = redis.Redis.from_url(server.url, socket_timeout=10)
        spec = JobSpec(name=job, entrypoint="shoal.examples.digits:build", global_batch_size=64, epochs=epochs,
                       min_workers=2, max_workers=3, heartbeat_interval=0.3, heartbeat_ttl=1.5, max_restarts=3, seed=1,
                       eval_every_epochs=1)
        create_job(client, spec)
        total_steps = -(-5000 // spec.global_batch_size) * epochs
        console = Console()
        feed = ControlFeed(client, job, t0, console)
        procs = LocalProcs(server.url, tmpdir / "logs", extra_env={envvars.LEDGER_DIR: str(tmpdir / "ledger")})
        killed = None
        failover: tuple[float, float, int] | None = None  # (killed, promoted: wall time; step)
        try:
            procs.coordinator("coordinator")
            if ha:
                procs.coordinator("coordinator2")
            agent = procs.start("agent", "agent", job, "--workers", "3", "--backoff", "1", "--run-dir", str(tmpdir / "agent"))
            print("started a coordinator and a node agent with 3 workers (training shoal.examples.digits)")
            state = "pending"
            deadline = time.monotonic() + (duration or 600)
            while not is_terminal(state) and time.monotonic() < deadline:
                feed.pump(250)
                s = job_status(client, job)
                state = s["state"]
                console.progress(_progress(s, t0, total_steps))
                steps = [w["step"] or 0 for w in s["workers"] if w["state"] == WorkerState.ACTIVE]
                if killed is None and steps and max(steps) >= total_steps * 0.25 and s["world_size"] == 3:
                    victim = next(w for w in s["workers"] if w["state"] == WorkerState.ACTIVE and w["rank"] == 1)
                    console.line(f"--- kill -9 {victim['worker_id']} (pid {victim['pid']}) at step {max(steps)}")
                    killed = (time.time(), s["generation"])
                    procs_signal(victim["pid"], signal.SIGKILL)
                elif ha and failover is None and steps and max(steps) >= total_steps * 0.5:
                    failover = _fail_over(server, console, max(steps))
            feed.pump(100)
            agent.wait(30)
            final = job_status(client, job)
            summary = JobStatus.from_hash(client.hgetall(job_keys(job).state)).summary
            entries = ledger.read(tmpdir / "ledger")
            verdict = ledger.verify(entries, 5000)
            recovery = recovery_after_kill(entries, *killed) if killed else None
            console.end()
            print("\n=== summary")
            print(f"job state           {final['state']} ({final['reason']})")
            print(f"final loss          {summary.get('loss', float('nan')):.4f}")
            print(f"test accuracy       {summary.get('accuracy', float('nan')):.1%}")
            if final.get("eval"):
                ev = final["eval"]
                print(f"last evaluation     step {ev['step']} ({ev['epoch']} epochs done): {format_metrics(ev['metrics'])}")
            print(f"steps committed     {verdict.steps} ({verdict.epochs_complete} epochs)")
            print(f"generations         {final['generation']}")
            for backend, device, why in sorted({(w["backend"], w["device"] or "?", w["placement"] or "")
                                                for w in final["workers"] if w.get("backend")}):
                print(f"placement           {backend}, model on {device} ({why})")
            if recovery is not None:
                seconds, kept = recovery
                print(f"recovery after kill {seconds:.2f} s from the kill to the first step committed in a newer generation "
                      f"(workers' ledgers); {len(kept)} survivor(s) kept their processes ({', '.join(kept)})")
            if failover is not None:
                gone, promoted, at = failover
                after = [e["t"] for e in entries if e["t"] >= promoted]
                resumed = f"{min(after) - promoted:.2f} s after it" if after else "none after it"
                print(f"Redis fail-over     primary killed at step {at}: a replica promoted {promoted - gone:.2f} s "
                      f"later; first step committed {resumed}")
            print(f"first failure       {final['first_failure'] or '-'}")
            print(f"samples used exactly once per epoch: {'yes' if verdict.ok else 'NO: ' + verdict.problem}")
            if report:
                _write_report(client, job, report)
            return 0 if final["state"] == "completed" and verdict.ok else 1
        finally:
            procs.stop_all()
            client.close()
            server.stop()


def _fail_over(ha: HASet, console: Console, step: int) -> tuple[float, float, int]:
    """``kill -9`` the HA set's primary; returns once the sentinels promoted a replica."""
    old = ha.primary()
    console.line(f"--- kill -9 the Redis primary (127.0.0.1:{old.port}, pid {old.proc.pid}) at step {step}")
    old.kill()
    killed = time.time()
    new = ha.wait_failover(old)
    promoted = time.time()
    console.line(f"--- the sentinels promoted 127.0.0.1:{new.port} {promoted - killed:.2f} s after the kill")
    return killed, promoted, step


def recovery_after_kill(entries: list[dict], killed_at: float, generation: int) -> tuple[float, list[str]] | None:
    """From the workers' ledgers: seconds from the kill (wall time ``killed_at``, when the job
    was in ``generation``) to the first step committed in a newer generation, and the workers
    whose same process committed steps both in ``generation`` and after the kill. None when
    no step was committed after it."""
    after = [e for e in entries if e["generation"] > generation and e["t"] >= killed_at]
    if not after:
        return None
    before = {(e["worker"], e["pid"]) for e in entries if e["generation"] == generation}
    kept = sorted({e["worker"] for e in after if (e["worker"], e["pid"]) in before})
    return min(e["t"] for e in after) - killed_at, kept


def _write_report(client: redis.Redis, job: str, path: str) -> None:
    """``shoal report`` of the run, drawn before the demo's Redis goes away; skipped with a
    note when rank 0 recorded no progress."""
    from shoal.core.errors import ShoalError
    from shoal.ops.report import NoProgress, write_report

    try:
        marks = write_report(client, job, path)
    except NoProgress:
        print("report skipped: no progress history was recorded (rank 0 writes it to the job's progress stream)")
        return
    except ShoalError as exc:
        print(f"report not written: {exc}")
        return
    changes = sum(1 for m in marks if m.kind != "end")
    print(f"report              {Path(path).resolve()} (loss and steps/s; {changes} generation changes marked)")


def procs_signal(pid: int, sig: int) -> None:
    import os

    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
