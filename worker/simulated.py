"""A worker that follows generations and simulates steps (``entrypoint: simulate``).

It exercises the whole control plane without torch: join, heartbeat, ready on each new
generation that includes it, idle while paused or excluded, drain on SIGTERM (leave, wait
for a generation without it, left), exit when the job ends or the coordinator evicted it.
With ``max_steps`` set, a member that has simulated that many steps stops stepping; the
one that is rank 0 of the current generation reports the job completed (as the training
runtime's rank 0 does), so a rank 0 that died is replaced by the next one.
The training runtime follows the same protocol with real steps.
"""

from __future__ import annotations

import logging
import time

from shoal.events.exits import WorkerExit
from shoal.events.models import ShardTable
from shoal.events.states import is_terminal
from shoal.core.jobspec import JobSpec
from shoal.worker.membership import Membership
from shoal.worker.runner import WorkerRunner

log = logging.getLogger("shoal.worker")


class SimulatedWorker(WorkerRunner):
    """Drive with :meth:`run_once` (tests) or :meth:`run`. ``stop`` requests a drain."""

    def __init__(self, membership: Membership, spec: JobSpec, *, join_timeout: float = 30.0):
        super().__init__(membership, spec, join_timeout=join_timeout)
        self.table: ShardTable | None = None
        self.step = 0
        self.exit_code: int | None = None
        self._draining = False
        self._drain_deadline = 0.0
        self._reported = False

    @property
    def member(self):
        return self.table.member(self.membership.worker_id) if self.table and not self.table.paused else None

    def run_once(self) -> int | None:
        """One bounded iteration; returns an exit code when the worker should end."""
        if self.evicted:
            log.error("evicted by the coordinator (declared failed); exiting")
            return WorkerExit.FAILED
        if self.stop.is_set() and not self._draining:
            self._draining = True
            self._drain_deadline = time.monotonic() + max(10.0, 5 * self.spec.heartbeat_ttl)
            self.membership.leave("SIGTERM")
            log.info("draining: finished step %d, asked to leave", self.step)
        gen = self.table.generation if self.table else 0
        done = self.spec.max_steps is not None and self.step >= self.spec.max_steps
        wait = 0.0 if (self.member and not self._draining and not done) else min(0.5, self.spec.heartbeat_interval)
        table = self.membership.next_table(gen, timeout=wait) if wait else self.membership.current_table()
        if table is not None and table.generation > gen:
            self.table = table
            if self.member and not self._draining:
                log.info("generation %d: rank %d of %d, ranges %s", table.generation, self.member.rank, table.world_size, self.member.ranges)
                self.membership.ready(table.generation)
        if self._draining:
            excluded = self.table is not None and self.table.member(self.membership.worker_id) is None
            if excluded or time.monotonic() > self._drain_deadline:
                self.membership.left()
                log.info("left the job")
                return WorkerExit.OK
            return None
        if is_terminal(self.membership.job_state()):
            return WorkerExit.OK
        if self.member and done:
            if self.member.rank == 0 and not self._reported:
                self._reported = True
                summary = {"step": self.step, "generation": self.table.generation, "world_size": self.table.world_size}
                self.membership.completed(self.step, summary)
                log.info("finished: %s", summary)
            return None  # wait for the coordinator to end the job
        if self.member:
            started = time.monotonic()
            self.stop.wait(self.spec.simulate_step_time)
            self.step += 1
            if self.hb is not None:
                self.hb.update(step=self.step, generation=self.table.generation, step_time=time.monotonic() - started)
        return None
