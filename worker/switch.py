"""A training worker's generation switch: waiting for a table, meeting the generation's other
members, forming its group, catching up, and announcing it.

:class:`GenerationSwitch` owns what a switch needs besides the model: the barrier where the
members of a generation meet (:class:`~shoal.worker.barrier.GenerationBarrier`), the watcher
thread that follows the job's tables and state (:class:`~shoal.worker.watcher.GenerationWatcher`)
and aborts the group's collectives when a newer table evicts one of its members or the job
fails, and the helper thread that computes the digest of the state a generation starts from
and sends ``ready`` while the first step runs. The training worker's decisions say when to
call which (``shoal.worker.decide``): :meth:`wait_table`, :meth:`poll_barrier`, :meth:`form`,
:meth:`announce`, :meth:`digest_done`.

Elastic HSDP (the table's ``shard_size`` > 1): the first generation a worker trains in also
forms its replica group's shard group (the process's registered default group, kept for the
replica group's life; :meth:`ShardedEngine.shard` wraps the model over it), and every
generation forms a standalone cross-replica group of this member's shard index, over which the
catch-up heals a new replica group shard by shard; a switch drops only that cross group. When
this worker's own replica group loses a member, or this worker is evicted, it exits at once
(:class:`~shoal.worker.errors.ReplicaGroupLost`): its agent starts it again and it joins a new
replica group.

An eviction aborts exactly the collectives it concerns (:meth:`on_table`). Data parallelism:
the group of the generation the evicted member belonged to, formed or being formed (a newer
generation's group is never touched: :func:`~shoal.worker.process_group.request_abort` checks
the generation). HSDP: that generation's cross-replica group, formed or being formed - never
the shard group, which outlives generations and which only the loss of a member of this
worker's own replica group concerns (and that ends the process). At 5e93599 a table that
arrived after a failed step had already dropped the cross group aborted the process's current
group instead - the shard group - and the abort outlived the generation it was meant for:
every later step of that replica group failed its vote, for good (issue 34). A shard group
that survives a switch is proven usable before it is trained on: :meth:`_form_hsdp` ends with
one collective over it that checks every member starts from the same step; an aborted or
broken shard group ends the process (its agent starts it again in a new replica group).

Threads: :meth:`on_table`, :meth:`on_ended` run on the watcher's thread and
:meth:`on_evicted` on the heartbeat's; they only read ``group``, ``replica`` (replaced, never
mutated), the group objects and the cross group's forming flag (under ``_lock``), and call a
group's ``request_abort`` or :func:`~shoal.worker.process_group.request_abort`, which any
thread may, or end the process. Everything else runs on the training thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import torch.distributed as dist

from shoal.core.faults import FaultPlan
from shoal.core.jobspec import JobSpec
from shoal.events.models import ShardTable
from shoal.events.states import is_terminal
from shoal.worker import process_group as pg
from shoal.worker.barrier import GenerationBarrier
from shoal.worker.classify import formation_error
from shoal.worker.decide import Announce, BarrierPolled, Formed, FormFailed, TableWaited
from shoal.worker.digest import digest_of
from shoal.worker.engine import StepEngine
from shoal.worker.errors import CollectiveFailed, ReplicaGroupLost, RendezvousFailed, StateMismatch
from shoal.worker.membership import Membership
from shoal.worker.placement import Placement
from shoal.worker.restart import exit_for_restart
from shoal.worker.store import legacy_rendezvous
from shoal.worker.transfer import catch_up_state, state_bytes, transfer_timeout
from shoal.worker.watcher import GenerationWatcher

log = logging.getLogger("shoal.worker")

DIGEST_JOIN_TIMEOUT = 60.0  # the switch digest's thread, awaited before the first update


class GenerationSwitch:
    """See the module docstring. ``evicted()`` says whether the coordinator evicted this
    worker (its heartbeat's view); :meth:`start` once the worker joined."""

    def __init__(self, membership: Membership, spec: JobSpec, engine: StepEngine, placement: Placement, *,
                 iface: str | None, faults: FaultPlan, rdzv_timeout: float, collective_timeout: float,
                 evicted: Callable[[], bool]) -> None:
        self.membership = membership
        self.spec = spec
        self.engine = engine
        self.placement = placement
        #: the interface gloo advertises (None: ``SHOAL_IFACE``, else the route to Redis)
        self.iface = iface
        self.faults = faults
        #: bounds the Redis barrier and each wait of the rendezvous
        self.rdzv_timeout = rdzv_timeout
        self.collective_timeout = collective_timeout
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
        #: elastic HSDP: this worker's replica group (its id and member ids, from the table it
        #: first trained in), its shard group, and this generation's cross-replica group
        self.hsdp = spec.shard_size > 1
        self.replica: tuple[str, frozenset[str]] = ("", frozenset())
        self.shard_group: pg.Group | None = None
        self.cross: pg.Group | None = None
        #: the cross-replica group being formed: [generation, abort reason] (None: none is);
        #: the watcher's thread sets the reason, the rendezvous reads it (under ``_lock``)
        self._cross_forming: list | None = None
        self._lock = threading.Lock()

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
        """(The watcher's thread.) A newer table that evicts a member of our generation: abort
        the collectives we share with it now - that peer is hung, cut off or dead, and will
        not come. A wait at an older generation's barrier ends at once (this one supersedes
        it). Only the evicted members' generation's group is aborted (see the module
        docstring); HSDP: a table that evicts a member of this worker's own replica group ends
        the process once its shard group exists (aborts its rendezvous before)."""
        if self.barrier is not None:
            self.barrier.wake(newer=table.generation)
        generation, members = self.group
        if table.generation <= generation or not table.evicted:
            return
        if not self.hsdp:
            gone = [w for w in table.evicted if w in members]
            if gone:  # the group formed, or being formed (its rendezvous waits for that peer)
                pg.request_abort(generation, f"generation {table.generation} evicted {', '.join(gone)}")
            return
        group_id, replica = self.replica
        lost = [w for w in table.evicted if w in replica]
        if lost:
            why = f"generation {table.generation} evicted {', '.join(lost)} of replica group {group_id}"
            if self.shard_group is not None:
                self.exit_regroup(why)
            pg.request_abort(generation, why)  # the shard group being formed waits for that member
        gone = [w for w in table.evicted if w in members and w not in replica]
        if gone:
            self._abort_cross(generation, f"generation {table.generation} evicted {', '.join(gone)}")

    def _abort_cross(self, generation: int, why: str) -> None:
        """(Any thread.) Abort ``generation``'s cross-replica group, formed or being formed;
        nothing when this worker holds none of that generation (it left it already)."""
        with self._lock:
            forming = self._cross_forming
            if forming is not None and forming[0] == generation and not forming[1]:
                forming[1] = why
                log.warning("aborting the rendezvous of generation %d's cross-replica group: %s", generation, why)
            cross = self.cross
        if cross is not None and cross.generation == generation:
            cross.request_abort(why)

    def on_ended(self, state: str) -> None:
        """(The watcher's thread.) The job failed: a group still being formed (its rendezvous
        waits for peers that will not come) or stuck in a collective is aborted, so the loop
        sees the end at once. Not on a completed or stopped job: there every member finishes
        its step (a stop saves a checkpoint of it). A wait at a barrier ends at once."""
        if self.barrier is not None:
            self.barrier.wake()
        generation, _members = self.group
        if generation and state == "failed":
            if self.hsdp:
                self._abort_cross(generation, "the job failed")
                shard_group = self.shard_group
                if shard_group is not None:  # the process ends next: nothing outlives it
                    shard_group.request_abort("the job failed")
            pg.request_abort(generation, "the job failed")

    def on_evicted(self) -> None:
        """(The heartbeat thread.) This worker is no longer a member - declared failed, or its
        record lost with Redis's data: its step cannot commit (the fence would refuse it), so
        the group's collectives are aborted now instead of waiting for peers that may have
        left already (after a Redis wipe a peer whose fence found out first left the group,
        and this one sat in the next step's all-reduce until the collective timeout: 65 s)."""
        if self.shard_group is not None:
            self.exit_regroup("this worker is no longer a member of the job (declared failed, or its record was "
                              "lost with Redis's data)")
        generation, _members = self.group
        if generation:
            pg.request_abort(generation, "this worker is no longer a member of the job (declared failed, "
                                         "or its record was lost with Redis's data)")

    def exit_regroup(self, why: str) -> None:
        """(Any thread.) End this process for its node agent to start again: its replica
        group's shard group cannot go on (:class:`ReplicaGroupLost`). Nothing of it is lost:
        the other replica groups hold the same state and heal the new group."""
        exit_for_restart(f"{why}: this replica group goes whole, and this worker joins a new one")

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

    def form(self, table: ShardTable, rank: int, step: int, cursor: int) -> Formed | FormFailed:
        """Join ``table``'s group and make every member's state equal to the most advanced
        member's: only the members that are behind (a joiner; after a failure, one that missed
        the contested step) receive it, from one sender that does not wait for the transfer.
        ``step``/``cursor``: this member's committed ones."""
        self.faults.at(self.membership.worker_id, step, "rendezvous")
        t0 = time.monotonic()
        self.group = (table.generation, frozenset(m.worker_id for m in table.members))
        if self.hsdp:
            return self._form_hsdp(table, step, cursor, t0)
        engine = self.engine
        try:
            pg.join_group(self.membership.client, self.membership.job_id, table.generation, rank, table.world_size,
                          timeout=self.rdzv_timeout, iface=self.iface, backend=self.placement.backend,
                          device=engine.device,
                          # a state transfer is bounded by its own, size-scaled timeout
                          collective_timeout=max(self.collective_timeout,
                                                 transfer_timeout(state_bytes(engine.model, engine.optimizer))))
            # the engine's replicated state (the fp16 loss scale) travels in extra
            extra = {"step": step, "cursor": cursor, **engine.state_extras()}
            src, got, behind = catch_up_state(engine.model, engine.optimizer, extra, step,
                                              lr_scheduler=engine.lr_scheduler)
            engine.load_state_extras(got)
        except (RendezvousFailed, CollectiveFailed, StateMismatch) as exc:
            return FormFailed(str(exc), formation_error(exc))
        return Formed(int(got["step"]), int(got["cursor"]), src, tuple(behind), time.monotonic() - t0)

    def _form_hsdp(self, table: ShardTable, step: int, cursor: int, t0: float) -> Formed | FormFailed:
        """HSDP's form: the replica group's shard group on its first generation (and the
        model sharded over it), this generation's cross-replica group of this member's shard
        index, and the catch-up over it: a new replica group receives every shard from the
        most advanced one. Then the replica group votes over its shard group
        (:meth:`_vote_on_form`): it goes on only when every member formed and starts from the
        same step - a member that could not form its cross group must not leave the others
        inside the first step's FSDP collectives, which nothing can cancel."""
        me = table.member(self.membership.worker_id)
        engine = self.engine
        m = self.membership
        replicas = table.world_size // table.shard_size
        try:
            if self.shard_group is None:
                self.replica = (me.group, frozenset(x.worker_id for x in table.members if x.group == me.group))
                self.shard_group = pg.join_group(m.client, m.job_id, table.generation, me.shard, table.shard_size,
                                                 timeout=self.rdzv_timeout, iface=self.iface,
                                                 backend=self.placement.backend, device=engine.device,
                                                 prefix=m.keys.replica_rendezvous(me.group, table.generation),
                                                 collective_timeout=max(self.collective_timeout,
                                                                        transfer_timeout(state_bytes(engine.model,
                                                                                                     engine.optimizer))))
                try:
                    engine.shard(self.shard_group)
                except Exception:
                    pg.leave_group()  # the next try forms the shard group anew, on a fresh prefix
                    self.shard_group = None
                    raise
                if engine.resumed_at is not None:  # another checkpoint than the one chosen at start
                    step, cursor = engine.resumed_at
            elif me.group != self.replica[0]:  # the coordinator never moves a member: a bug
                self.exit_regroup(f"generation {table.generation} puts this worker in replica group {me.group}, "
                                  f"not {self.replica[0]}")
        except (RendezvousFailed, CollectiveFailed, StateMismatch, ValueError) as exc:
            return FormFailed(str(exc), formation_error(exc))
        failure: Exception | None = None
        got = {"step": step, "cursor": cursor}
        src = 0
        try:
            cross = None
            if replicas > 1:
                forming = [table.generation, ""]
                with self._lock:
                    self._cross_forming = forming
                try:
                    cross = pg.new_standalone_group(
                        m.client, m.keys.cross_rendezvous(table.generation, me.shard), me.replica, replicas,
                        self.rdzv_timeout, job_id=m.job_id, generation=table.generation, device=engine.device,
                        name=f"generation {table.generation}'s cross-replica group of shard {me.shard}",
                        iface=self.iface, abort=lambda: forming[1],
                        collective_timeout=max(self.collective_timeout,
                                               transfer_timeout(state_bytes(engine.model, engine.optimizer))))
                finally:
                    with self._lock:
                        self._cross_forming = None
                        self.cross = cross  # from here an eviction aborts it directly
            engine.set_cross(cross)
            if cross is not None:  # one replica group: nothing to heal from
                extra = {"step": step, "cursor": cursor, **engine.state_extras()}
                src, got, _behind = catch_up_state(engine.model, engine.optimizer, extra, step,
                                                   lr_scheduler=engine.lr_scheduler, group=cross)
        except (RendezvousFailed, CollectiveFailed, StateMismatch, ValueError) as exc:
            failure = exc
        others = self._vote_on_form(table.generation, failure is not None, int(got["step"]), int(got["cursor"]))
        if failure is not None or others:
            self.leave()
            if failure is not None:
                return FormFailed(str(failure), formation_error(failure))
            return FormFailed(f"generation {table.generation}: {others}")
        # every member of a replica group takes its table ranges at once (FSDP's collectives go
        # in lock-step within the group): nobody sits the first step out
        return Formed(int(got["step"]), int(got["cursor"]), src * table.shard_size, (), time.monotonic() - t0)

    def _vote_on_form(self, generation: int, failed: bool, step: int, cursor: int) -> str:
        """The replica group's vote at the end of a switch, over its shard group (every member
        reaches it, whether its own part of the switch worked or not): "" when every member
        formed, else why not. It also proves the shard group usable before it is trained on -
        not aborted, and one collective over it goes through - and that every member starts
        ``generation`` from the same step and cursor. A shard group that is not usable, or
        members whose states differ, end the process (:meth:`exit_regroup`): its agent starts
        it again in a new replica group, healed from the others. One all-reduce of five
        numbers per switch."""
        group = self.shard_group
        why = group.abort_reason
        if not why:
            vote = torch.tensor([1.0 if failed else 0.0, step, -step, cursor, -cursor], dtype=torch.float64,
                                device=self.engine.device)
            try:
                group.all_reduce(vote, dist.ReduceOp.MAX, what=f"the replica group's vote on generation {generation}")
            except CollectiveFailed as exc:
                why = str(exc)
            else:
                others, high, low, ahead, behind = vote.tolist()
                if others > 0:
                    return f"another member of replica group {self.replica[0]} could not form it"
                if high != -low or ahead != -behind:
                    why = (f"its members start generation {generation} from different states (steps {int(-low)}-"
                           f"{int(high)}, cursors {int(-behind)}-{int(ahead)})")
        if why:
            self.exit_regroup(f"the shard group of replica group {self.replica[0]} cannot train in generation "
                              f"{generation}: {why}")
        return ""

    def leave(self, *, background: bool = False) -> None:
        """Leave the generation's group: data parallelism, the process's group
        (:func:`~shoal.worker.process_group.leave_group`); HSDP, the cross-replica group only
        (the shard group lives as long as the replica group). Never raises."""
        if not self.hsdp:
            pg.leave_group(background=background)
            return
        with self._lock:
            cross, self.cross = self.cross, None
        self.engine.set_cross(None)
        if cross is not None:
            cross.close(background=background)

    def aborted(self) -> bool:
        """Whether the generation's group was aborted (its collectives fail at once)."""
        if self.hsdp:
            return bool(self.cross is not None and self.cross.abort_reason)
        return bool(pg.aborted())

    def announce(self, act: Announce, publish_digest: Callable[[str], None]) -> None:
        """Log (and ``publish_digest``) the digest of the state this member starts
        ``act.generation`` from and send ``ready``: on the helper thread while the first step
        runs. The parameters do not change before that step's update, which waits for the
        helper (``engine.before_update``); buffers, which the forward pass may update, are
        copied. So a member reported Active has logged its starting digest, and ``ready``
        precedes its first commit in the generation, as when this was done inline."""
        model = self.engine.model
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
        self.engine.before_update(self.digest_done)

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
