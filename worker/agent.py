"""The node agent: starts a node's worker processes and restarts crashed ones.

It waits on the children's pidfds, so a death is seen at once (no polling interval, no
heartbeat timeout): the agent reports it as a ``WorkerExited`` event with the exit code or
signal and the last lines of the worker's output, and the coordinator re-plans
immediately. A crashed worker is restarted after an exponential backoff
(``backoff * 2**n``, capped at ``backoff_max``, where ``n`` counts the slot's restarts since
its last healthy run: a worker that ran ``backoff_reset`` seconds before dying starts the
doubling over) until ``max_restarts`` restarts were spent in all (the budget does not reset:
a slot that keeps dying, however slowly, is eventually given up); then the agent gives up on
that slot and says so in the event (the coordinator fails the job if too few
workers remain). The first failure's root cause is recorded by the coordinator and shown
by ``shoal status``. SIGTERM to the agent drains every worker (they finish their step and
leave) and waits for them.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from shoal.events import bus, envvars
from shoal.events.exits import Restart, WorkerExit
from shoal.events.keys import LOGS_MAXLEN, job_keys
from shoal.events.models import WorkerExited, WorkerStartFailed
from shoal.events.streams import LogEntry
from shoal.core.connection import server_run_id
from shoal.core.errors import ConfigError
from shoal.core.registry import create_job
from shoal.core.jobspec import JobSpec
from shoal.storage.code_package import CodePackage, CodePackageError, unpack
from shoal.worker import placement
from shoal.events.states import is_terminal

log = logging.getLogger("shoal.agent")

#: How often the agent checks that its job still exists in Redis.
JOB_CHECK_S = 1.0
#: While Redis is unreachable (past the client's own ride-out), the agent tries again after
#: this many seconds, doubling up to REDIS_RETRY_MAX_S, for as long as it runs: its workers
#: keep training meanwhile, and a worker's exit is reported once Redis is back.
REDIS_RETRY_MIN_S = 0.5
REDIS_RETRY_MAX_S = 30.0
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


@dataclass
class Slot:
    index: int
    proc: subprocess.Popen | None = None
    pidfd: int | None = None
    restarts: int = 0
    #: restarts since the worker last ran ``backoff_reset`` seconds: the backoff's exponent
    streak: int = 0
    start_at: float = 0.0
    #: size of the slot's log when its current process started (its output follows)
    log_start: int = 0
    done: bool = False
    gave_up: bool = False
    #: monotonic times of every start and exit, and each restart's backoff (for status/tests)
    spawns: list = field(default_factory=list)
    exits: list = field(default_factory=list)
    delays: list = field(default_factory=list)

    def id_file(self, run_dir: Path) -> Path:
        return run_dir / f"slot-{self.index}.id"

    def log_file(self, run_dir: Path) -> Path:
        return run_dir / f"slot-{self.index}.log"


def restart_delay(streak: int, backoff: float, backoff_max: float) -> float:
    """The wait before a slot's next start after ``streak`` restarts in a row without a healthy run."""
    return min(backoff_max, backoff * (2 ** min(streak, 62)))


#: How much of a dead worker's output is reported (``WorkerExited.traceback`` holds 8000).
REPORT_CHARS = 8000


