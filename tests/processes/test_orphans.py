"""Orphans end (issue 29, item 7): a worker whose node agent died while Redis is unreachable
exits within the orphan bound, and a worker asked to stop (SIGTERM) during an outage exits
within a few seconds; an orphan whose Redis answers trains on (:mod:`shoal.worker.lifeline`).

The process tests run a real Redis of their own (killed and started again on the same port),
a coordinator, ``shoal agent`` and its training worker. The test process makes itself a
child subreaper while an agent is SIGKILLed, so the orphaned worker is re-parented to it
and its exit code can be read (as init or a container's pid 1 would reap it).
Before: the orphan kept retrying Redis for as long as it was left, and SIGTERM did not end it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from shoal.core.registry import create_job
from shoal.events.exits import WorkerExit
from shoal.events.keys import job_keys
from shoal.events.models import Heartbeat
from shoal.events.records import JobStatus
from shoal.ops.embedded import start_server
from shoal.ops.localproc import LocalProcs, Proc
from shoal.worker import lifeline as lf
from tests.helpers import ControlWatcher, dump_logs, job_spec, wait_until

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: PR_SET_CHILD_SUBREAPER, pidfd")

#: The orphan bound the process tests give their workers (the default is 60 s).
BOUND = 4.0
#: How late past its bound a worker may end: the lifeline polls every 0.1 s and probes Redis
#: every 0.5 s; the rest is a loaded 2-core machine.
MARGIN = 3.0
#: "A few seconds": the longest a SIGTERM during an outage may take to end a worker.
STOP_LIMIT = 5.0

JOB = dict(entrypoint="tests.entrypoints:slow_digits", global_batch_size=64, epochs=1000, max_steps=100_000,
           min_workers=1, max_workers=1)


# ---- the lifeline's decisions, without processes --------------------------------------------


def _dead_pid() -> int:
    """A pid no process has now (a child that was started and reaped)."""
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@linux_only
def test_a_worker_has_an_agent_only_when_the_agent_is_its_parent(monkeypatch) -> None:
    monkeypatch.delenv(lf.AGENT_PID_ENV, raising=False)
    assert lf.agent_pid() is None  # plain `shoal worker`
    monkeypatch.setenv(lf.AGENT_PID_ENV, str(os.getppid()))
    assert lf.agent_pid() == os.getppid()
    monkeypatch.setenv(lf.AGENT_PID_ENV, str(os.getpid()))
    assert lf.agent_pid() is None  # a live process that is not our parent: inherited, not ours
    gone = _dead_pid()
    monkeypatch.setenv(lf.AGENT_PID_ENV, str(gone))
    assert lf.agent_pid() == gone  # the agent died before we looked: an orphan from the start
    monkeypatch.setenv(lf.ORPHAN_REDIS_ENV, "12.5")
    assert lf.orphan_bound() == 12.5
    for bad in ("", "x", "0", "-3", "inf"):
        monkeypatch.setenv(lf.ORPHAN_REDIS_ENV, bad)
        assert lf.orphan_bound() == lf.ORPHAN_REDIS_S


def _lifeline(client, *, agent, stop=None, orphan_after=BOUND):
    ended: list[int] = []
    line = lf.Lifeline(client, stop or lf.StopRequest(), agent=agent, orphan_after=orphan_after, exit=ended.append)
    return line, ended


def test_the_lifeline_decides_by_its_bounds(redis_url) -> None:
    client = redis.Redis.from_url(redis_url)
    now = time.monotonic()
    # an agent alive, no stop: nothing wanted, nothing ends
    line, ended = _lifeline(client, agent=os.getppid())
    line.check()
    assert not line.agent_gone() and line.orphaned_at is None and not line._wanted.is_set() and not ended
    # orphaned: Redis answered 1 s ago -> on; unanswered past the bound -> WorkerExit.ORPHANED, once
    line, ended = _lifeline(client, agent=_dead_pid())
    line.check()
    assert line.orphaned_at is not None and line._wanted.is_set() and not ended
    line.orphaned_at = now - 10 * BOUND
    line.answered_at = time.monotonic() - 1.0
    line.check()
    assert not ended
    line.answered_at = time.monotonic() - BOUND - 0.1
    line.check()
    line.check()
    assert ended == [WorkerExit.ORPHANED]
    # asked to stop: Redis answering -> the drain goes on; no answer for STOP_REDIS_S -> WorkerExit.STOPPED_IN_OUTAGE
    stop = lf.StopRequest()
    line, ended = _lifeline(client, agent=None, stop=stop)
    line.check()
    assert not line._wanted.is_set()
    stop.set()
    stop.at = time.monotonic() - 10.0
    line.answered_at = time.monotonic() - 0.5
    line.check()
    assert line._wanted.is_set() and not ended
    line.answered_at = time.monotonic() - lf.STOP_REDIS_S - 0.1
    line.check()
    assert ended == [WorkerExit.STOPPED_IN_OUTAGE]
    client.close()


def test_the_lifeline_probes_redis_only_while_it_matters(redis_server) -> None:
    """With its threads: a stop with Redis up is left to the drain (probes answer); with a
    Redis that is not there, the stop ends the process after STOP_REDIS_S."""
    up = redis.Redis.from_url(redis_server.url)
    stop = lf.StopRequest()
    line, ended = _lifeline(up, agent=None, stop=stop)
    line.start()
    try:
        assert line.answered_at is None  # nothing asked yet: no stop, no agent
        stop.set()
        wait_until(lambda: line.answered_at is not None and line.answered_at > stop.at, 5, "a probe answered")
        assert not ended
    finally:
        line.close()
    nowhere = redis.Redis(host="127.0.0.1", port=_free_port(), socket_timeout=1, socket_connect_timeout=1)
    stop = lf.StopRequest()
    line, ended = _lifeline(nowhere, agent=None, stop=stop)
    line.start()
    try:
        stop.set()
        wait_until(lambda: ended, lf.STOP_REDIS_S + MARGIN, "the lifeline to end a stop without Redis")
        took = time.monotonic() - stop.at
        assert ended == [WorkerExit.STOPPED_IN_OUTAGE] and took >= lf.STOP_REDIS_S
    finally:
        line.close()


@linux_only
def test_the_lifeline_reads_sigterm_itself_while_the_main_thread_is_elsewhere() -> None:
    """A SIGTERM whose Python handler has not run (here: it sets nothing, as if the main
    thread were inside a collective) still ends a worker whose Redis does not answer: the
    lifeline reads the signal from its wakeup fd."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are only handled in the main thread")
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    nowhere = redis.Redis(host="127.0.0.1", port=_free_port(), socket_timeout=1, socket_connect_timeout=1)
    stop = lf.StopRequest()
    line, ended = _lifeline(nowhere, agent=None, stop=stop)
    line.start()
    try:
        assert line._wakeup is not None, "the lifeline did not take the wakeup fd"
        os.kill(os.getpid(), signal.SIGTERM)
        sent = time.monotonic()
        wait_until(lambda: ended, lf.STOP_REDIS_S + MARGIN, "the lifeline to end on the signal alone")
        assert ended == [WorkerExit.STOPPED_IN_OUTAGE] and not stop.is_set()
        assert time.monotonic() - sent >= lf.STOP_REDIS_S - 0.2
    finally:
        line.close()
        signal.signal(signal.SIGTERM, previous)
    assert signal.set_wakeup_fd(-1) == -1, "the wakeup fd was not given back"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- real processes ---------------------------------------------------------------------------


