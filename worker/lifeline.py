"""What ends a worker that nobody else can end: an orphan without Redis, a stop without Redis.

A worker rides out a Redis outage (:meth:`shoal.worker.runner.WorkerRunner.run`): its model
and optimizer stay in memory and it goes on where it was once Redis is back. Two cases must
not ride it out for as long as the outage lasts:

* **Orphaned, and no Redis.** Its node agent died without stopping it (SIGKILL, the OOM
  killer) while Redis is unreachable: nothing can see it, drain it or stop it, and nothing
  would restart it. Once it has had neither its agent nor an answer from Redis for
  :func:`orphan_bound` seconds (:data:`ORPHAN_REDIS_S`, 60 s, unless ``SHOAL_ORPHAN_REDIS_S``
  says otherwise), it logs one line with the cause and exits with ``WorkerExit.ORPHANED`` (76). An
  orphan whose Redis answers trains on: its coordinator still sees it (heartbeats), counts
  its steps and can end it (the job's end, an eviction), and it ends as above if Redis goes
  away later.
* **Asked to stop (SIGTERM) during an outage.** A drain leaves through Redis (``leave``,
  then ``left``); with Redis gone it cannot, and the worker's Redis calls ride out for up to
  a minute each. Once the stop was asked and Redis has not answered for :data:`STOP_REDIS_S`
  seconds since (or since its last answer, if that came later), the worker logs one line
  and exits with ``WorkerExit.STOPPED_IN_OUTAGE`` (77). Its node agent does not restart it (it was
  asked to stop) and reports the exit, so the coordinator re-plans without it once Redis is
  back.

Nothing is lost either way: a step is only committed while Redis confirms the worker's
heartbeat (the commit fence: past the heartbeat TTL without a confirmed beat nothing is
committed), so the step in progress is not one, and the job's state lives on in its other
members and its checkpoints. The exit is immediate (``os._exit``, from the lifeline's thread):
the training thread may be inside a minute-long Redis retry or a collective, and whatever
waits on Redis in clean-up would wait as long. The loader processes die with the worker
(``PR_SET_PDEATHSIG``); a checkpoint being written is left without its manifest and ignored,
as after a SIGKILL.

**Orphanhood.** The node agent names itself in ``SHOAL_AGENT_PID`` (:data:`AGENT_PID_ENV`)
when it starts a worker. A worker whose parent is that process at start has an agent, and
is orphaned once its parent changes: the kernel re-parents the children of a dead process
(to init or the nearest subreaper), so ``getppid()`` differs from the agent's pid from then
on, whatever pid numbers are reused meanwhile. A worker started without an agent (plain
``shoal worker``, or the variable inherited by a process the agent did not start) has none
and is never an orphan: whoever started it manages it.

**The stop** is the worker's ``stop`` event (set by its SIGTERM handler), and, started from
the main thread, the signal itself: Python runs a signal handler only when the main thread
gets back to Python code, which a thread blocked in C (a collective) may not do for a long
time, so the lifeline also reads the signal's number from a wakeup fd
(``signal.set_wakeup_fd``), written by the C-level handler at once.

**Reachability** is asked by the lifeline itself, only while it matters (orphaned, or
stopping): a PING every :data:`PROBE_S` seconds on a connection of its own that does not
retry and waits at most :data:`PROBE_TIMEOUT_S` (a blackholed server must not hold the
answer), from a thread of its own (a Sentinel lookup through unreachable sentinels may take
longer; meanwhile, no answer counts as none).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import redis

from shoal.events import envvars
from shoal.core.connection import without_retries
from shoal.events.exits import WorkerExit

log = logging.getLogger("shoal.worker.lifeline")

#: The environment variable in which the node agent names itself (its pid) to its workers.
AGENT_PID_ENV = envvars.AGENT_PID
#: How long an orphaned worker goes on without an answer from Redis before it exits: as long
#: as its Redis commands ride out an outage (``RIDE_OUT_S``) and as it waits for a job lost
#: with Redis's data (``LOST_JOB_WAIT_S``). A Sentinel fail-over (2-3 s) or a Redis restart
#: from its AOF is ridden out; an outage longer than this ends the orphan.
ORPHAN_REDIS_S = 60.0
#: Overrides :data:`ORPHAN_REDIS_S` (seconds, > 0), e.g. in the node agent's environment.
ORPHAN_REDIS_ENV = envvars.ORPHAN_REDIS_S
#: How long a worker asked to stop waits for Redis to answer before it exits without leaving.
STOP_REDIS_S = 2.0
#: How often the lifeline looks at its agent and its clocks.
POLL_S = 0.1
#: Between two probes of Redis while they are wanted, and the longest a probe waits.
PROBE_S = 0.5
PROBE_TIMEOUT_S = 1.0


class StopRequest(threading.Event):
    """An Event that remembers when it was first set (:attr:`at`, monotonic): a worker's
    ``stop`` (set by its SIGTERM handler)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: float | None = None

    def set(self) -> None:
        if self.at is None:
            self.at = time.monotonic()
        super().set()


