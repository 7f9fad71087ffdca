"""A training worker's generation switch: waiting for a table, meeting the generation's other
members, forming its groups, catching up, and announcing it.

:class:`GenerationSwitch` owns what a switch needs besides the training layout: the barrier
where the members of a generation meet (:class:`~shoal.worker.barrier.GenerationBarrier`), the
watcher thread that follows the job's tables and state (:class:`~shoal.worker.watcher.
GenerationWatcher`) and has the layout abort the collectives an eviction concerns, or all of
them when the job fails, and the helper thread that computes the digest of the state a
generation starts from and sends ``ready`` while the first step runs. The training worker's
decisions say when to call which (``shoal.worker.decide``): :meth:`wait_table`,
:meth:`poll_barrier`, :meth:`form`, :meth:`announce`, :meth:`digest_done`.

Forming and leaving a generation's groups, and which collectives an eviction concerns, are the
layout's (:class:`~shoal.worker.layout.Layout`: data parallelism or elastic HSDP); the switch
never asks which one it holds.

Threads: :meth:`on_table`, :meth:`on_ended` run on the watcher's thread and
:meth:`on_evicted` on the heartbeat's; they only read ``group`` (replaced, never mutated) and
call the layout's abort methods, which any thread may, or end the process. Everything else
runs on the training thread.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace

from shoal.core.faults import FaultPlan
from shoal.core.jobspec import JobSpec
from shoal.events.models import ShardTable
from shoal.events.states import is_terminal
from shoal.worker.barrier import GenerationBarrier
from shoal.worker.decide import Announce, BarrierPolled, Formed, FormFailed, TableWaited
from shoal.worker.digest import digest_of
from shoal.worker.layout import Layout
from shoal.worker.membership import Membership
from shoal.worker.store import legacy_rendezvous
from shoal.worker.watcher import GenerationWatcher

log = logging.getLogger("shoal.worker")

DIGEST_JOIN_TIMEOUT = 60.0  # the switch digest's thread, awaited before the first update


class GenerationSwitch:
    """See the module docstring. ``evicted()`` says whether the coordinator evicted this
    worker (its heartbeat's view); :meth:`start` once the worker joined."""

    def __init__(self, membership: Membership, spec: JobSpec, layout: Layout, *, faults: FaultPlan,
                 evicted: Callable[[], bool]) -> None:
        self.membership = membership
        self.spec = spec
        self.layout = layout
        self.faults = faults
        self.evicted = evicted
        #: the generation and member ids of the group being formed or joined (read by the
        #: watcher's and the heartbeat's threads)
        self.group: tuple[int, frozenset[str]] = (0, frozenset())
        # started by start()
        self.watcher: GenerationWatcher | None = None
        #: where the members of a generation meet (blocking waits; the watcher wakes them)
        self.barrier: GenerationBarrier | None = None
        self._legacy_barrier = legacy_rendezvous()  # benches only: the 2 ms polling barrier
        # the switch digest's helper (one long-lived thread: no start-up per switch) and the
        # (future, generation, step) it is working on
        self._digester = ThreadPoolExecutor(1, thread_name_prefix="switch-digest")
        self._digesting: tuple[Future, int, int] | None = None
        #: the newest table the watcher delivered (its thread writes it, the training thread
        #: reads it: a prefetch hint only, never a decision)
        self.newest_table: ShardTable | None = None

    def start(self) -> None:
        """Once joined: the barrier and the watcher thread (the client's pool gives the
        watcher's blocking XREAD a connection of its own)."""
        m = self.membership
        self.barrier = GenerationBarrier(m.client, m.keys)
        self.watcher = GenerationWatcher(m.client, m.keys, interval=min(1.0, self.spec.heartbeat_interval * 2),
                                         on_table=self.on_table, on_ended=self.on_ended)
        self.watcher.start()

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()

    # ---- the other threads' hooks ------------------------------------------------------------

    def on_table(self, table: ShardTable) -> None:
        """(The watcher's thread.) A newer table that evicts a member of our generation: the
        layout aborts the collectives we share with it now (:meth:`Layout.abort_for`) - that
        peer is hung, cut off or dead, and will not come. A wait at an older generation's
        barrier ends at once (this one supersedes it)."""
        self.newest_table = table
        if self.barrier is not None:
            self.barrier.wake(newer=table.generation)
        generation, members = self.group
        if table.generation <= generation or not table.evicted:
            return
        self.layout.abort_for(generation, members, table.evicted, table.generation)

    def on_ended(self, state: str) -> None:
        """(The watcher's thread.) The job failed: a group still being formed (its rendezvous
        waits for peers that will not come) or stuck in a collective is aborted, so the loop
        sees the end at once. Not on a completed or stopped job: there every member finishes
        its step (a stop saves a checkpoint of it). A wait at a barrier ends at once."""
        if self.barrier is not None:
            self.barrier.wake()
        generation, _members = self.group
        if generation and state == "failed":
            self.layout.abort_all(generation, "the job failed")

    def on_evicted(self) -> None:
        """(The heartbeat thread.) This worker is no longer a member - declared failed, or its
        record lost with Redis's data: its step cannot commit (the fence would refuse it), so
        the group's collectives are aborted now instead of waiting for peers that may have
        left already (after a Redis wipe a peer whose fence found out first left the group,
        and this one sat in the next step's all-reduce until the collective timeout: 65 s)."""
        generation, _members = self.group
        self.layout.membership_lost(generation, "this worker is no longer a member of the job (declared failed, "
                                                "or its record was lost with Redis's data)")

    # ---- the switch's steps ------------------------------------------------------------------

    def wait_table(self, after: int) -> TableWaited:
        """One bounded wait for a table newer than ``after``."""
        if self.evicted():
            return TableWaited(evicted=True)
        table = self.membership.next_table(after, timeout=min(1.0, self.spec.heartbeat_ttl))
        if table is not None:
            return TableWaited(table)
        return TableWaited(job_ended=is_terminal(self.membership.job_state()))

    def arrive(self, generation: int, world: int) -> None:
        self.barrier.arrive(generation, self.membership.worker_id, world)

    def poll_barrier(self, generation: int, world: int, wait: float) -> BarrierPolled:
        """One blocking wait (at most ``wait`` s) at the barrier; a newer table or the job's
        end (the watcher's, read locally) ends it early (:meth:`on_table`, :meth:`on_ended`)."""
        if self._legacy_barrier:
            p = self.barrier.poll_legacy(generation)
            return BarrierPolled(p.arrived, p.newest, self.evicted(), job_ended=is_terminal(p.job_state))
        watcher = self.watcher

        def interrupted() -> bool:
            return watcher.latest > generation or is_terminal(watcher.job_state) or self.evicted()

        arrived = self.barrier.wait(generation, self.membership.worker_id, world, wait, interrupted)
        return BarrierPolled(arrived, watcher.latest, self.evicted(), job_ended=is_terminal(watcher.job_state))

    def form(self, table: ShardTable, step: int, cursor: int) -> Formed | FormFailed:
        """Form ``table``'s groups (:meth:`Layout.form`) and start every member from the most
        advanced member's state. ``step``/``cursor``: this member's committed ones."""
        self.faults.at(self.membership.worker_id, step, "rendezvous")
        t0 = time.monotonic()
        self.group = (table.generation, frozenset(m.worker_id for m in table.members))
        formed = self.layout.form(table, table.member(self.membership.worker_id), step, cursor)
        return replace(formed, took=time.monotonic() - t0) if isinstance(formed, Formed) else formed

    def leave(self, *, background: bool = False) -> None:
        """Leave the generation's groups (:meth:`Layout.leave`). Never raises."""
        self.layout.leave(background=background)

    def aborted(self) -> bool:
        """Whether the generation's groups were aborted (their collectives fail at once)."""
        return self.layout.aborted()

    def announce(self, act: Announce, publish_digest: Callable[[str], None]) -> None:
        """Log (and ``publish_digest``) the digest of the state this member starts
        ``act.generation`` from and send ``ready``: on the helper thread while the first step
        runs. The parameters do not change before that step's update, which waits for the
        helper (``engine.before_update``); buffers, which the forward pass may update, are
        copied. So a member reported Active has logged its starting digest, and ``ready``
        precedes its first commit in the generation, as when this was done inline."""
        model = self.layout.model
        params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        state = {k: v if k in params else v.clone() for k, v in model.state_dict().items()}
        moved = f"; state from rank {act.src} to {list(act.behind)}" if act.behind else ""

        def run() -> None:
            try:
                digest = digest_of(state)
                publish_digest(digest)
                log.info("generation %d: rank %d/%d, step %d, cursor %d, digest %s (switch %.3fs%s)",
                         act.generation, act.rank, act.world, act.step, act.cursor, digest, act.took, moved)
            except Exception:  # noqa: BLE001 - a diagnostic: never stops training
                log.warning("the digest of generation %d's starting state failed", act.generation, exc_info=True)
            self.membership.ready(act.generation, act.step)  # on failure, sent again by digest_done

        self._digesting = (self._digester.submit(run), act.generation, act.step)
        self.layout.before_update(self.digest_done)

    def digest_done(self) -> None:
        """Wait (bounded) for :meth:`announce`'s helper; send ``ready`` from here when it
        could not (raising what the send raises)."""
        pending, self._digesting = self._digesting, None
        if pending is None:
            return
        future, generation, step = pending
        try:
            future.result(DIGEST_JOIN_TIMEOUT)
        except FutureTimeout:
            log.warning("the switch digest took more than %.0f s; training on", DIGEST_JOIN_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - the helper's ready failed: once more, here
            log.warning("ready for generation %d failed on the helper thread (%s); sending it again", generation, exc)
            self.membership.ready(generation, step)
