"""The coordinator loop: a stateless consumer that leads the jobs whose lease it holds.

Any number of replicas run the same loop. For each registered job a replica tries to take
or renew the job's lease; while it leads, it caches the job's state (coherent because
every write to it is fenced by the lease epoch), consumes the job's event stream through
the ``coordinators`` consumer group, and scans heartbeats on every tick. On takeover it
reloads state from Redis and reclaims the previous leader's pending entries first, so no
event is lost. An entry is applied and acknowledged in one fenced script, so an entry still
pending was never applied, whatever its id: reclaimed and retried entries are applied even
when a newer one already was (a fenced-out replica's late read, a handler that failed once).
Only a first delivery at or below ``applied`` (a consumer group created anew over an old
stream) is acknowledged and skipped.

``run_once`` performs one bounded iteration (tests drive it step by step); ``run`` loops
until stopped and rides out Redis outages with capped exponential backoff.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

import redis

from shoal.coordinator.balance import encode_entry, parse_registry, plan_handoffs
from shoal.coordinator.decide import Decision, EventInput, Tick, decide
from shoal.coordinator.redone import StepSeen
from shoal.coordinator.slices import Work
from shoal.coordinator.errors import StaleEpoch
from shoal.coordinator.fenced import FencedBatch, FencedWriter
from shoal.core.durable import execute_confirmed
from shoal.coordinator.lease import LeaseScripts
from shoal.coordinator.persist import decision_batch, load_state
from shoal.coordinator.states import CoordState
from shoal.events.streams import ControlEntry, ControlKind
from shoal.events.states import TERMINAL_JOB_STATES, WorkerState
from shoal.events import bus
from shoal.events.keys import CONTROL_MAXLEN, COORDINATOR_GROUP, COORDINATORS, DEAD_MAXLEN, JOBS, JobKeys, job_keys
from shoal.events.models import Heartbeat, InvalidEvent, decode_event
from shoal.core.faults import FaultPlan
from shoal.core.jobspec import JobSpec

log = logging.getLogger("shoal.coordinator")


@dataclass
class JobLead:
    """What a replica keeps for a job it leads. Dropped on any doubt; Redis is the truth."""

    keys: JobKeys
    spec: JobSpec
    writer: FencedWriter
    state: CoordState
    needs_reclaim: bool = True
    retry_own: bool = False
    attempts: dict[str, int] = field(default_factory=dict)
    last_trim_ms: int = 0
    last_reclaim_ms: int = 0
    #: Redis ms when this replica took the job (also after a Redis outage: it reloads every
    #: lead). Workers get :func:`return_grace_ms` from then to be seen again (:attr:`seen_floor_ms`).
    taken_ms: int = 0
    last_progress_ms: int = 0

    @property
    def epoch(self) -> int:
        return self.writer.epoch

    @property
    def seen_floor_ms(self) -> int:
        """The earliest a heartbeat counts from: a worker silent for the TTL is failed only
        once it also had :func:`return_grace_ms` since this replica took the job to show itself."""
        return self.taken_ms - int(self.spec.heartbeat_ttl * 1000) + return_grace_ms(self.spec)


def return_grace_ms(spec: JobSpec) -> int:
    """How long after this replica took a job (a takeover, or its return from a Redis outage)
    a live worker is sure to have beaten: two beat intervals and a second, at most the TTL.

    Workers could not beat while Redis was gone (or a fail-over had no primary yet), so a
    heartbeat from before that proves nothing. But a worker's beat that fails is tried again
    one interval later with no client back-off, and an attempt waits at most an interval and
    a second (``worker/heartbeat.py``), so once Redis is back every live worker beats within
    an interval, or two and a second when an attempt hung on the server that was gone. A full TTL from the return, as before, made a
    worker killed just before a fail-over wait TTL + the outage to be failed (16,384
    workers, a Sentinel fail-over: TTL + 4.3 s); with this grace it is failed at its TTL, or
    the grace after the return when that is later."""
    ttl_ms = int(spec.heartbeat_ttl * 1000)
    return min(ttl_ms, int(2 * spec.heartbeat_interval * 1000) + 1000)


@dataclass
class Stats:
    events_handled: int = 0
    dead_lettered: int = 0
    generations: int = 0
    failures_detected: int = 0
    takeovers: int = 0
    handoffs: int = 0
    ticks: int = 0
    detection_latency_ms: list[int] = field(default_factory=list)


def server_ms(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


class Coordinator:
    """One coordinator replica. Not thread-safe: drive it from one thread."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        instance_id: str | None = None,
        lease_ttl: float = 2.0,
        tick_interval: float = 0.1,
        block_ms: int | None = None,
        batch: int = 200,
        max_attempts: int = 3,
        progress_interval: float = 5.0,
        trim_interval: float = 5.0,
    ):
        self.client = client
        self.instance_id = instance_id or f"coord-{uuid.uuid4().hex[:8]}"
        self.token = f"{self.instance_id}:{uuid.uuid4().hex}"
        self.lease_ms = int(lease_ttl * 1000)
        self.tick_ms = int(tick_interval * 1000)
        #: the longest blocking read of the event streams (default: a tick interval)
        self.block_ms = self.tick_ms if block_ms is None else block_ms
        self.batch = batch
        self.max_attempts = max_attempts
        self.progress_ms = int(progress_interval * 1000)
        self.trim_ms = int(trim_interval * 1000)
        self.leases = LeaseScripts(client)
        self.leads: dict[str, JobLead] = {}
        self.stats = Stats()
        self._last_lease_ms = 0
        self._last_tick_ms = 0
        self._broken: dict[str, str] = {}
        self._balance_after_ms = 0
        self._balance_reason = ""
        self._seen: dict[str, int] = {}
        self._next_check = 0.0  # monotonic: when _keep_up next looks at the clock
        self.faults = FaultPlan.for_coordinator()

    # ---- leadership -------------------------------------------------------------------------

    def refresh_leases(self, now: int | None = None) -> None:
        """Take or renew the lease of every registered job; load state for new leads."""
        job_ids = sorted(j.decode() if isinstance(j, bytes) else j for j in self.client.smembers(JOBS))
        jobs = []
        for jid in job_ids:
            try:
                jobs.append(job_keys(jid))
            except ValueError:
                self._note_broken(jid, "invalid job id in registry")
        pipe = self.client.pipeline(transaction=False)
        for keys in jobs:
            self.leases.queue_hold(pipe, keys, self.token, self.lease_ms)
        # under Sentinel a lease (a takeover's epoch above all) counts once a replica holds it
        epochs = execute_confirmed(self.client, pipe, "lease renewal") if jobs else []
        held = set()
        for keys, epoch in zip(jobs, epochs):
            epoch = int(epoch or 0)
            if epoch <= 0:
                if keys.job_id in self.leads:
                    log.warning("job %s: lease lost to another replica", keys.job_id)
                    del self.leads[keys.job_id]
                continue
            held.add(keys.job_id)
            lead = self.leads.get(keys.job_id)
            if lead is None or lead.epoch != epoch:
                self._take(keys, epoch)
        for jid in list(self.leads):
            if jid not in held:
                del self.leads[jid]
        self._balance(server_ms(self.client) if now is None else now)

    def _balance(self, now: int) -> None:
        """Publish our load; hand over jobs above our fair share (``coordinator/balance.py``).

        After handing any over, wait two lease TTLs before the next plan, so that the heirs'
        new loads are in the registry before we judge again."""
        self.client.hset(COORDINATORS, self.token, encode_entry(now, len(self.leads)))
        if now < self._balance_after_ms:
            return
        live, stale = parse_registry(self.client.hgetall(COORDINATORS), now, self.lease_ms)
        if stale:
            self.client.hdel(COORDINATORS, *stale)
        # a replica counts only once its entry moved on since our last look: a dead one's
        # entry stays "recent" for a while, and a job handed to it would wait for the hint
        # to expire
        before, self._seen = self._seen, {rep.token: rep.seen_ms for rep in live}
        live = [rep for rep in live if rep.token == self.token or before.get(rep.token, rep.seen_ms) < rep.seen_ms]
        # finished jobs are handed over first: they cost the heir nothing to lead
        order = sorted(self.leads.values(), key=lambda ld: (ld.state.status.state not in TERMINAL_JOB_STATES, ld.keys.job_id))
        plan = plan_handoffs(self.token, [ld.keys.job_id for ld in order], live)
        if plan.moves:
            log.info("lease balance: %s", plan.reason)
        elif plan.reason != self._balance_reason:
            log.debug("lease balance: %s", plan.reason)
        self._balance_reason = plan.reason
        for job_id, heir in plan.moves:
            lead = self.leads.pop(job_id)
            if self.leases.hand_off(lead.keys, self.token, heir, hint_ms=2 * self.lease_ms):
                self.stats.handoffs += 1
                log.info("job %s: handed over to replica %s", job_id, heir.split(":")[0])
        if plan.moves:
            self._balance_after_ms = now + 2 * self.lease_ms

    def _take(self, keys: JobKeys, epoch: int) -> None:
        raw = self.client.get(keys.spec)
        try:
            if raw is None:
                raise ValueError("no spec stored")
            spec = JobSpec.from_stored(raw)
        except ValueError as exc:
            self._note_broken(keys.job_id, f"unreadable job spec: {str(exc).splitlines()[0]}")
            self.leases.give_up(keys, self.token)
            return
        bus.ensure_group(self.client, keys.events)
        state = load_state(self.client, keys)
        self.leads[keys.job_id] = JobLead(keys=keys, spec=spec, writer=FencedWriter(self.client, keys, self.token, epoch),
                                          state=state, taken_ms=server_ms(self.client))
        self.stats.takeovers += 1
        log.info("job %s: leading with epoch %d (state %s, generation %d)", keys.job_id, epoch, state.status.state.value, state.status.generation)

    def _note_broken(self, job_id: str, why: str) -> None:
        if self._broken.get(job_id) != why:
            self._broken[job_id] = why
            log.error("job %s skipped: %s", job_id, why)

    def release_all(self) -> None:
        """Give up every lease we hold (graceful shutdown: a standby takes over at once) and
        leave the replica registry."""
        for lead in list(self.leads.values()):
            try:
                self.leases.give_up(lead.keys, self.token)
            except redis.RedisError:
                pass
        self.leads.clear()
        try:
            self.client.hdel(COORDINATORS, self.token)
        except redis.RedisError:
            pass

    # ---- one iteration ----------------------------------------------------------------------

    def run_once(self, block_ms: int | None = None) -> int:
        """Refresh leases if due, apply pending and new events, tick if due. Returns the
        number of stream entries processed. Redis errors propagate (``run`` handles them)."""
        now = server_ms(self.client)
        self._renew_if_due(now)
        handled = 0
        for lead in list(self.leads.values()):
            if lead.needs_reclaim:
                lead.needs_reclaim = False
                handled += self.reclaim(lead, min_idle_ms=0, now=now)
            elif now - lead.last_reclaim_ms >= self.lease_ms:
                # entries a fenced-out replica read after we took over sit in its pending list
                handled += self.reclaim(lead, min_idle_ms=self.lease_ms, now=now)
            if lead.retry_own and lead.keys.job_id in self.leads:
                lead.retry_own = False
                handled += self._apply_entries(lead, bus.read_own_pending(self.client, lead.keys.events, self.instance_id, count=self.batch),
                                               pending=True)
        streams = [lead.keys.events for lead in self.leads.values()]
        if block_ms is None:
            # read until the next tick is due: with nothing to read the loop wakes once a tick
            # (a fixed 50 ms block woke it twice a tick, each time for two TIMEs and an empty read)
            due = self.tick_ms - (now - self._last_tick_ms) if self._last_tick_ms else 0
            wait = max(1, min(self.block_ms, due))
        else:
            wait = block_ms
        if streams:
            got = bus.read_new(self.client, streams, self.instance_id, count=self.batch, block_ms=wait or None)
            by_stream = {lead.keys.events: lead for lead in self.leads.values()}
            for stream, entries in got.items():
                lead = by_stream.get(stream)
                if lead is not None and lead.keys.job_id in self.leads:
                    handled += self._apply_entries(lead, entries)
        self._tick_if_due(server_ms(self.client))
        return handled

    def _renew_if_due(self, now: int) -> None:
        if now - self._last_lease_ms >= self.lease_ms // 3 or not self._last_lease_ms:
            self.refresh_leases(now)
            self._last_lease_ms = now

    def _tick_if_due(self, now: int) -> None:
        if now - self._last_tick_ms >= self.tick_ms:
            self.tick(now)
            self._last_tick_ms = now

    def run(self, stop: threading.Event, *, max_backoff: float = 1.0) -> None:
        """Loop until ``stop`` is set. Redis outages: log once, back off (0.1 s doubling to
        ``max_backoff``: a replica is promoted 2-3 s after its primary died, and every second
        of back-off after that is a second more before dead workers are failed), reload state."""
        backoff = 0.1
        down_since: float | None = None
        while not stop.is_set():
            try:
                handled = self.run_once()
                if down_since is not None:
                    log.warning("Redis reachable again after %.1f s; reloading leads", time.monotonic() - down_since)
                    down_since = None
                backoff = 0.1
                if not self.leads and not handled:
                    stop.wait(self.lease_ms / 3000)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    log.error("Redis unreachable (%s); retrying with backoff", exc)
                self.leads.clear()
                self._last_lease_ms = 0
                stop.wait(backoff)
                backoff = min(max_backoff, backoff * 2)
            except redis.ResponseError as exc:
                # e.g. NOGROUP: a job's keys were deleted under us. Forget everything we
                # cached and start over from Redis rather than die.
                log.error("Redis refused a command (%s); reloading every lead", exc)
                self.leads.clear()
                self._last_lease_ms = 0
                stop.wait(backoff)
                backoff = min(max_backoff, backoff * 2)
        try:
            self.release_all()
        except redis.RedisError:
            pass

    def reclaim(self, lead: JobLead, *, min_idle_ms: int, now: int) -> int:
        """Take over and apply entries other consumers read but never acknowledged."""
        lead.last_reclaim_ms = now
        return self._apply_entries(lead, bus.reclaim(self.client, lead.keys.events, self.instance_id, min_idle_ms=min_idle_ms),
                                   pending=True)

    # ---- applying events --------------------------------------------------------------------

    def _apply_entries(self, lead: JobLead, entries: list[bus.Entry], *, pending: bool = False) -> int:
        """Apply ``entries`` in order. ``pending``: they were pending in the group (reclaimed,
        or our own retried), hence never applied - see :meth:`_apply_entry`."""
        if not entries:
            return 0
        now = server_ms(self.client)
        for sid, fields in entries:
            if self.leads.get(lead.keys.job_id) is not lead:  # dropped (or dropped and taken anew) meanwhile
                break
            self._apply_entry(lead, sid, fields, now, pending=pending)
            now = self._keep_up(now)
        return len(entries)

    def _keep_up(self, now: int) -> int:
        """Between two entries of a batch: renew the leases and tick when they are due, and
        return the server time (``now`` until a tick interval passed). A batch of a large
        switch's ``Ready``s (each a fenced write, under Sentinel with its ``WAIT``) can take
        seconds: ticking only between batches delayed the detection of dead workers by up
        to 1.35 s at 16,384 workers, and the lease was renewed only between batches."""
        mono = time.monotonic()
        if mono < self._next_check:
            return now
        now = server_ms(self.client)
        self._renew_if_due(now)
        self._tick_if_due(now)
        # at most a fifth of a batch's time in these checks: a tick of a 16,384-member job
        # costs tens of ms, and ticking every 100 ms between Readys slowed a switch 3-fold
        self._next_check = time.monotonic() + max(self.tick_ms / 1000, 4 * (time.monotonic() - mono))
        return now

    def _apply_entry(self, lead: JobLead, sid: str, fields: dict, now: int, *, pending: bool = False) -> None:
        """Decide on one entry and commit the decision with its ``XACK`` (one fenced script).

        ``pending`` (reclaimed or retried): never applied, so applied whatever ``applied`` says.
        Skipping by id there lost events: a replica fenced out by a takeover still read a
        join into its pending list, the new leader applied a later join first, and the
        reclaimed one was acknowledged unapplied - its worker waited 30 s for a reply and
        exited (20 jobs, 60 workers and two replicas on a slow machine). A first delivery
        at or below ``applied`` is acknowledged and skipped (the group was created anew)."""
        keys = lead.keys
        if not pending and not bus.id_lt(lead.state.status.applied, sid):
            self._commit(lead, FencedBatch(keys).add("XACK", keys.events, COORDINATOR_GROUP, sid))
            return
        try:
            event = decode_event(fields, expected_job=keys.job_id)
        except InvalidEvent as exc:
            self._dead_letter(lead, sid, fields, exc.reason, now)
            return
        except Exception as exc:  # a decoder bug must not kill the consumer either
            self._dead_letter(lead, sid, fields, f"undecodable: {type(exc).__name__}: {exc}", now)
            return
        self.faults.count(event.kind, "before_apply")
        try:
            decision = decide(lead.state, EventInput(sid, event), now, lead.spec, lead.epoch)
        except Exception as exc:  # a bug in a handler must not kill the consumer
            n = lead.attempts.get(sid, 0) + 1
            lead.attempts[sid] = n
            if n >= self.max_attempts:
                lead.attempts.pop(sid, None)
                self._dead_letter(lead, sid, fields, f"handler failed {n} times: {type(exc).__name__}: {exc}", now)
            else:
                log.exception("job %s: handling %s failed (attempt %d/%d)", keys.job_id, sid, n, self.max_attempts)
                lead.retry_own = True
            return
        self._record(lead, decision, kind=event.kind, source_id=sid, now=now)
        self.stats.events_handled += 1
        self.faults.count(event.kind, "after_apply")

    def _record(self, lead: JobLead, decision: Decision, *, kind: ControlKind | str, source_id: str, now: int) -> None:
        """Persist a decision through the fence (plus ``applied``/XACK for stream entries)."""
        state = decision.state
        is_entry = source_id != "tick"
        if is_entry:  # the newest id applied: a reclaimed older entry does not move it back
            state = replace(state, status=replace(state.status, applied=bus.id_max(state.status.applied, source_id)))
            decision = replace(decision, state=state)
        batch = decision_batch(lead.keys, lead.state, decision, kind=kind, source_id=source_id, now_ms=now, epoch=lead.epoch,
                               coordinator=self.instance_id)
        if is_entry:
            batch.add("XACK", lead.keys.events, COORDINATOR_GROUP, source_id)
        if not self._commit(lead, batch):
            return
        old_gen = lead.state.status.generation
        lead.state = state
        if state.status.generation != old_gen:
            self.stats.generations += 1
        if decision.changed:
            log.info("job %s [%s]: %s", lead.keys.job_id, kind, decision.reason)

    def _dead_letter(self, lead: JobLead, sid: str, fields: dict, reason: str, now: int) -> None:
        keys = lead.keys
        status = replace(lead.state.status, applied=bus.id_max(lead.state.status.applied, sid))
        batch = FencedBatch(keys)
        batch.xadd(keys.dead, bus.dead_letter_fields(fields, reason, sid), maxlen=DEAD_MAXLEN)
        batch.hset(keys.state, {"applied": status.applied})
        entry = ControlEntry(ts_ms=now, epoch=lead.epoch, coordinator=self.instance_id, kind=ControlKind.DEAD_LETTER, source_id=sid,
                             job_state=status.state, generation=status.generation,
                             reason=f"dead-lettered {sid}: {reason}")
        batch.xadd(keys.control, entry.to_fields(), maxlen=CONTROL_MAXLEN)
        batch.add("XACK", keys.events, COORDINATOR_GROUP, sid)
        if self._commit(lead, batch):
            lead.state = replace(lead.state, status=status)
            self.stats.dead_lettered += 1
            log.warning("job %s: dead-lettered %s: %s", keys.job_id, sid, reason)

    def _commit(self, lead: JobLead, batch: FencedBatch) -> bool:
        try:
            lead.writer.commit(batch)
            return True
        except StaleEpoch as exc:
            log.warning("%s; dropping job", exc)
            self.leads.pop(lead.keys.job_id, None)
            return False

    # ---- ticks -------------------------------------------------------------------------------

    def tick(self, now: int) -> None:
        """Scan every led job for stale heartbeats (Redis server time), stragglers, settled joins."""
        self.stats.ticks += 1
        leads = [lead for lead in self.leads.values() if lead.state.status.state not in TERMINAL_JOB_STATES]
        if not leads:
            return
        pipe = self.client.pipeline(transaction=False)
        sampled: list[JobLead] = []
        for lead in leads:
            ttl_ms = int(lead.spec.heartbeat_ttl * 1000)
            pipe.zrangebyscore(lead.keys.last_seen, "-inf", now - ttl_ms, withscores=True)
            pipe.zrangebyscore(lead.keys.busy, "-inf", now - int(lead.spec.step_timeout * 1000), withscores=True)
        scanned = pipe.execute()
        stale_lists, busy_lists = scanned[0::2], scanned[1::2]
        pipe = self.client.pipeline(transaction=False)
        for lead in leads:
            if now - lead.last_progress_ms >= _progress_ms(lead.spec, self.progress_ms):
                active = [w for w, r in lead.state.workers.items() if r.state == WorkerState.ACTIVE]
                if active:  # step times (stragglers: two or more) and committed steps (redone steps)
                    pipe.mget([lead.keys.heartbeat(w) for w in active])
                    sampled.append(lead)
                lead.last_progress_ms = now
        progress = dict(zip((lead.keys.job_id for lead in sampled), pipe.execute() if sampled else []))
        for lead, stale, busy in zip(leads, stale_lists, busy_lists):
            if lead.keys.job_id not in self.leads:
                continue
            floor = lead.seen_floor_ms
            last_seen = {(w.decode() if isinstance(w, bytes) else w): max(int(score), floor) for w, score in stale}
            # like heartbeats, a step counts as busy from our own taking of the job at the earliest
            busy_since = {(w.decode() if isinstance(w, bytes) else w): max(int(score), lead.taken_ms) for w, score in busy}
            sample = progress.get(lead.keys.job_id)
            step_times, steps = _step_times(sample), _steps_seen(sample)
            # work counters matter to slices by speed only: no decide() call for them otherwise
            work = _work_seen(sample) if lead.spec.batch_split == "by_speed" else {}
            status = lead.state.status
            # a tick decides on stale heartbeats, step times and committed steps, a settling
            # join, a failed step awaiting its new generation, or a job whose generations have
            # not formed yet (it fails at its formation deadline)
            if (not last_seen and not busy_since and not step_times and not steps and not work and not status.pending_join_ms
                    and not status.formation.unformed_since_ms and not status.step_failed_ms
                    and not status.regroup_at_ms and not status.formation.retry_ms):
                continue
            tick = Tick(last_seen=last_seen, step_times=step_times, steps=steps, busy_since=busy_since, work=work)
            decision = decide(lead.state, tick, now, lead.spec, lead.epoch)
            # a higher committed step changes only the status: stored, with no control entry
            if not decision.changed and not decision.actions and decision.state.status == status:
                continue
            failed_before = sum(1 for r in lead.state.workers.values() if r.state == WorkerState.FAILED)
            self._record(lead, decision, kind=ControlKind.TICK, source_id="tick", now=now)
            failed_after = sum(1 for r in lead.state.workers.values() if r.state == WorkerState.FAILED)
            if failed_after > failed_before:
                self.stats.failures_detected += failed_after - failed_before
                ttl_ms = int(lead.spec.heartbeat_ttl * 1000)
                self.stats.detection_latency_ms += [now - seen - ttl_ms for seen in last_seen.values()]
        for lead in leads:
            if now - lead.last_trim_ms >= self.trim_ms and lead.keys.job_id in self.leads:
                lead.last_trim_ms = now
                self.trim(lead)

    def trim(self, lead: JobLead) -> None:
        """Trim the event stream up to the oldest entry still pending or undelivered."""
        info = bus.group_info(self.client, lead.keys.events)
        if info is None or info.last_delivered == "0-0":
            return
        self._commit(lead, FencedBatch(lead.keys).add("XTRIM", lead.keys.events, "MINID", bus.safe_trim_id(info)))


