"""The elastic training worker: follows shard-table generations without restarting.

Protocol (every member of a generation runs the same loop):

1. **Step.** Take the global batch at the committed cursor, this rank's slice per the shard
   table, and run one atomic, world-size-invariant step (:class:`shoal.worker.engine.StepEngine`).
   The step's collective carries the newest generation each rank has seen (MAX), so every
   member learns of a new generation in the same step.
2. **Switch** at the step boundary after which the reduced generation is newer than the
   group's: leave the process group (same process, model and optimizer stay in memory; the
   old backend is freed by a thread), meet the other members of the newest table at a Redis
   barrier, form the new group on a fresh store prefix, and catch up from the most advanced
   member (only the members behind - a joiner - receive model, optimizer and cursor, point
   to point; the others skip it and, in the generation's first step, split the batch among
   themselves while the members behind take none). Then send ``ready`` -> Active; the
   parameter digest is logged and published with the heartbeat once a helper thread has
   computed it (the first step's update waits for it).
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
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import torch

from shoal.events.models import ShardTable
from shoal.core.jobspec import JobSpec
from shoal.worker import process_group as pg
from shoal.worker.data import DataOrder, contiguous_table
from shoal.worker.digest import digest_of, state_digest
from shoal.worker.engine import StepEngine, catch_up_state
from shoal.worker.errors import CollectiveFailed, RendezvousFailed, StateMismatch, StepAborted
from shoal.core.connection import without_retries
from shoal.core.faults import FaultPlan
from shoal.worker.checkpoints import Checkpoints
from shoal.worker.ledger import Ledger
from shoal.worker.membership import Membership
from shoal.worker.progress import ProgressRecorder
from shoal.worker.runner import TERMINAL, WorkerRunner
from shoal.worker.userapi import load_entrypoint
from shoal.worker.watcher import GenerationWatcher

log = logging.getLogger("shoal.worker")

DIGEST_EVERY = 50  # sha256 of every parameter: cheap for small models, not free for large
DIGEST_JOIN_TIMEOUT = 60.0  # the switch digest's thread, awaited before the first update


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
        self._first_ranges: list | None = None  # this rank's part of a generation's first step after a catch-up
        self._caught_up: tuple[int, list[int]] = (0, [])  # (src, ranks behind) of the last catch-up
        self.rdzv_timeout = 30.0
        self.formed_not = 0  # newest generation whose group could not form (never retried)
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
        self.ckpt = Checkpoints.open(self.spec, self.m, self.faults) if self.spec.checkpoint_uri else None
        if self.ckpt is not None:
            resumed = self.ckpt.resume(self.engine)
            if resumed is not None:
                self.step, self.cursor = resumed

    def start(self) -> str:
        wid = super().start()
        # the client's pool gives the watcher's blocking XREAD a connection of its own
        self.watcher = GenerationWatcher(self.m.client, self.m.keys, interval=min(1.0, self.spec.heartbeat_interval * 2))
        self.watcher.start()
        self.progress = ProgressRecorder(without_retries(self.m.client), self.m.keys)
        self.engine.commit_guard = self._fence
        return wid

    def _fence(self) -> None:
        """The last check before a step is applied: a member the coordinator declared failed
        (frozen or starved past its TTL: it wakes still inside its old generation, alone or
        with peers frozen alike) must commit nothing more - its steps are being redone by
        the generation that replaced it. Free unless beats are late; see
        :meth:`Heartbeater.still_member`."""
        if self.hb is not None and not self.hb.still_member():
            raise StepAborted("evicted by the coordinator (declared failed): this step is not applied")

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
            if self.rejoin_lost_job(self.seen_gen):
                pg.leave_group()  # the new incarnation of the job plans a new generation
                self.group_gen = self.switch_to = 0
                return None
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
        local = batch.for_rank(self._step_ranges(member))
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
        if self.is_rank0:  # the history `shoal report` draws
            self.progress.record(self.step, result.loss, self.group_gen, self._table.world_size)
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
        # an orderly switch (a failed step already left synchronously): the old group's
        # teardown runs off the critical path
        pg.leave_group(background=True)
        self.group_gen = 0
        self._first_ranges = None
        self._digest_done()  # a catch-up below may overwrite what it still reads
        table = self.m.current_table()
        if table is None or table.generation < self.switch_to:
            table = self._wait_newer(max(self.switch_to - 1, 0) if table is None else table.generation)
            if table is None:
                return None
        self.seen_gen = max(self.seen_gen, table.generation)
        if table.generation <= self.formed_not:
            self._wait_newer(table.generation)  # the one that failed to form: never again
            return None
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
        self.faults.at(wid, self.step, "rendezvous")
        t0 = time.monotonic()
        try:
            pg.join_group(self.m.client, self.m.job_id, table.generation, member.rank, table.world_size,
                          timeout=self.rdzv_timeout, collective_timeout=self.collective_timeout)
            self._resync(table)
        except (RendezvousFailed, CollectiveFailed, StateMismatch) as exc:
            log.warning("generation %d could not form: %s", table.generation, exc)
            pg.leave_group()
            self.formed_not = table.generation
            # a generation is never retried (its rendezvous prefix is spent): ask for a new one
            self.m.step_failed(table.generation, self.step, str(exc), rendezvous=True)
            self._wait_newer(table.generation)
            return None
        self._table = table
        self.group_gen = table.generation
        self.switch_to = table.generation
        if self.hb is not None:
            self.hb.update(generation=table.generation, digest=None, step=self.step)
        self._digest_switch(table, member.rank, time.monotonic() - t0)  # then sends ready
        return None

    def _digest_switch(self, table: ShardTable, rank: int, took: float) -> None:
        """Log (and publish with the heartbeat) the digest of the state this member starts
        ``table``'s generation from, then send ``ready``: on a helper thread while the first
        step runs. The parameters do not change before that step's update, which waits for
        the helper (``engine.before_update``); buffers, which the forward pass may update, are
        copied. So a member reported Active has logged its starting digest, and ``ready``
        precedes its first commit in the generation, as when this was done inline."""
        model = self.engine.model
        params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        state = {k: v if k in params else v.clone() for k, v in model.state_dict().items()}
        step, cursor = self.step, self.cursor
        src, behind = self._caught_up
        moved = f"; state from rank {src} to {behind}" if behind else ""

        def run() -> None:
            try:
                digest = digest_of(state)
                if self.hb is not None:
                    self.hb.update(digest=digest)
                log.info("generation %d: rank %d/%d, step %d, cursor %d, digest %s (switch %.3fs%s)",
                         table.generation, rank, table.world_size, step, cursor, digest, took, moved)
            except Exception:  # noqa: BLE001 - a diagnostic: never stops training
                log.warning("the digest of generation %d's starting state failed", table.generation, exc_info=True)
            self.m.ready(table.generation)  # on failure, sent again by _digest_done

        if getattr(self, "_digester", None) is None:  # one long-lived thread: no start-up per switch
            self._digester = ThreadPoolExecutor(1, thread_name_prefix="switch-digest")
        self._digesting = (self._digester.submit(run), table.generation)
        self.engine.before_update(self._digest_done)

    def _digest_done(self) -> None:
        """Wait (bounded) for :meth:`_digest_switch`'s helper; send ``ready`` from here when it
        could not (raising what the send raises)."""
        pending, self._digesting = getattr(self, "_digesting", None), None
        if pending is None:
            return
        future, generation = pending
        try:
            future.result(DIGEST_JOIN_TIMEOUT)
        except FutureTimeout:
            log.warning("the switch digest took more than %.0f s; training on", DIGEST_JOIN_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - the helper's ready failed: once more, here
            log.warning("ready for generation %d failed on the helper thread (%s); sending it again", generation, exc)
            self.m.ready(generation)

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

    def _resync(self, table: ShardTable) -> None:
        """Make every member's state equal to the most advanced member's: only the members
        that are behind (a joiner; after a failure, one that missed the contested step)
        receive it, from one sender that does not wait for the transfer.

        While they catch up the others already compute: in the generation's first step the
        members that were behind take no samples and the up-to-date ones split the global
        batch (contiguous over the table's positions; still a partition, so exactly-once
        holds); everyone applies the same all-reduced update. From the second step on, the
        table's ranges apply."""
        extra = {"step": self.step, "cursor": self.cursor}
        src, got, behind = catch_up_state(self.engine.model, self.engine.optimizer, extra, self.step,
                                          lr_scheduler=self.engine.lr_scheduler)
        self.step, self.cursor = int(got["step"]), int(got["cursor"])
        self._caught_up = (src, behind)
        self._first_ranges = None
        if behind:
            rank = table.member(self.m.worker_id).rank
            ready = [r for r in range(table.world_size) if r not in behind]
            self._first_ranges = [] if rank in behind else contiguous_table(table.num_samples, len(ready))[ready.index(rank)]

    def _step_ranges(self, member) -> list:
        """This rank's ranges for the next step: the table's, or once after a catch-up the
        split computed by :meth:`_resync`."""
        ranges, self._first_ranges = self._first_ranges, None
        return member.ranges if ranges is None else ranges

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
