"""What every worker process shares: join, heartbeat thread, the run loop, cleanup.

Subclasses implement :meth:`run_once` (one bounded iteration returning an exit code when
the worker should end) and may override :meth:`prepare` (before joining) and
:meth:`cleanup` (after the loop, always).
"""

from __future__ import annotations

import logging
import os
import threading

from shoal.jobspec import JobSpec
from worker.heartbeat import Heartbeater
from worker.membership import Membership

log = logging.getLogger("shoal.worker")

TERMINAL = {"completed", "failed", "stopped"}


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
        wid = self.m.join(self.join_timeout)
        self.hb = Heartbeater(self.m.client, self.m.keys, wid, interval=self.spec.heartbeat_interval,
                              ttl=self.spec.heartbeat_ttl, pid=os.getpid())
        self.hb.beat()
        self.hb.start()
        log.info("joined job %s as %s", self.m.job_id, wid)
        return wid

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
