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

from shoal.core.jobspec import JobSpec
from shoal.worker.heartbeat import Heartbeater
from shoal.worker.membership import Membership

log = logging.getLogger("shoal.worker")

#: How long a worker whose job vanished from Redis waits for it to be registered again.
LOST_JOB_WAIT_S = 60.0


class WorkerRunner:
    """Set ``stop`` (e.g. from a SIGTERM handler) to request a drain."""

    def __init__(self, membership: Membership, spec: JobSpec, *, join_timeout: float = 30.0):
        self.m = membership
        self.spec = spec
        self.join_timeout = join_timeout
        self.stop = threading.Event()
        self.hb: Heartbeater | None = None

    @property
    def evicted(self) -> bool:
        """True once the coordinator stopped watching us (we were declared failed)."""
        return self.hb is not None and self.hb.evicted

    def prepare(self) -> None:
        """Work done before joining (e.g. building the model), so a join is never left idle."""

    def cleanup(self) -> None:
        """Called once after the loop ends, whatever the reason."""

    def run_once(self) -> int | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def start(self) -> str:
        self.prepare()
        return self._join()

    def _join(self, last_generation: int = 0) -> str:
        wid = self.m.join(self.join_timeout, last_generation=last_generation)
        self.hb = Heartbeater(self.m.client, self.m.keys, wid, interval=self.spec.heartbeat_interval,
                              ttl=self.spec.heartbeat_ttl, pid=os.getpid())
        self.hb.beat()
        self.hb.start()
        log.info("joined job %s as %s", self.m.job_id, wid)
        return wid

    def rejoin_lost_job(self, last_generation: int) -> bool:
        """Call once :attr:`evicted`. When the job no longer has a record of this worker
        process (the server lost its data; a declared failure keeps the record), wait up to ``LOST_JOB_WAIT_S`` for it to be registered again (the
        node agent does that from the spec it holds) and join it anew: same process, same
        state, a new worker id. True when rejoined. False when the job still exists (this
        worker really was declared failed), did not come back in time, or we are draining;
        the caller then exits. Raises what :meth:`Membership.join` raises."""
        if self.stop.is_set() or self.m.on_record():
            return False
        log.warning("job %s lost its record of %s (Redis lost its data); waiting up to %.0f s for it to be registered again",
                    self.m.job_id, self.m.worker_id, LOST_JOB_WAIT_S)
        if self.hb is not None:
            self.hb.stop()
        deadline = time.monotonic() + LOST_JOB_WAIT_S
        while not self.m.job_exists():
            if time.monotonic() >= deadline or self.stop.wait(0.2):
                return False
        self._join(last_generation)
        return True

    def run(self) -> int:
        """Join, then iterate until :meth:`run_once` returns an exit code."""
        self.start()
        try:
            while True:
                code = self.run_once()
                if code is not None:
                    return code
        finally:
            self.cleanup()
            if self.hb is not None:
                self.hb.stop()
