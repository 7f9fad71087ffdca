"""The elastic training worker: follows shard-table generations without restarting.

Protocol (every member of a generation runs the same loop):

1. **Step.** Take the global batch at the committed cursor, this rank's slice per the shard
   table, and run one atomic, world-size-invariant step (:class:`worker.engine.StepEngine`).
   The step's collective carries the newest generation each rank has seen (MAX), so every
   member learns of a new generation in the same step.
2. **Switch** at the step boundary after which the reduced generation is newer than the
   group's: leave the process group (same process, model and optimizer stay in memory),
   meet the other members of the newest table at a Redis barrier, form the new group on a
   fresh store prefix, and resync state from the most advanced member (a joiner receives
   model, optimizer and cursor by broadcast; survivors with equal steps skip it). Then send
   ``ready`` -> Active, and publish the parameter digest with the heartbeat.
3. **Failure.** If a peer dies mid-step the collective fails: nothing is applied
   (StepAborted), the worker leaves the group and waits for the coordinator's next
   generation, then redoes the same step. No sample is skipped or counted twice: the cursor
   only moves on a committed step, and resync copies the most advanced member's cursor.
4. **Drain** (SIGTERM): finish the step, send ``leave``, keep stepping until the generation
   without this worker is agreed, then send ``left`` and exit 0.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from events.models import ShardTable
from shoal.jobspec import JobSpec
from worker import process_group as pg
from worker.data import DataOrder
from worker.digest import state_digest
from worker.engine import StepEngine, resync_state
from worker.errors import CollectiveFailed, RendezvousFailed, StateMismatch, StepAborted
from worker.faults import FaultPlan
from worker.checkpoints import Checkpoints
from worker.ledger import Ledger
from worker.membership import Membership
from worker.runner import TERMINAL, WorkerRunner
from worker.userapi import load_entrypoint
from worker.watcher import GenerationWatcher

log = logging.getLogger("shoal.worker")

DIGEST_EVERY = 50  # sha256 of every parameter: cheap for small models, not free for large


class TrainingWorker(WorkerRunner):
    """One worker process of a training job. Drive with :meth:`run`; ``stop`` drains."""

    def __init__(self, membership: Membership, spec: JobSpec, *, join_timeout: float = 30.0):
        super().__init__(membership, spec, join_timeout=join_timeout)
        self.faults = FaultPlan.from_env()
        self.ledger = Ledger.from_env()
        self.step = 0
        self.cursor = 0
        self.has_state = False
        self.group_gen = 0  # generation of the process group we are in (0: none)
        self.seen_gen = 0  # newest generation seen locally
        self.switch_to = 0  # generation the last step agreed to switch to
        self.draining = False
        self.rdzv_timeout = 30.0
        self.collective_timeout = max(3.0, spec.heartbeat_ttl + 1.0)

    # ---- setup -------------------------------------------------------------------------------

    def prepare(self) -> None:
        setup = load_entrypoint(self.spec.entrypoint, self.spec.seed)
        self.setup = setup
        self.engine = StepEngine.from_setup(setup, device=None, require_group=True)
        self.order = DataOrder(len(setup.dataset), self.spec.seed, self.spec.global_batch_size)
        n = len(setup.dataset)
        self.total_samples = n * self.spec.epochs
        self.has_state = True  # the seeded initial model: identical on every worker
        log.info("built %s: %d samples, %d steps/epoch", self.spec.entrypoint, n, self.order.steps_per_epoch())
        self.ckpt = Checkpoints.open(self.spec, self.m) if self.spec.checkpoint_uri else None
        if self.ckpt is not None:
            resumed = self.ckpt.resume(self.engine)
            if resumed is not None:
                self.step, self.cursor = resumed

    def start(self) -> str:
        wid = super().start()
        # the client's pool gives the watcher's blocking XREAD a connection of its own
        self.watcher = GenerationWatcher(self.m.client, self.m.keys, interval=min(1.0, self.spec.heartbeat_interval * 2))
        self.watcher.start()
        return wid

    def cleanup(self) -> None:
        if getattr(self, "watcher", None) is not None:
            self.watcher.stop()
        pg.leave_group()
        if getattr(self, "ckpt", None) is not None:
            self.ckpt.close()

    @property
    def is_rank0(self) -> bool:
        member = self._table.member(self.m.worker_id) if self.group_gen else None
        return member is not None and member.rank == 0

    def _checkpoint(self, *, final: bool = False) -> None:
        """Rank 0 saves (async) at the job's interval; ``final`` waits for it to be written."""
        if self.ckpt is None or not self.is_rank0:
            return
        interval = self.spec.checkpoint_interval
        if final or (interval and self.step % interval == 0):
            self.ckpt.save(self.engine, step=self.step, cursor=self.cursor, epoch=self.cursor // self.order.num_samples,
                           generation=self.group_gen, world_size=self._table.world_size, wait=final)

    def _done(self) -> bool:
        return self.cursor >= self.total_samples or (self.spec.max_steps is not None and self.step >= self.spec.max_steps)

    def run_once(self) -> int | None:
        """One step (or one switch / wait). Returns an exit code when the worker should end."""
        wid = self.m.worker_id
        if self.evicted:
            log.error("evicted by the coordinator (declared failed); exiting")
            return 1
        if self.stop.is_set() and not self.draining:
            self.draining = True
            self.m.leave("SIGTERM")
            log.info("draining after step %d", self.step)
        self.seen_gen = max(self.seen_gen, self.watcher.latest)
        job_state = self.watcher.job_state
        if job_state in TERMINAL:
            if job_state == "stopped":
                self._checkpoint(final=True)  # a graceful stop keeps the progress
            return 0
        if self.group_gen == 0 or self.switch_to > self.group_gen:
            return self._switch()
        self.faults.at(wid, self.step, "before_step")
        batch = self.order.batch(self.cursor)
        member = self._table.member(wid)
        local = batch.for_rank(member.ranges)
        started = time.monotonic()
        self.faults.at(wid, self.step, "mid_step")
        aborted = ""
        try:
            result = self.engine.step(local, batch.count, self.seen_gen, base_generation=self.group_gen)
        except StepAborted as exc:
            aborted = str(exc)
        if aborted:
            # outside the except block: the exception's frames no longer pin the broken group,
            # so destroying it closes its sockets and peers still inside the collective fail now
            pg.leave_group()
            gc.collect()
            log.warning("step %d aborted in generation %d: %s", self.step, self.group_gen, aborted)
            self.m.step_failed(self.group_gen, self.step, aborted)
            self.group_gen = 0
            self._wait_newer(self._table.generation)
            return None
        self.step += 1
        self.cursor = batch.next_cursor
        self.ledger.commit(wid, self.step, batch, self.group_gen, local, self._table.world_size)
        self.faults.at(wid, self.step, "after_commit")
        self.switch_to = result.max_generation
        self._checkpoint()
        if self.hb is not None:
            fields = dict(step=self.step, generation=self.group_gen, step_time=time.monotonic() - started, loss=result.loss)
            if self.step % DIGEST_EVERY == 0:
                fields["digest"] = state_digest(self.engine.model)
            self.hb.update(**fields)
        if self._done():
            return self._finish()
        return None

    # ---- generations ---------------------------------------------------------------------------

    def _wait_newer(self, generation: int) -> ShardTable | None:
        """Block (bounded) until a table newer than ``generation`` exists."""
        deadline = time.monotonic() + 5 * self.spec.heartbeat_ttl + 5
        while time.monotonic() < deadline and not self.evicted:
            table = self.m.next_table(generation, timeout=min(1.0, self.spec.heartbeat_ttl))
            if table is not None:
                self.seen_gen = max(self.seen_gen, table.generation)
                return table
            if self.m.job_state() in TERMINAL:
                return None
        return None

    def _switch(self) -> int | None:
        """Leave the current group and join the newest generation that includes us."""
        wid = self.m.worker_id
        pg.leave_group()
        self.group_gen = 0
        table = self.m.current_table()
        if table is None or table.generation < self.switch_to:
            table = self._wait_newer(max(self.switch_to - 1, 0) if table is None else table.generation)
            if table is None:
                return None
        self.seen_gen = max(self.seen_gen, table.generation)
        member = table.member(wid) if not table.paused else None
        if member is None:
            if self.draining:
                self.m.left()
                log.info("left after step %d (generation %d no longer includes us)", self.step, table.generation)
                return 0
            self._wait_newer(table.generation)
            return None
        if not self._barrier(table):
            return None
        t0 = time.monotonic()
        try:
            pg.join_group(self.m.client, self.m.job_id, table.generation, member.rank, table.world_size,
                          timeout=self.rdzv_timeout, collective_timeout=self.collective_timeout)
            self._resync()
        except (RendezvousFailed, CollectiveFailed, StateMismatch) as exc:
            log.warning("generation %d could not form: %s", table.generation, exc)
            pg.leave_group()
            self._wait_newer(table.generation)
            return None
        self._table = table
        self.group_gen = table.generation
        self.switch_to = table.generation
        digest = state_digest(self.engine.model)
        if self.hb is not None:
            self.hb.update(generation=table.generation, digest=digest, step=self.step)
        log.info("generation %d: rank %d/%d, step %d, cursor %d, digest %s (switch %.3fs)",
                 table.generation, member.rank, table.world_size, self.step, self.cursor, digest, time.monotonic() - t0)
        self.m.ready(table.generation)
        return None

    def _barrier(self, table: ShardTable) -> bool:
        """Meet every member of ``table`` before forming the group; False (and nothing
        formed) when a newer generation appears first or the wait times out."""
        key = self.m.keys.rendezvous(table.generation) + "arrived"
        pipe = self.m.client.pipeline(transaction=False)
        pipe.sadd(key, self.m.worker_id)
        pipe.expire(key, 3600)
        pipe.execute()
        deadline = time.monotonic() + self.rdzv_timeout
        while time.monotonic() < deadline:
            pipe = self.m.client.pipeline(transaction=False)
            pipe.scard(key)
            pipe.get(self.m.keys.shard)
            arrived, raw = pipe.execute()
            if arrived >= table.world_size:
                return True
            newest = ShardTable.model_validate_json(raw) if raw else None
            if newest is not None and newest.generation > table.generation:
                self.seen_gen = max(self.seen_gen, newest.generation)
                self.switch_to = newest.generation
                return False
            if self.evicted:
                return False
            time.sleep(0.002)
        return False

    def _resync(self) -> None:
        """Make every member's state equal to the most advanced member's (skip when equal)."""
        rank, world = pg.world()
        if world == 1:
            return
        probe = torch.tensor([self.step, -self.step], dtype=torch.int64, device=pg.current_group().device)
        pg.all_reduce(probe, dist.ReduceOp.MAX)
        if int(probe[0]) == -int(probe[1]):
            return  # everyone has committed the same steps: identical state already
        extra = {"step": self.step, "cursor": self.cursor}
        _src, got = resync_state(self.engine.model, self.engine.optimizer, extra, self.step,
                                 lr_scheduler=self.engine.lr_scheduler)
        self.step, self.cursor = int(got["step"]), int(got["cursor"])

    def _finish(self) -> int:
        summary = {"step": self.step, "cursor": self.cursor, "digest": state_digest(self.engine.model)}
        if self.setup.eval_fn is not None:
            summary.update({k: float(v) for k, v in self.engine.evaluate(self.setup.eval_fn).items()})
        self._checkpoint(final=True)
        export = os.environ.get("SHOAL_EXPORT_DIR")
        if export:  # tests and tools compare final weights across runs
            Path(export).mkdir(parents=True, exist_ok=True)
            torch.save(self.engine.model.state_dict(), Path(export) / f"final-{self.m.worker_id}.pt")
        if self._table.member(self.m.worker_id).rank == 0:
            self.m.completed(self.step, summary)
        if self.hb is not None:
            self.hb.update(step=self.step, digest=summary["digest"])
            self.hb.beat()
        log.info("finished: %s", json.dumps(summary))
        return 0