def orphan_bound() -> float:
    """:data:`ORPHAN_REDIS_S`, or ``SHOAL_ORPHAN_REDIS_S`` when that is a number > 0."""
    raw = os.environ.get(ORPHAN_REDIS_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        return ORPHAN_REDIS_S
    return value if 0 < value < float("inf") else ORPHAN_REDIS_S


def agent_pid() -> int | None:
    """The pid of this process's node agent (``SHOAL_AGENT_PID``), when this process has one:
    the agent is its parent, or the agent named itself and is already gone (it died between
    starting this process and this call: an orphan from the start). None without the
    variable, or when it names a live process that is not this one's parent (inherited by a
    process the agent did not start)."""
    raw = os.environ.get(AGENT_PID_ENV, "")
    if not raw.isdigit() or int(raw) <= 1:
        return None
    pid = int(raw)
    if os.getppid() == pid:
        return pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return pid  # gone already: this process was re-parented
    except PermissionError:
        return None  # alive, someone else's
    return None


class Lifeline:
    """Watches this worker's node agent and, while it matters, Redis; ends the process (see
    the module's doc). ``exit`` (tests) replaces ``os._exit``. Start with :meth:`start`."""

    def __init__(self, client: redis.Redis, stop: threading.Event, *, agent: int | None,
                 orphan_after: float | None = None, stop_after: float = STOP_REDIS_S,
                 probe_timeout: float = PROBE_TIMEOUT_S, exit: Callable[[int], object] = os._exit):
        self.agent = agent
        self.stop = stop
        self.orphan_after = orphan_bound() if orphan_after is None else orphan_after
        self.stop_after = stop_after
        self._client = client
        self._probe_timeout = probe_timeout
        self._exit = exit
        #: when the agent was first seen gone (monotonic; None: it is alive, or there is none)
        self.orphaned_at: float | None = None
        #: the send time of the newest probe Redis answered (monotonic; None: none yet)
        self.answered_at: float | None = None
        #: the exit code it ended the process with (None: not ended)
        self.ended: int | None = None
        #: when a SIGTERM or SIGINT was first read from the wakeup fd (monotonic; None: none)
        self.signalled_at: float | None = None
        self._wanted = threading.Event()
        self._halt = threading.Event()
        self._threads: list[threading.Thread] = []
        self._wakeup: socket.socket | None = None
        self._wakeup_w: socket.socket | None = None

    def start(self) -> "Lifeline":
        """Start its threads; called from the main thread, also read signals as they arrive
        (unless another wakeup fd is set: that one is left alone)."""
        if threading.current_thread() is threading.main_thread():
            r, w = socket.socketpair()
            r.setblocking(False)
            w.setblocking(False)
            try:
                previous = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
            except ValueError:
                previous = None
            if previous is None or previous != -1:
                if previous is not None:
                    signal.set_wakeup_fd(previous)
                r.close()
                w.close()
            else:
                self._wakeup, self._wakeup_w = r, w
        for target, name in ((self._watch, "lifeline"), (self._probe_loop, "lifeline-probe")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        self._halt.set()
        self._wanted.set()  # wakes the prober, which then sees the halt
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(self._probe_timeout + 1.0)
        if self._wakeup is not None:
            try:
                signal.set_wakeup_fd(-1)
            except ValueError:  # not the main thread: the fd stays set, its writes are dropped
                pass
            self._wakeup.close()
            self._wakeup_w.close()
            self._wakeup = self._wakeup_w = None

    # ---- the agent ---------------------------------------------------------------------------

    def agent_gone(self) -> bool:
        return self.agent is not None and os.getppid() != self.agent

    # ---- Redis -------------------------------------------------------------------------------

    def _probe_loop(self) -> None:
        probe = None
        try:
            while not self._halt.is_set():
                self._wanted.wait()
                if self._halt.is_set():
                    return
                if probe is None:
                    probe = without_retries(self._client, timeout=self._probe_timeout)
                sent = time.monotonic()
                try:
                    probe.ping()
                except redis.ResponseError:  # an error reply (NOPERM...) is an answer all the same
                    answered = True
                except Exception:  # noqa: BLE001 - unreachable, timed out, loading, no primary...: no answer
                    answered = False
                else:
                    answered = True
                if answered:
                    self.answered_at = max(self.answered_at or sent, sent)
                self._halt.wait(max(0.0, PROBE_S - (time.monotonic() - sent)))
        finally:
            if probe is not None:
                probe.close()

    def _silent_since(self, since: float) -> float:
        """Seconds without an answer from Redis, counted from ``since`` or from its last answer
        if that came later."""
        return time.monotonic() - max(since, self.answered_at or since)

    # ---- the watch ---------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._halt.is_set():
            if self._wakeup is None:
                self._halt.wait(POLL_S)
            else:
                ready, _, _ = select.select([self._wakeup], [], [], POLL_S)
                if ready:
                    self._read_signals()
            if not self._halt.is_set():
                self.check()

    def _read_signals(self) -> None:
        try:
            got = self._wakeup.recv(256)
        except (BlockingIOError, OSError):
            return
        if self.signalled_at is None and any(n in (signal.SIGTERM, signal.SIGINT) for n in got):
            self.signalled_at = time.monotonic()

    def check(self) -> None:
        """One look: note the agent's death, want probes while they matter, end the process
        when a bound passed without an answer from Redis."""
        if self.orphaned_at is None and self.agent_gone():
            self.orphaned_at = time.monotonic()
            log.warning("node agent (pid %d) is gone: this worker goes on while Redis answers, and ends once "
                        "Redis has not answered for %.0f s", self.agent, self.orphan_after)
        stopping = self.signalled_at
        if self.stop.is_set():
            if getattr(self.stop, "at", None) is None:  # a plain Event: from when it is first seen set
                self.stop.at = time.monotonic()
            stopping = self.stop.at if stopping is None else min(stopping, self.stop.at)
        if self.orphaned_at is None and stopping is None:
            self._wanted.clear()
            return
        self._wanted.set()
        if stopping is not None and (silent := self._silent_since(stopping)) >= self.stop_after:
            self._end(WorkerExit.STOPPED_IN_OUTAGE,
                      f"asked to stop while Redis is unreachable (no answer for {silent:.1f} s since): exiting "
                      f"without leaving the job (exit code {WorkerExit.STOPPED_IN_OUTAGE}); the step in progress is not "
                      "committed, nothing is lost, and the job sees this worker gone once Redis is back")
        elif self.orphaned_at is not None and (silent := self._silent_since(self.orphaned_at)) >= self.orphan_after:
            self._end(WorkerExit.ORPHANED,
                      f"orphaned: node agent (pid {self.agent}) gone and Redis unreachable for {silent:.1f} s "
                      f"(bound {self.orphan_after:g} s, {ORPHAN_REDIS_ENV}): exiting (exit code {WorkerExit.ORPHANED}); "
                      "nothing uncommitted is lost, the job's state lives in its other members and checkpoints")

    def _end(self, code: int, line: str) -> None:
        if self.ended is not None:
            return
        self.ended = code
        log.error("%s", line)
        # only local output: a Redis log handler would wait for Redis (it has a queue of its own)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler):
                try:
                    handler.flush()
                except Exception:  # noqa: BLE001 - a closed stream must not keep the process alive
                    pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        self._halt.set()
        self._exit(code)
