"""The chaos soak's faults: what each one does to which process, and when it is allowed.

Every fault is injected from outside, with real signals, into real processes:

- ``worker_kill``: SIGKILL an Active worker (its agent starts a replacement);
- ``worker_segv``: SIGSEGV an Active worker (an abrupt native crash, no Python cleanup);
- ``worker_stop``: SIGSTOP an Active worker for longer than the heartbeat TTL, then SIGCONT
  (it is declared failed while frozen, finds itself evicted when it wakes, and exits);
- ``worker_slow``: SIGUSR1 to an Active worker, whose fault rule ``*@usr1:mid_step:sleep=S``
  then stalls its next step past the heartbeat TTL (and past the 3 s collective timeout
  shoal had before its step timeout existed) while its heartbeats go on: a slow peer, not a
  dead one, within the job's step timeout. Its peers wait for it in their all-reduce; nobody
  is declared failed or exits, and the same generation goes on once the stall is over;
- ``coordinator_kill``: SIGKILL the replica holding the job's lease (a new replica is
  started at once, so two always run; the standby takes over);
- ``coordinator_stop``: SIGSTOP the replica holding the job's lease for 0.5-3 s (a busy node
  stalls a process that long), and - when a worker fault is allowed - a worker fault
  (``worker_kill``, ``worker_segv`` or ``worker_stop``, counted as its own fault) lands inside
  the stall: the survivors' step fails before any table says why, and the table comes only
  when the coordinator is back (or the standby took the lease over). The case that wedged
  elastic HSDP for good at 5e93599 (issue 34);
- ``redis_failover``: SIGKILL the Redis primary (the soak's Redis is a Sentinel set: a
  primary, 2 replicas, 3 sentinels); once the sentinels promoted a replica, the killed node
  comes back as a replica of the new primary, so the set stays whole for the next one. (A
  single server restarted from its AOF, or empty, has its own tests: test_redis_loss.py);
- ``worker_join``: start one more worker process outside the agent (up to ``max_workers``;
  elastic HSDP: a whole replica group, ``shard_size`` processes).

Worker faults need two Active workers (elastic HSDP: two whole replica groups Active) and the
previous worker fault recovered: losing every replica at once can only resume from a
checkpoint, which re-commits the steps after it, and the soak proves the elastic path, not the
restart path (that one has its own test). In elastic HSDP a worker fault takes its whole
replica group out: the fault's ``hits`` name the group's other members.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import redis

from shoal.events.keys import JobKeys
from shoal.events.records import WorkerRecord
from shoal.events.states import PLANNED, WorkerState

KINDS = ("worker_kill", "worker_segv", "worker_stop", "worker_slow", "coordinator_kill", "coordinator_stop",
         "redis_failover", "worker_join")
WORKER_FAULTS = ("worker_kill", "worker_segv", "worker_stop", "worker_slow")
#: the worker faults a ``coordinator_stop`` may carry inside its stall
IN_STALL = ("worker_kill", "worker_segv", "worker_stop")
#: how long a ``coordinator_stop`` holds the leader stopped (seconds, uniform)
STALL_S = (0.5, 3.0)
#: the workers' fault rule behind ``worker_slow``: the soak sets it for every worker, with S
#: past the heartbeat TTL (see :func:`slow_step_rule`)
SLOW_STEP_RULE = "*@usr1:mid_step:sleep={seconds:g}"


def next_kind(cycle: list[str], kinds: tuple[str, ...], allowed, rng) -> str | None:
    """The next fault kind of a seeded, shuffled cycle over ``kinds``: the first of ``cycle``
    that ``allowed(kind)`` permits now, removed from it (None: none can happen now). When the
    cycle is used up, or only kinds that cannot happen now remain (a join while max_workers
    are planned), the next shuffled cycle is appended and the leftovers stay queued: the faults
    never stall, and each kind still comes about as often as the others."""
    kind = next((k for k in cycle if allowed(k)), None)
    if kind is None and len(cycle) < len(kinds):
        fresh = list(kinds)
        rng.shuffle(fresh)
        cycle += fresh
        kind = next((k for k in cycle if allowed(k)), None)
    if kind is not None:
        cycle.remove(kind)
    return kind


def slow_step_seconds(ttl: float) -> float:
    """How long a ``worker_slow`` stall lasts in a job with heartbeat TTL ``ttl``: past the TTL
    and past the 3 s collective timeout workers had before the step timeout (the stall that
    used to end every worker), far within the default step timeout."""
    return max(3.0, ttl + 1.0) + 1.0


def slow_step_rule(ttl: float) -> str:
    """The workers' fault rule behind ``worker_slow`` for a job with heartbeat TTL ``ttl``."""
    return SLOW_STEP_RULE.format(seconds=slow_step_seconds(ttl))