@contextlib.contextmanager
def _adopting_orphans():
    """This process as a child subreaper (Linux): orphaned descendants are re-parented to it
    (not to init), so that it can reap them and read their exit codes."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        pytest.skip("PR_SET_CHILD_SUBREAPER is not available")
    try:
        yield
    finally:
        libc.prctl(36, 0, 0, 0, 0)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _reap(pids: list[int], timeout: float = 10.0) -> None:
    """Reap adopted processes (the orphan's loaders die with it); those never adopted are skipped."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while True:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] or time.monotonic() > deadline:
                    break
            except ChildProcessError:
                break
            time.sleep(0.02)


def _exit_of_adopted(pid: int, timeout: float) -> tuple[int, float]:
    """Wait up to ``timeout`` for adopted process ``pid`` to end: (exit code, when: monotonic)."""
    got: list = []

    def ended() -> bool:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            got[:] = [os.waitstatus_to_exitcode(status), time.monotonic()]
        return bool(done)

    wait_until(ended, timeout, f"orphan pid {pid} to exit", interval=0.02)
    return got[0], got[1]


class _Node:
    """A Redis of the test's own (AOF on), the job's coordinator and ``shoal agent`` with one
    training worker, started and running steps."""

    def __init__(self, tmp_path: Path, name: str, env: dict[str, str], *, max_restarts: int = 0):
        self.tmp_path = tmp_path
        self.server = start_server(tmp_path / "redis", appendonly=True, fsync="always")
        self.job = name
        self.client = redis.Redis.from_url(self.server.url, socket_timeout=10)
        create_job(self.client, job_spec(name, JOB))
        self.keys = job_keys(name)
        self.watch = ControlWatcher(self.client, name)
        self.agent_dir = tmp_path / "agent"
        self.procs = LocalProcs(self.server.url, tmp_path / "logs",
                                extra_env={"SHOAL_TEST_STEP_DELAY": "0.05", **env})
        self.procs.coordinator("coord")
        self.agent: Proc = self.procs.start("agent", "agent", name, "--workers", "1", "--max-restarts",
                                            str(max_restarts), "--backoff", "0.2", "--run-dir", str(self.agent_dir))
        self.watch.wait_for(lambda d: "active in generation" in d.reason, 120)
        self.wid, rec = next(iter(self.watch.workers().items()))
        self.pid = int(rec["pid"])
        self.wait_steps(3)

    def step(self) -> int:
        raw = self.client.get(self.keys.heartbeat(self.wid))
        return Heartbeat.model_validate_json(raw).step if raw else -1

    def wait_steps(self, n: int, timeout: float = 60.0) -> int:
        start = self.step()
        return wait_until(lambda: (s := self.step()) >= start + n and s, timeout, f"{self.wid} to commit {n} steps")

    @property
    def log(self) -> Path:
        return self.agent_dir / "slot-0.log"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def restart_redis(self) -> None:
        self.server = start_server(self.server.run_dir, port=self.server.port, appendonly=True, fsync="always")
        self.client = redis.Redis.from_url(self.server.url, socket_timeout=10)

    def close(self) -> None:
        try:
            self.procs.stop_all(timeout=5.0)
        finally:
            self.server.kill()

    def dump(self) -> None:
        dump_logs(self.procs, self.agent_dir)


@contextlib.contextmanager
def _node(tmp_path: Path, name: str, env: dict[str, str] | None = None, **kw):
    node = _Node(tmp_path, name, env or {}, **kw)
    try:
        yield node
    except BaseException:
        node.dump()
        raise
    finally:
        node.close()


def _orphan(node: _Node) -> list[int]:
    """SIGKILL the node agent (nothing stops its worker); the worker's loaders (to reap later)."""
    loaders = _children(node.pid)
    node.agent.signal(signal.SIGKILL)
    node.agent.wait(10)
    assert os.waitpid(node.pid, os.WNOHANG) == (0, 0), "the orphan was not adopted by the test"
    return loaders


def _one_line(text: str, needle: str) -> str:
    lines = [ln for ln in text.splitlines() if needle in ln]
    assert len(lines) == 1, f"{needle!r} {len(lines)} times in the worker's log"
    return lines[0]


@linux_only
@pytest.mark.slow
def test_an_orphan_without_redis_exits_within_its_bound(tmp_path) -> None:
    """(a) The agent is SIGKILLed and Redis stopped: the worker ends BOUND s later (+ MARGIN),
    with exit code WorkerExit.ORPHANED and one line saying why."""
    with _node(tmp_path, "orphan-" + tmp_path.name[-6:], {lf.ORPHAN_REDIS_ENV: str(BOUND)}) as node, \
            _adopting_orphans():
        loaders = _orphan(node)
        node.server.kill()
        gone = time.monotonic()
        code, ended = _exit_of_adopted(node.pid, BOUND + MARGIN + 5)
        _reap(loaders)
        took = ended - gone
        print(f"orphan without Redis ended {took:.2f} s after Redis was stopped (bound {BOUND:g} s), code {code}")
        assert code == WorkerExit.ORPHANED
        line = _one_line(node.log_text(), "orphaned: node agent")
        assert " ERROR " in line and f"pid {node.agent.pid}" in line and "Redis unreachable" in line
        assert BOUND - 1.0 <= took <= BOUND + MARGIN, f"ended {took:.2f} s after Redis went (bound {BOUND:g} s)"


@linux_only
@pytest.mark.slow
def test_an_orphan_whose_redis_answers_trains_on_and_ends_when_redis_goes(tmp_path) -> None:
    """(c) The agent is SIGKILLed, Redis stays: the worker commits steps for longer than the
    bound (its coordinator still sees it), having said once that its agent is gone. Then Redis
    stops: it ends within the bound counted from Redis's last answer."""
    with _node(tmp_path, "alive-" + tmp_path.name[-6:], {lf.ORPHAN_REDIS_ENV: str(BOUND)}) as node, \
            _adopting_orphans():
        loaders = _orphan(node)
        orphaned = time.monotonic()
        before = node.step()
        wait_until(lambda: "node agent" in node.log_text() and "is gone" in node.log_text(), 5,
                   "the worker to notice its agent is gone")
        # trains on past the bound: it is polled, not slept (steps and time both)
        wait_until(lambda: time.monotonic() - orphaned > BOUND + MARGIN and node.step() >= before + 20, 60,
                   "the orphan to keep committing steps past its bound")
        assert os.waitpid(node.pid, os.WNOHANG) == (0, 0), "the orphan ended although Redis answers"
        assert node.watch.workers()[node.wid]["state"] == "Active"
        _one_line(node.log_text(), "is gone: this worker goes on while Redis answers")
        node.server.kill()
        gone = time.monotonic()
        code, ended = _exit_of_adopted(node.pid, BOUND + MARGIN + 5)
        _reap(loaders)
        took = ended - gone
        print(f"orphan trained {gone - orphaned:.1f} s with Redis up; ended {took:.2f} s after Redis was stopped, "
              f"code {code}")
        assert code == WorkerExit.ORPHANED
        _one_line(node.log_text(), "orphaned: node agent")
        # counted from Redis's last answer to a probe: up to PROBE_S (and a starved thread) before the stop
        assert BOUND - lf.PROBE_S - 1.0 <= took <= BOUND + MARGIN, f"ended {took:.2f} s after Redis went"


@linux_only
@pytest.mark.slow
def test_sigterm_during_a_redis_outage_ends_the_worker_within_seconds(tmp_path) -> None:
    """(b) Redis stops; SIGTERM to the worker: it ends within STOP_LIMIT s (it gives Redis
    STOP_REDIS_S to answer first) with WorkerExit.STOPPED_IN_OUTAGE and one line. Its agent does not
    restart it (restarts are left), and once Redis is back reports its exit: the coordinator
    records it, the agent ends."""
    with _node(tmp_path, "term-" + tmp_path.name[-6:], max_restarts=2) as node:
        node.server.kill()
        wait_until(lambda: "heartbeat failing" in node.log_text(), 10, "the worker to see Redis gone")
        pidfd = os.pidfd_open(node.pid)
        try:
            os.kill(node.pid, signal.SIGTERM)
            sent = time.monotonic()
            ready, _, _ = select.select([pidfd], [], [], STOP_LIMIT + 10)
            took = time.monotonic() - sent
        finally:
            os.close(pidfd)
        assert ready, f"the worker was still running {STOP_LIMIT + 10:g} s after SIGTERM"
        print(f"SIGTERM during the outage ended the worker in {took:.2f} s")
        line = _one_line(node.log_text(), "asked to stop while Redis is unreachable")
        assert " ERROR " in line and f"exit code {WorkerExit.STOPPED_IN_OUTAGE}" in line
        assert lf.STOP_REDIS_S - 0.5 <= took <= STOP_LIMIT, f"SIGTERM took {took:.2f} s"
        # the agent sees the exit once its own Redis call of the moment gives up or Redis is back
        node.restart_redis()
        assert node.agent.wait(90) == 0  # it reported the exit and ended: nothing to restart
        agent_log = node.agent.log_path.read_text()
        said = f"stopped during a Redis outage without leaving the job with exit code {WorkerExit.STOPPED_IN_OUTAGE}"
        assert said in agent_log
        assert agent_log.count("started worker pid") == 1, "the agent restarted a stopped worker"
        ControlWatcher(node.client, node.job).wait_for(
            lambda d: node.wid in d.reason and f"exit code {WorkerExit.STOPPED_IN_OUTAGE}" in d.reason, 60)
        # asked to stop, not a crash: never the job's first failure, nothing dead-lettered
        keys = job_keys(node.job)
        assert JobStatus.from_hash(node.client.hgetall(keys.state)).first_failure_worker != node.wid
        assert node.client.xlen(keys.dead) == 0
