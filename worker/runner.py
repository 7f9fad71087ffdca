"""What every worker process shares: join, heartbeat thread, the run loop, cleanup.

Subclasses implement :meth:`run_once` (one bounded iteration returning an exit code when
the worker should end) and may override :meth:`prepare` (before joining) and
:meth:`cleanup` (after the loop, always).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import redis

from shoal.core.jobspec import JobSpec
from shoal.worker.heartbeat import Heartbeater
from shoal.worker.lifeline import Lifeline, StopRequest, agent_pid
from shoal.worker.membership import Membership
from shoal.events.states import FailureCause, WorkerState, is_terminal
from shoal.worker.restart import exit_for_restart

log = logging.getLogger("shoal.worker")

#: The longest pause between a worker's attempts through a Redis outage.
REDIS_BACKOFF_MAX_S = 5.0
#: The errors of an unreachable (restarting, blackholed, loading) Redis.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)

#: How long a worker whose job vanished from Redis waits for it to be registered again.
LOST_JOB_WAIT_S = 60.0


def collective_timeout(spec: JobSpec) -> float:
    """The collective timeout of ``spec``'s groups: the step timeout plus a margin for the
    coordinator to see it (a tick, a heartbeat interval) and for its table to arrive."""
    return spec.step_timeout + max(5.0, 2 * spec.heartbeat_ttl)


class WorkerRunner:
    """Set ``stop`` (e.g. from a SIGTERM handler) to request a drain.

    :meth:`run` called from the main thread (the worker process's program) also starts a
    :class:`~shoal.worker.lifeline.Lifeline`: it ends the process when its node agent is gone
    and Redis has not answered for the orphan bound, or when ``stop`` was set and Redis has
    not answered for a few seconds (a drain cannot leave through Redis)."""

    def __init__(self, membership: Membership, spec: JobSpec, *, join_timeout: float = 30.0):
        self.membership = membership
        self.spec = spec
        self.join_timeout = join_timeout
        self.stop = StopRequest()
        self.hb: Heartbeater | None = None
        #: started by :meth:`run` in the main thread (None until then, or in another thread)
        self.lifeline: Lifeline | None = None
        #: bounds every collective of a group (a backstop: the coordinator evicts a hung peer
        #: - heartbeat TTL - or a stuck step - ``step_timeout`` - first, and the survivors
        #: abort their collectives with it at once; until then a slow peer is waited for)
        self.collective_timeout = collective_timeout(spec)
        #: the longest the commit fence waits for Redis before giving a step up (well below
        #: the collective timeout the peers wait with)
        self.fence_wait = self.collective_timeout / 2

    @property
    def evicted(self) -> bool:
        """True once the coordinator stopped watching us (we were declared failed)."""
        return self.hb is not None and self.hb.evicted

    def prepare(self) -> None:
        """Work done before joining (e.g. building the model), so a join is never left idle."""

    def on_evicted(self) -> None:
        """(The thread whose heartbeat found it.) The coordinator no longer counts this worker
        as a member: declared failed, or its record lost with Redis's data."""

    def cleanup(self) -> None:
        """Called once after the loop ends, whatever the reason."""

    def run_once(self) -> int | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def start(self) -> str:
        self.prepare()
        return self._join()

    def _join(self, last_generation: int = 0) -> str:
        wid = self.membership.join(self.join_timeout, last_generation=last_generation)
        self.hb = Heartbeater(self.membership.client, self.membership.keys, wid, interval=self.spec.heartbeat_interval,
                              ttl=self.spec.heartbeat_ttl, pid=os.getpid(), fence_wait=self.fence_wait)
        self.hb.on_evicted = self.on_evicted
        self.hb.beat()
        self.hb.start()
        log.info("joined job %s as %s", self.membership.job_id, wid)
        return wid

    def rejoin_evicted(self, last_generation: int) -> bool:
        """Call once :attr:`evicted`: join the job anew - same process, same state, a new
        worker id - when that is what it needs. True when rejoined.

        * The coordinator declared this live process failed (it was frozen, cut off from
          Redis or its peers, or its step passed the step timeout) and the job still runs:
          rejoin at once; the next generation catches its state up like a joiner's.
        * The progress watchdog failed it as stuck (it kept failing the same step): the
          process ends for its agent to start it again (:mod:`shoal.worker.restart`).
        * The job lost its record of this process (Redis lost its data): wait up to
          ``LOST_JOB_WAIT_S`` for it to be registered again (the node agent does that from
          the spec it holds), then rejoin.

        False when draining, when the job ended, or when it did not come back in time; the
        caller then exits. Raises what :meth:`Membership.join` raises."""
        if self.stop.is_set():
            return False
        doc = self.membership.record()
        if doc is not None:
            if doc.state != WorkerState.FAILED or is_terminal(self.membership.job_state()):
                return False
            if doc.cause == FailureCause.STUCK:  # the watchdog wants a fresh process, not this state
                exit_for_restart(f"restarted by the coordinator's progress watchdog ({doc.reason})")
            log.warning("declared failed by the coordinator while alive (%s); rejoining job %s as a new member, "
                        "state kept", doc.reason or doc.cause, self.membership.job_id)
            if self.hb is not None:
                self.hb.stop()
            self._join(last_generation)
            return True
        log.warning("job %s lost its record of %s (Redis lost its data); waiting up to %.0f s for it to be registered again",
                    self.membership.job_id, self.membership.worker_id, LOST_JOB_WAIT_S)
        if self.hb is not None:
            self.hb.stop()
        deadline = time.monotonic() + LOST_JOB_WAIT_S
        while not self.membership.job_exists():
            if time.monotonic() >= deadline or self.stop.wait(0.2):
                return False
        self._join(last_generation)
        return True

    def run(self) -> int:
        """Join, then iterate until :meth:`run_once` returns an exit code. A Redis outage
        (connection refused, timed out) never ends the process: the iteration is tried again
        with a backoff (0.5 s doubling to ``REDIS_BACKOFF_MAX_S``), logged once when it starts
        and once when Redis answers again; the model and optimizer stay in memory - unless
        this worker is orphaned or asked to stop meanwhile (:mod:`shoal.worker.lifeline`)."""
        if threading.current_thread() is threading.main_thread():
            self.lifeline = Lifeline(self.membership.client, self.stop, agent=agent_pid()).start()
        try:
            self.start()
        except BaseException:
            if self.lifeline is not None:
                self.lifeline.close()
            raise
        down_since: float | None = None
        pause = 0.5
        try:
            while True:
                try:
                    code = self.run_once()
                except REDIS_DOWN as exc:
                    if down_since is None:
                        down_since = time.monotonic()
                        log.warning("Redis unreachable (%s); keeping this worker's state and trying again", exc)
                    time.sleep(pause)
                    pause = min(2 * pause, REDIS_BACKOFF_MAX_S)
                    continue
                if down_since is not None:
                    log.warning("Redis reachable again after %.1f s", time.monotonic() - down_since)
                    down_since, pause = None, 0.5
                if code is not None:
                    return code
        finally:
            try:
                self.cleanup()
                if self.hb is not None:
                    self.hb.stop()
            finally:
                if self.lifeline is not None:  # the exit code is the loop's from here on
                    self.lifeline.close()