@dataclass
class Injected:
    kind: str
    t: float  #: time.time() when injected
    target: str
    generation: int  #: the job's generation when injected (-1 when unknown)
    worker: str | None = None  #: the worker id a worker fault hit
    #: time.time() when a fault held for a while (a network fault) was healed; 0: none held
    healed: float = 0.0
    #: the hosts a network fault touched
    nodes: tuple[str, ...] = ()
    #: more worker ids the fault may have cost their membership (a network fault: the workers
    #: on the hosts it cut off)
    hits: tuple[str, ...] = ()


@dataclass
class Injector:
    """Performs faults on the soak's processes. ``fail_over``/``new_coordinator``/``new_worker``
    are callbacks of the soak (it owns the processes); ``fail_over`` returns what it did."""

    client: redis.Redis
    keys: JobKeys
    ttl: float
    max_workers: int
    coordinators: dict  #: replica name -> Proc, kept current by the soak
    fail_over: callable
    new_coordinator: callable
    new_worker: callable
    #: elastic HSDP's replica group size (1: data parallelism)
    shard_size: int = 1
    done: list[Injected] = field(default_factory=list)
    _frozen: set[int] = field(default_factory=set)
    _thaws: list = field(default_factory=list)

    def workers(self) -> dict[str, WorkerRecord]:
        return {k.decode(): WorkerRecord.from_json(v) for k, v in self.client.hgetall(self.keys.workers).items()}

    def generation(self) -> int:
        raw = self.client.hget(self.keys.state, "generation")
        return int(raw) if raw else 0

    def worker_fault_allowed(self) -> bool:
        active = [w for w in self.workers().values() if w.state == WorkerState.ACTIVE and w.pid not in self._frozen]
        if self.shard_size > 1:  # a whole replica group must stay: two whole groups Active
            groups: dict[str, int] = {}
            for w in active:
                groups[w.replica_group] = groups.get(w.replica_group, 0) + 1
            if sum(1 for n in groups.values() if n == self.shard_size) < 2:
                return False
        if len(active) < 2:
            return False
        last = next((f for f in reversed(self.done) if f.kind in WORKER_FAULTS), None)
        if last is not None and last.kind == "worker_slow":  # waited for: over once its stall is
            return time.time() > last.healed + 1.0
        # recovered: the generation moved past the one the last worker fault hit
        return last is None or self.generation() > last.generation

    def allowed(self, kind: str) -> bool:
        if kind in WORKER_FAULTS:
            # after a fail-over the coordinator needs a moment back: a SIGSTOP held only TTL + 1 s
            # could end before anyone can declare the worker failed (seen: never detected, and
            # every later worker fault waited for a generation that never came)
            last = next((f for f in reversed(self.done) if f.kind == "redis_failover"), None)
            if last is not None and time.time() < last.t + 3 * self.ttl:
                return False
            return self.worker_fault_allowed()
        if kind == "worker_join":
            planned = [w for w in self.workers().values() if w.state in PLANNED]
            return len(planned) + self.shard_size <= self.max_workers
        if kind in ("coordinator_kill", "coordinator_stop"):
            leader = self._leader()
            return leader is not None and leader.pid not in self._frozen
        return True

    def _leader(self):
        token = self.client.get(self.keys.lease)
        if not token:
            return None
        name = token.decode().split(":", 1)[0]
        return self.coordinators.get(name)

    def inject(self, kind: str, rng) -> Injected:
        gen = self.generation()
        wid = None
        hits: tuple[str, ...] = ()
        if kind in WORKER_FAULTS:
            wid, target, hits = self._worker_fault(kind, rng)
        elif kind == "coordinator_stop":
            return self._stall(rng, gen)
        elif kind == "coordinator_kill":
            proc = self._leader()
            target = proc.name
            proc.signal(signal.SIGKILL)
            proc.wait(10)
            self.coordinators.pop(proc.name, None)
            self.new_coordinator()
        elif kind == "redis_failover":
            target = self.fail_over()
            gen = -1
        else:
            target = ", ".join(self.new_worker().name for _ in range(self.shard_size))
        fault = Injected(kind, time.time(), target, gen, wid, hits=hits)
        if kind == "worker_slow":  # held: the stall starts at the worker's next step
            fault.healed = fault.t + slow_step_seconds(self.ttl)
        self.done.append(fault)
        return fault

    def _worker_fault(self, kind: str, rng) -> tuple[str, str, tuple[str, ...]]:
        """Signal an Active worker; (its id, the target for the table, the other members of its
        replica group, which the fault takes out with it)."""
        records = self.workers()
        candidates = sorted((wid, w.pid) for wid, w in records.items()
                            if w.state == WorkerState.ACTIVE and w.pid not in self._frozen)
        wid, pid = candidates[rng.randrange(len(candidates))]
        group = records[wid].replica_group
        hits = tuple(sorted(w for w, r in records.items() if group and r.replica_group == group and w != wid))
        if kind == "worker_kill":
            os.kill(pid, signal.SIGKILL)
        elif kind == "worker_segv":
            os.kill(pid, signal.SIGSEGV)
        elif kind == "worker_slow":
            os.kill(pid, signal.SIGUSR1)
            hits = ()  # a slow step ends nobody
        else:
            self._freeze(pid, self.ttl + 1.0)
        return wid, f"{wid} (pid {pid})", hits

    def _freeze(self, pid: int, seconds: float) -> None:
        os.kill(pid, signal.SIGSTOP)
        self._frozen.add(pid)
        thaw = threading.Timer(seconds, self._thaw, args=(pid,))
        thaw.start()
        self._thaws.append(thaw)

    def _stall(self, rng, gen: int) -> Injected:
        """``coordinator_stop``: the leader stopped for a while, and a worker fault inside the
        stall when one is allowed (recorded as a fault of its own, just after this one)."""
        proc = self._leader()
        hold = rng.uniform(*STALL_S)
        inner = rng.choice(IN_STALL) if self.worker_fault_allowed() else None
        self._freeze(proc.pid, hold)
        t = time.time()
        fault = Injected("coordinator_stop", t, f"{proc.name} stopped {hold:.1f} s", gen, healed=t + hold)
        self.done.append(fault)
        if inner is not None:
            time.sleep(rng.uniform(0.1, min(0.5, hold / 2)))  # inside the stall: nothing to await
            wid, target, hits = self._worker_fault(inner, rng)
            self.done.append(Injected(inner, time.time(), f"{target} (inside the stall)", gen, wid, hits=hits))
            fault.target += f"; {inner} of {target} inside it"
        return fault
    def _thaw(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        self._frozen.discard(pid)

    def let_stops_finish(self) -> None:
        """Wait for every SIGSTOP to be held its full time: one cut short at the end of the
        window would wake the worker before it was declared failed, so it never is."""
        for thaw in self._thaws:
            thaw.join(self.ttl + 5.0)

    def thaw_all(self) -> None:
        for pid in list(self._frozen):
            self._thaw(pid)