def failure_report(path: Path, start: int = 0, lines: int = 15) -> str:
    """What a dead worker's output (the log from byte ``start``, where this process's output
    began) says about its end: from its last Python traceback on, when there is one (cut
    from the front to REPORT_CHARS, so the exception line stays), else its last ``lines``
    lines."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - 8 * REPORT_CHARS))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    start = text.rfind("Traceback (most recent call last):")
    out = text[start:] if start >= 0 else "\n".join(text.splitlines()[-lines:])
    return out.rstrip()[-REPORT_CHARS:]


class NodeAgent:
    """Runs ``workers`` worker processes of ``job_id`` on this node. Drive with
    :meth:`run_once` (tests) or :meth:`run`. Not thread-safe."""

    def __init__(
        self,
        client: redis.Redis,
        redis_url: str,
        job_id: str,
        workers: int,
        *,
        run_dir: Path,
        max_restarts: int = 3,
        backoff: float = 0.5,
        backoff_max: float = 30.0,
        backoff_reset: float = 60.0,
        node: str | None = None,
        extra_env: dict[str, str] | None = None,
        spec: JobSpec | None = None,
        gpus: list[str] | None = None,
    ):
        self.client = client
        self.redis_url = redis_url
        self.keys = job_keys(job_id)
        self.job_id = job_id
        self.run_dir = run_dir
        self.max_restarts = max_restarts
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.backoff_reset = backoff_reset
        self.node = node or socket.gethostname()
        self.extra_env = extra_env or {}
        self.slots = [Slot(i) for i in range(workers)]
        #: the node's GPUs as ``CUDA_VISIBLE_DEVICES`` names them (default: those this
        #: process sees), each slot's, and the node's placement for the job's backend and
        #: device (None, with ``refused`` saying why, when the spec cannot be honoured here)
        want_device = spec.device if spec is not None else "auto"
        self.gpus = list(gpus) if gpus is not None else (placement.visible_gpus() if want_device != "cpu" else [])
        self.slot_gpus = placement.slot_gpus(workers, self.gpus)
        self.placement: placement.Placement | None = None
        self.refused = ""
        try:
            self.placement = placement.choose(spec.backend if spec is not None else "auto", want_device,
                                              gpus=len(self.gpus), workers=workers, node=node or socket.gethostname())
        except placement.PlacementRefused as exc:
            self.refused = str(exc)
        else:
            log.info("placement of %d worker(s) on node %s: %s%s", workers, self.node, self.placement.describe(),
                     f"; GPUs by slot: {', '.join(map(str, self.slot_gpus))}" if self.placement.device == "cuda" else "")
        #: the unpacked ``working_dir`` of the job: its workers' cwd and first sys.path entry
        #: (None: the job ships no code; the workers run in the agent's directory)
        self.code_dir: Path | None = None
        self._code: CodePackage | None = None
        self._code_ready = False
        #: the command each slot runs (tests substitute a cheap one)
        self.worker_argv = [sys.executable, "-m", "shoal", "worker", job_id, "--node", self.node]
        self.stop = threading.Event()
        self._draining = False
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir.resolve()  # the workers may run in another directory
        self.spec = spec
        self._server_id = server_run_id(client) if spec is not None else ""
        self._next_job_check = 0.0
        self.reregistered = 0
        #: events not yet delivered because Redis was unreachable, oldest first
        self._outbox: list[WorkerExited] = []
        #: Redis outages this agent waited out (each one past the client's ride-out)
        self.redis_outages = 0

    # ---- the job -----------------------------------------------------------------------------

    def _check_job(self, now: float) -> None:
        """Every JOB_CHECK_S: if the job's spec vanished, tell a Redis that lost its data (a
        new server ``run_id``) from a deliberate ``shoal delete`` (same server). A lost job is
        registered again from the spec this agent holds, so its running workers rejoin with
        their state (see ``WorkerRunner.rejoin_evicted``); a deleted one is drained."""
        if self.spec is None or now < self._next_job_check or self._draining:
            return
        self._next_job_check = now + JOB_CHECK_S
        if self.client.exists(self.keys.spec):
            return
        server = server_run_id(self.client)
        if server == self._server_id:
            log.warning("job %s was deleted; draining its workers", self.job_id)
            self.stop.set()
            return
        try:
            code = self._code
            create_job(self.client, self.spec, also=(lambda pipe: code.write(pipe, self.keys.code)) if code else None)
            self.reregistered += 1
            log.warning("job %s vanished with Redis's data (server %s -> %s); registered it again from its spec",
                        self.job_id, self._server_id[:8], server[:8])
        except ConfigError:
            pass  # another agent of the job was first
        self._server_id = server

    # ---- the job's code ----------------------------------------------------------------------

    def _prepare_code(self) -> None:
        """Once, before the first worker starts: unpack the job's code package (its
        ``working_dir``) into this agent's run directory. When it is missing or corrupt, no
        worker can run: every slot is reported as not started (WorkerStartFailed, given up,
        with the cause) and the agent gives up, so the job fails visibly."""
        if self._code_ready:
            return
        try:
            package = CodePackage.read(self.client, self.keys.code)
            if package is None and self.spec is not None and self.spec.working_dir:
                raise CodePackageError(f"the job has working_dir {self.spec.working_dir} but no code package in "
                                       f"Redis ({self.keys.code})")
            if package is not None:
                self.code_dir = unpack(package, self.run_dir)
                log.info("job code (working_dir, %d files, sha256 %s...) unpacked in %s", package.files,
                         package.sha256[:12], self.code_dir)
            self._code, self._code_ready = package, True
        except CodePackageError as exc:
            log.error("%s; no worker can start", exc)
            self._code_ready = True
            for slot in self.slots:  # queued first: delivered later if Redis is down now
                slot.done = slot.gave_up = True
                self._outbox.append(WorkerStartFailed(job_id=self.job_id, node=self.node, slot=slot.index,
                                                      traceback=str(exc), will_restart=False, gave_up=True))
            self._flush()
            self._log(f"{self.node}/agent", f"no worker can start on node {self.node}: {exc}")

    # ---- placement ---------------------------------------------------------------------------

    def _check_placement(self) -> None:
        """Once, before the first worker starts: when the job's backend or device cannot be
        honoured on this node (``backend: nccl`` with more workers than GPUs, no GPU for
        ``device: cuda``), no worker starts: every slot is reported as not started (given up,
        with the cause: the job fails when too few workers remain), the cause goes to the
        job's log stream, and PlacementRefused (one line) ends the agent."""
        if not self.refused or all(s.done for s in self.slots):
            return
        for slot in self.slots:
            slot.done = slot.gave_up = True
            self._outbox.append(WorkerStartFailed(job_id=self.job_id, node=self.node, slot=slot.index,
                                                  traceback=self.refused, will_restart=False, gave_up=True))
        log.error("no worker can start on node %s: %s", self.node, self.refused)
        try:
            self._flush()
            self._log(f"{self.node}/agent", f"no worker can start on node {self.node}: {self.refused}")
        except _REDIS_DOWN:
            log.warning("Redis is unreachable: the job does not know yet that node %s starts no worker", self.node)
        raise placement.PlacementRefused(self.refused)

    # ---- processes ---------------------------------------------------------------------------

    def _spawn(self, slot: Slot) -> None:
        env = dict(os.environ)
        # the node's cores are shared by its workers: don't let each start one thread per core
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(self.slots))))
        env.update(self.extra_env)
        if self.placement is not None:  # its GPU alone, the backend and device (shoal.worker.placement)
            env.update(placement.slot_env(self.placement, slot.index, len(self.slots), self.slot_gpus[slot.index]))
        # envvars.AGENT_PID: the worker knows it has an agent, and that it is orphaned once its
        # parent is no longer this process (shoal.worker.lifeline)
        env.update({"REDIS_URL": self.redis_url, "PYTHONUNBUFFERED": "1",
                    envvars.WORKER_ID_FILE: str(slot.id_file(self.run_dir)), envvars.AGENT_PID: str(os.getpid())})
        if self.code_dir is not None:  # like Ray's working_dir: the cwd, and first on sys.path
            env["PYTHONPATH"] = os.pathsep.join([str(self.code_dir), *filter(None, [env.get("PYTHONPATH")])])
        slot.id_file(self.run_dir).unlink(missing_ok=True)
        with open(slot.log_file(self.run_dir), "ab") as out:
            slot.log_start = out.tell()
            slot.proc = subprocess.Popen(self.worker_argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.code_dir)
        slot.pidfd = os.pidfd_open(slot.proc.pid)
        slot.spawns.append(time.monotonic())
        gpu = f" on GPU {env[placement.VISIBLE_ENV]}" if self.placement and self.placement.device == "cuda" else ""
        log.info("slot %d: started worker pid %d%s (restart %d/%d)", slot.index, slot.proc.pid, gpu, slot.restarts,
                 self.max_restarts)

    def _job_over(self) -> bool:
        return is_terminal(self.client.hget(self.keys.state, "state"))

    def _send(self, ev: WorkerExited | WorkerStartFailed) -> None:
        """Publish ``ev`` after any undelivered ones; kept for later when Redis is down."""
        self._outbox.append(ev)
        self._flush()

    def _log_crash(self, who: str, pid: int, how: str, tail: str) -> None:
        """Put a crashed worker's last output into the job's log stream (``shoal logs``): a
        traceback printed by a dying process never went through its Redis log handler."""
        msg = f"worker process {pid} on node {self.node} died with {how}" + (f":\n{tail.rstrip()}" if tail.strip() else "")
        self._log(who, msg)

    def _log(self, who: str, msg: str, level: str = "ERROR") -> None:
        """One line of the job's log stream (``shoal logs``) from this agent. Raises redis errors."""
        entry = LogEntry(worker=who, level=level, msg=msg, ts=round(time.time(), 3))
        self.client.xadd(self.keys.logs, entry.to_fields(), maxlen=LOGS_MAXLEN, approximate=True)

    def _flush(self) -> None:
        """Deliver queued events in order. Raises the Redis error when Redis is still down
        (the events stay queued)."""
        while self._outbox:
            bus.publish(self.client, self.keys.events, self._outbox[0])
            self._outbox.pop(0)

    def _reap(self, slot: Slot) -> None:
        proc = slot.proc
        rc = proc.wait()
        slot.exits.append(time.monotonic())
        os.close(slot.pidfd)
        slot.proc, slot.pidfd = None, None
        wid_path = slot.id_file(self.run_dir)
        wid = wid_path.read_text().strip() if wid_path.exists() else None
        code = WorkerExit.parse(rc)  # None: a crash's own code, or a signal (rc < 0)
        if code is WorkerExit.OK:
            slot.done = True
            log.info("slot %d: worker %s exited cleanly", slot.index, wid)
            return
        if code is not None and code.restart is Restart.AT_ONCE:
            try:
                over = self._draining or self._job_over()
            except _REDIS_DOWN:
                over = False
            if not over:
                # not a crash (shoal.worker.restart): its HSDP replica group lost a member, or
                # the progress watchdog restarted it; start it again at once, nothing spent
                slot.start_at = time.monotonic()
                log.info("slot %d: worker %s (pid %d) asked to be started again (its replica group went, or the "
                         "progress watchdog restarted it); starting it again", slot.index, wid, proc.pid)
                return
        if code is WorkerExit.JOIN_REJECTED and not wid:
            # the job refused it (at max_workers, or already ended): not a crash, and starting
            # it again would only be refused again; the coordinator counts it in the job's record
            slot.done = True
            log.warning("slot %d: the job refused the worker (pid %d): %s; not restarting it", slot.index, proc.pid,
                        failure_report(slot.log_file(self.run_dir), slot.log_start, lines=1))
            return
        sig = -rc if rc < 0 else None
        # asked to stop (SIGTERM) while Redis was unreachable, it could not leave the job: not
        # a crash and not to be restarted (it was asked to stop), but reported, so that the
        # coordinator re-plans without it once Redis is back (shoal.worker.lifeline)
        stopped = code is WorkerExit.STOPPED_IN_OUTAGE
        try:
            over = self._draining or (not stopped and self._job_over())
        except _REDIS_DOWN:
            over = False  # Redis is down: assume the job goes on (the restart waits for Redis)
        will_restart = not over and not stopped and slot.restarts < self.max_restarts
        slot.gave_up = not over and not stopped and not will_restart
        # a signal leaves no traceback; the log tail then is only the last ordinary line
        tail = failure_report(slot.log_file(self.run_dir), slot.log_start) if rc > 0 else ""
        how = f"signal {signal.Signals(sig).name}" if sig else f"exit code {rc}"
        log.warning("slot %d: worker %s (pid %d) %s with %s%s", slot.index, wid, proc.pid,
                    "stopped during a Redis outage without leaving the job" if stopped else "died", how,
                    "; restarting" if will_restart else ("; giving up" if slot.gave_up else ""))
        if wid:
            ev: WorkerExited | WorkerStartFailed = WorkerExited(
                job_id=self.job_id, worker_id=wid, exit_code=None if sig else rc, signal=sig, traceback=tail,
                will_restart=will_restart, gave_up=slot.gave_up, restarts=slot.restarts, pid=proc.pid)
        else:  # it ended before it joined: no worker id, but the crash must still be seen
            ev = WorkerStartFailed(job_id=self.job_id, node=self.node, slot=slot.index, pid=proc.pid,
                                   exit_code=None if sig else rc, signal=sig, traceback=tail,
                                   will_restart=will_restart, gave_up=slot.gave_up, restarts=slot.restarts)
        try:
            self._send(ev)  # queued first: it is delivered later if Redis is down
            self._log_crash(wid or f"{self.node}/slot{slot.index}", proc.pid, how, tail)
        except _REDIS_DOWN:
            log.warning("slot %d: Redis is unreachable; the exit of %s is reported when it is back", slot.index,
                        wid or f"pid {proc.pid}")
        if will_restart:
            if slot.spawns and slot.exits[-1] - slot.spawns[-1] >= self.backoff_reset:
                slot.streak = 0  # it ran healthy for a while: this crash is not part of a loop
            delay = restart_delay(slot.streak, self.backoff, self.backoff_max)
            slot.streak += 1
            slot.restarts += 1
            slot.delays.append(delay)
            slot.start_at = time.monotonic() + delay
        else:
            slot.done = True

    # ---- loop --------------------------------------------------------------------------------

    def _reap_exits(self, timeout: float) -> None:
        """Wait up to ``timeout`` for children to exit and handle their exits; no Redis
        needed (a report is queued while it is down), no worker started."""
        live = [s for s in self.slots if s.proc is not None]
        if not live:
            self.stop.wait(timeout)
            return
        ready, _, _ = select.select([s.pidfd for s in live], [], [], timeout)
        for s in live:
            if s.pidfd in ready:
                self._reap(s)

    def run_once(self, timeout: float = 0.5) -> bool:
        """Start due slots, wait up to ``timeout`` for a child to exit, handle exits.
        Returns False once every slot is finished."""
        now = time.monotonic()
        self._flush()
        self._check_job(now)
        self._check_placement()
        self._prepare_code()
        if self.stop.is_set() and not self._draining:
            self._draining = True
            for s in self.slots:
                if s.proc is not None:
                    s.proc.send_signal(signal.SIGTERM)
        for s in self.slots:
            if s.proc is None and not s.done and now >= s.start_at:
                if self._draining or self._job_over():
                    s.done = True
                else:
                    self._spawn(s)
        live = [s for s in self.slots if s.proc is not None]
        if not live:
            pending = [s.start_at for s in self.slots if not s.done]
            if not pending:
                return False
            self.stop.wait(max(0.0, min(min(pending) - now, timeout)))
            return True
        waits = [s.start_at - now for s in self.slots if s.proc is None and not s.done]
        wait = max(0.0, min([timeout, *waits]))
        ready, _, _ = select.select([s.pidfd for s in live], [], [], wait)
        for s in live:
            if s.pidfd in ready:
                self._reap(s)
        return any(not s.done for s in self.slots)

    def run(self, every: Callable[[], None] | None = None) -> int:
        """Until every slot is done; exit code 1 if any slot gave up.

        Redis being unreachable ends nothing: the workers keep running (they ride out the
        outage themselves), their exits are reaped and queued for reporting, no worker is
        started, and the agent tries Redis again with backoff (logged once per outage) for as
        long as it runs. A job deleted meanwhile is noticed once Redis is back.

        ``every`` (the launch unit's progress report) is called after each pass while Redis is
        reachable; a Redis error it raises counts as an outage like the agent's own. Any
        other exception (and a SystemExit or KeyboardInterrupt) ends the loop, and the workers
        still running are killed."""
        down_since: float | None = None
        delay = REDIS_RETRY_MIN_S
        try:
            while True:
                try:
                    if not self.run_once():
                        break
                    if every is not None:
                        every()
                except _REDIS_DOWN as exc:
                    if down_since is None:
                        down_since, delay = time.monotonic(), REDIS_RETRY_MIN_S
                        self.redis_outages += 1
                        log.warning("Redis is unreachable (%s); the workers keep running, retrying with backoff "
                                    "up to %.0f s", exc, REDIS_RETRY_MAX_S)
                    self._reap_exits(delay)
                    delay = min(2 * delay, REDIS_RETRY_MAX_S)
                    continue
                if down_since is not None:
                    log.warning("Redis is reachable again after %.1f s", time.monotonic() - down_since)
                    down_since = None
        finally:
            self.kill_all()
        return 1 if any(s.gave_up for s in self.slots) else 0

    def kill_all(self) -> None:
        """SIGKILL every worker still running and reap it (the end of a cold shutdown)."""
        for s in self.slots:
            if s.proc is not None:
                s.proc.kill()
                s.proc.wait()