def _step_times(values: list | None) -> dict[str, float]:
    """Recent step time per worker from sampled heartbeat values (missing or unreadable
    heartbeats, and those without a step time yet, are left out)."""
    return {hb.worker_id: hb.step_time for hb in _heartbeats(values) if hb.step_time}


#: How often a job with slices by speed has its members' heartbeats sampled (at most; ms):
#: each look measures the rate over every step since the previous one, so this bounds only
#: how soon a re-plan can follow ``batch_split_every`` steps.
SPEED_SAMPLE_MS = 1000


def _progress_ms(spec, progress_ms: int) -> int:
    """The heartbeat sampling period of a job (``progress_ms``, shorter with slices by speed)."""
    return min(progress_ms, SPEED_SAMPLE_MS) if spec.batch_split == "by_speed" else progress_ms


def _work_seen(values: list | None) -> dict[str, Work]:
    """The work counters per worker from sampled heartbeat values (missing or unreadable
    heartbeats, and those without counters yet, are left out)."""
    return {hb.worker_id: Work(hb.work_samples, hb.work_seconds) for hb in _heartbeats(values)
            if hb.work_samples is not None and hb.work_seconds is not None}


def _steps_seen(values: list | None) -> dict[str, StepSeen]:
    """The committed step (and its generation) per worker from sampled heartbeat values
    (missing or unreadable heartbeats, and those at step 0, are left out)."""
    return {hb.worker_id: StepSeen(hb.generation, hb.step) for hb in _heartbeats(values) if hb.step > 0}


def _heartbeats(values: list | None) -> list[Heartbeat]:
    out = []
    for raw in values or []:
        if raw is None:
            continue
        try:
            out.append(Heartbeat.model_validate_json(raw))
        except ValueError:
            continue
    return out
