"""The local soak's injector: the primitives its fault kinds use on real processes, and what
it observes to decide whether a kind is allowed now.

The kinds themselves (what each does, when it is allowed, how long it is held, what recovery
it expects) are entries of :data:`shoal.ops.chaos.kinds.REGISTRY` for :attr:`Soak.LOCAL`;
:meth:`Injector.allowed` and :meth:`Injector.inject` look the entry up and call it.

Worker faults need two Active workers (elastic HSDP: two whole replica groups Active) and the
previous worker fault recovered: losing every replica at once can only resume from a
checkpoint, which re-commits the steps after it, and the soak proves the elastic path, not the
restart path (that one has its own test). In elastic HSDP a worker fault takes its whole
replica group out: the fault's ``hits`` name the group's other members.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import redis

from shoal.events.keys import JobKeys
from shoal.events.records import WorkerRecord
from shoal.events.states import WorkerState
from shoal.ops.chaos.kinds import Injected, Soak, get


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

    # ---- what it observes ----------------------------------------------------------------

    def workers(self) -> dict[str, WorkerRecord]:
        return {k.decode(): WorkerRecord.from_json(v) for k, v in self.client.hgetall(self.keys.workers).items()}

    def generation(self) -> int:
        raw = self.client.hget(self.keys.state, "generation")
        return int(raw) if raw else 0

    def leader(self):
        """The coordinator process holding the job's lease (None: none holds it, or not one of ours)."""
        token = self.client.get(self.keys.lease)
        if not token:
            return None
        name = token.decode().split(":", 1)[0]
        return self.coordinators.get(name)

    def is_frozen(self, pid: int) -> bool:
        return pid in self._frozen

    def worker_fault_allowed(self) -> bool:
        """Two Active workers stay (elastic HSDP: two whole replica groups), and the last worker
        fault recovered: for one recovered in its own generation, its hold is over (a second to
        spare); otherwise the generation moved past the one it hit."""
        active = [w for w in self.workers().values() if w.state == WorkerState.ACTIVE and w.pid not in self._frozen]
        if self.shard_size > 1:  # a whole replica group must stay: two whole groups Active
            groups: dict[str, int] = {}
            for w in active:
                groups[w.replica_group] = groups.get(w.replica_group, 0) + 1
            if sum(1 for n in groups.values() if n == self.shard_size) < 2:
                return False
        if len(active) < 2:
            return False
        last = next((f for f in reversed(self.done) if get(Soak.LOCAL, f.kind).worker_fault), None)
        if last is None:
            return True
        if not get(Soak.LOCAL, last.kind).recovery.newer_generation:  # waited for: over once its hold is
            return time.time() > last.healed + 1.0
        return self.generation() > last.generation

    def settled(self) -> bool:
        """No fault asks worker faults to wait now (``settle_ttls`` heartbeat TTLs after it)."""
        now = time.time()
        return not any(now < f.t + get(Soak.LOCAL, f.kind).settle_ttls * self.ttl
                       for f in self.done if get(Soak.LOCAL, f.kind).settle_ttls)

    # ---- the registry's entry point ------------------------------------------------------

    def allowed(self, kind: str) -> bool:
        return get(Soak.LOCAL, kind).allowed(self)

    def inject(self, kind: str, rng: random.Random, *, generation: int | None = None) -> Injected:
        """Inject ``kind`` now and record it (``generation``: the one it hits, when a fault it
        is carried inside read it already)."""
        entry = get(Soak.LOCAL, kind)
        gen = self.generation() if generation is None else generation
        hold = entry.hold.seconds(rng, self.ttl, None)
        hit = entry.inject(self, rng, hold)
        fault = Injected(kind, time.time(), hit.target, gen, hit.worker, hits=hit.hits, hold=hold)
        if hold:  # a local fault held heals itself: a thaw timer, the worker's own stall
            fault.healed = fault.t + hold
        self.done.append(fault)
        if hit.then is not None:
            hit.then(fault)
        return fault

    # ---- primitives the kinds use --------------------------------------------------------

    def pick_worker(self, rng: random.Random) -> tuple[str, int, tuple[str, ...]]:
        """An Active worker, drawn: (its id, its pid, the other members of its replica group,
        which a fault that ends it takes out with it)."""
        records = self.workers()
        candidates = sorted((wid, w.pid) for wid, w in records.items()
                            if w.state == WorkerState.ACTIVE and w.pid not in self._frozen)
        wid, pid = candidates[rng.randrange(len(candidates))]
        group = records[wid].replica_group
        hits = tuple(sorted(w for w, r in records.items() if group and r.replica_group == group and w != wid))
        return wid, pid, hits

    def freeze(self, pid: int, seconds: float) -> None:
        """SIGSTOP ``pid``, SIGCONT in ``seconds`` (a timer; :meth:`let_stops_finish` awaits it)."""
        os.kill(pid, signal.SIGSTOP)
        self._frozen.add(pid)
        thaw = threading.Timer(seconds, self._thaw, args=(pid,))
        thaw.start()
        self._thaws.append(thaw)

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
