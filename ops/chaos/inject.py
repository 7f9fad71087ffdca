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
- ``redis_failover``: SIGKILL the Redis primary (the soak's Redis is a Sentinel set: a
  primary, 2 replicas, 3 sentinels); once the sentinels promoted a replica, the killed node
  comes back as a replica of the new primary, so the set stays whole for the next one. (A
  single server restarted from its AOF, or empty, has its own tests: test_redis_loss.py);
- ``worker_join``: start one more worker process outside the agent (up to ``max_workers``).

Worker faults need two Active workers and the previous worker fault recovered: losing every
replica at once can only resume from a checkpoint, which re-commits the steps after it, and
the soak proves the elastic path, not the restart path (that one has its own test).
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

KINDS = ("worker_kill", "worker_segv", "worker_stop", "worker_slow", "coordinator_kill", "redis_failover", "worker_join")
WORKER_FAULTS = ("worker_kill", "worker_segv", "worker_stop", "worker_slow")
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
            return len(planned) < self.max_workers
        if kind == "coordinator_kill":
            return self._leader() is not None
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
        if kind in WORKER_FAULTS:
            candidates = sorted((wid, w.pid) for wid, w in self.workers().items()
                                if w.state == WorkerState.ACTIVE and w.pid not in self._frozen)
            wid, pid = candidates[rng.randrange(len(candidates))]
            target = f"{wid} (pid {pid})"
            if kind == "worker_kill":
                os.kill(pid, signal.SIGKILL)
            elif kind == "worker_segv":
                os.kill(pid, signal.SIGSEGV)
            elif kind == "worker_slow":
                os.kill(pid, signal.SIGUSR1)
            else:
                os.kill(pid, signal.SIGSTOP)
                self._frozen.add(pid)
                thaw = threading.Timer(self.ttl + 1.0, self._thaw, args=(pid,))
                thaw.start()
                self._thaws.append(thaw)
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
            target = self.new_worker().name
        fault = Injected(kind, time.time(), target, gen, wid)
        if kind == "worker_slow":  # held: the stall starts at the worker's next step
            fault.healed = fault.t + slow_step_seconds(self.ttl)
        self.done.append(fault)
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
