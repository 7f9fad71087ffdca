"""The chaos soaks' fault kinds, as data: one registry that both soaks and the verdict read.

Each :class:`Kind` in :data:`REGISTRY` says, for one kind of fault:

- ``name``, and ``soaks``: the soak(s) that inject it (:class:`Soak`: ``shoal chaos`` is LOCAL,
  ``--network`` is NETWORK, ``--network --ha`` is HA; an HA soak injects every NETWORK kind
  too). A name may have one entry per soak when the soaks do different things under it
  (``coordinator_stop``);
- ``allowed``: a predicate over the soak's observed state (its injector:
  :class:`~shoal.ops.chaos.inject.Injector` locally,
  :class:`~shoal.ops.chaos.network.NetInjector` across namespaces), asked before the kind is
  drawn from the cycle;
- ``inject``: what it does, ``inject(injector, rng, hold) -> Hit``, with the injector's
  primitives (signal a worker, freeze a process, cut two hosts apart...);
- ``hold``: how long it lasts (:data:`NOT_HELD`, :class:`Fixed` on the heartbeat TTL,
  :class:`Uniform` in its own range, :class:`SoakRange`: the soak's ``--min-hold``..
  ``--max-hold``, optionally capped). Locally a held fault heals itself (a thaw timer, the
  worker's own stall); the network soak heals it after the hold;
- ``recovery``: what the verdict counts as survived (:class:`Recovery`: a commit after it in
  a newer generation, or in any; counted from the fault or from its heal), and ``timed``:
  whether that time goes into the table's recovery figure;
- for the local soak's worker faults: ``worker_fault`` (needs two Active workers, and the
  previous worker fault recovered), ``may_fail_worker`` (the worker it hits may be declared
  failed for it: "no failure without a fault"), ``settle_ttls`` (worker faults wait that many
  heartbeat TTLs after it), ``worker_rule`` (the workers' ``SHOAL_FAULTS`` rule it needs);
- ``disabled``: a reason, for a kind kept in the registry but drawn by no soak.

The injectors (``inject.py``, ``network.py``) and the verdict (``verdict.py``) hold no case
per kind: they look the entry up and call it.

How to add a fault kind
-----------------------
1. **One entry** in :data:`REGISTRY` below, in the place its soak's table should list it:
   its name, its soak(s), a ``does`` line, an ``allowed`` predicate and an ``inject``
   function (reuse one of the small functions here, or write one next to them that uses the
   injector's primitives; a primitive the injector lacks is a method of ``Injector`` or
   ``NetInjector``), and its ``hold``, ``recovery`` and ``timed``. Nothing else changes: the
   soak draws it in its shuffled cycle, prints it, the verdict counts it (a row of the
   table, a key of ``summary.json``) and judges its recovery as declared.
2. **One test** of what it does, through its soak's injector on real parts: a local kind in
   ``tests/processes/test_chaos.py`` (fixture ``local_injector``: ``sleep`` processes on
   record as Active workers and a leading coordinator, in the session's Redis; inject it and
   assert what happened to the processes and what was recorded, as
   ``test_worker_segv_crashes_one_active_worker_natively`` does), a network kind in
   ``tests/multihost/test_chaos_network.py`` (the ``net`` fixture's namespaces and a
   ``NetInjector``, as ``test_node_link_down_...`` does). The registry's own checks
   (``tests/unit/test_chaos_kinds.py``: every kind drawn by a soak or disabled, its declared
   recovery the one the verdict applies, its table row) and the 60 s soaks (every kind of the
   soak comes up and is survived) pick it up by themselves; check that the soak's 60 s window
   still fits a whole cycle (the network test's gaps are sized for its nine kinds).
"""

from __future__ import annotations

import enum
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from shoal.events.states import PLANNED, WorkerState


class Soak(enum.Enum):
    """A soak that injects faults; its value names it."""

    LOCAL = "local"  #: ``shoal chaos``: real processes on this machine
    NETWORK = "network"  #: ``shoal chaos --network``: hosts in network namespaces
    HA = "network+HA"  #: ``shoal chaos --network --ha``: the same, Redis under Sentinel

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds this soak draws (none disabled), in the order of its table."""
        return tuple(k.name for k in of(self))

    @property
    def recovery_figure(self) -> str:
        """What the table's recovery figure measures in this soak."""
        return RECOVERY_FIGURE[self]


RECOVERY_FIGURE = {Soak.LOCAL: "fault -> first committed step after it in a newer generation",
                   Soak.NETWORK: "heal -> first committed step after it",
                   Soak.HA: "heal -> first committed step after it"}


# ---- what one fault left behind ------------------------------------------------------------


@dataclass
class Injected:
    """One fault, as injected (what the soak prints and the verdict judges)."""

    kind: str
    t: float  #: time.time() when injected
    target: str
    generation: int  #: the job's generation when injected (-1 when unknown: any generation recovers it)
    worker: str | None = None  #: the worker id a worker fault hit
    #: time.time() when a fault held for a while was healed (or heals itself); 0: none held
    healed: float = 0.0
    #: the hosts a network fault touched
    nodes: tuple[str, ...] = ()
    #: more worker ids the fault may have cost their membership (a network fault: the workers
    #: on the hosts it cut off; elastic HSDP: the other members of the replica group it hit)
    hits: tuple[str, ...] = ()
    #: seconds it is held (its kind's :class:`Hold`); 0: not held
    hold: float = 0.0


@dataclass
class Hit:
    """What a kind's ``inject`` did: the target as printed, and who it touched. ``then`` runs
    once the fault is recorded (a fault it carries inside it is recorded after it)."""

    target: str
    worker: str | None = None
    hits: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    then: Callable[[Injected], None] | None = None


# ---- how long a fault is held --------------------------------------------------------------


class Hold(Protocol):
    def seconds(self, rng: random.Random, ttl: float, soak_range: tuple[float, float] | None) -> float:
        """How long to hold it this time (0: not held); ``soak_range``: the soak's
        (``--min-hold``, ``--max-hold``), None where the soak has none."""


@dataclass(frozen=True)
class NotHeld:
    def seconds(self, rng, ttl, soak_range) -> float:
        return 0.0


NOT_HELD = NotHeld()


@dataclass(frozen=True)
class Fixed:
    """Held a time set by the job's heartbeat TTL (no draw)."""

    of_ttl: Callable[[float], float]

    def seconds(self, rng, ttl, soak_range) -> float:
        return self.of_ttl(ttl)


@dataclass(frozen=True)
class Uniform:
    """Held ``lo``..``hi`` seconds, drawn uniformly (the kind's own range)."""

    lo: float
    hi: float

    def seconds(self, rng, ttl, soak_range) -> float:
        return rng.uniform(self.lo, self.hi)


@dataclass(frozen=True)
class SoakRange:
    """Held the soak's ``--min-hold``..``--max-hold``, drawn uniformly; at most ``cap``."""

    cap: float | None = None

    def seconds(self, rng, ttl, soak_range) -> float:
        if soak_range is None:
            raise ValueError("a fault held for the soak's hold range, in a soak that has none")
        hold = rng.uniform(*soak_range)
        return hold if self.cap is None else min(hold, self.cap)


# ---- what recovery is expected -------------------------------------------------------------


@dataclass(frozen=True)
class Recovery:
    """Survived = a step committed after the fault (after its heal when ``after_heal``), in a
    generation newer than the one it hit when ``newer_generation`` (a member was lost), in any
    generation otherwise (the same members go on). A fault whose generation is unknown (-1)
    is recovered in any generation."""

    newer_generation: bool
    after_heal: bool

    def survived_by(self, fault: Injected, t: float, generation: int) -> bool:
        """Whether a step committed at ``t`` in ``generation`` shows that ``fault`` was survived."""
        if t <= self.since(fault):
            return False
        return fault.generation < 0 or not self.newer_generation or generation > fault.generation

    def since(self, fault: Injected) -> float:
        """From when its recovery time counts."""
        return max(fault.t, fault.healed) if self.after_heal else fault.t


#: a member is lost: a commit in a newer generation, counted from the fault
NEW_GENERATION = Recovery(newer_generation=True, after_heal=False)
#: nobody need leave: a commit in any generation, counted from the fault
ANY_GENERATION = Recovery(newer_generation=False, after_heal=False)
#: held: a commit in any generation after the heal
AFTER_HEAL = Recovery(newer_generation=False, after_heal=True)
#: a kind the registry does not know (a record from an older soak): what the verdict always did
UNKNOWN = Recovery(newer_generation=True, after_heal=True)


# ---- the entry -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    name: str
    soaks: frozenset[Soak]
    does: str  #: what it does, for people
    allowed: Callable[[Any], bool]  #: over the soak's injector
    inject: Callable[[Any, random.Random, float], Hit]  #: (injector, rng, hold seconds)
    hold: Hold = NOT_HELD
    recovery: Recovery = NEW_GENERATION
    timed: bool = False  #: its recovery time goes into the table's figure
    worker_fault: bool = False  #: hits one Active worker (local): two Active, the last one recovered
    may_fail_worker: bool = True  #: the worker it hits may be declared failed for it
    settle_ttls: float = 0.0  #: worker faults wait this many heartbeat TTLs after it
    worker_rule: Callable[[float], str] | None = None  #: the workers' SHOAL_FAULTS rule it needs, by TTL
    disabled: str = ""  #: why no soak draws it ("": drawn by its soaks)


def of(soak: Soak) -> tuple[Kind, ...]:
    """The entries ``soak`` draws, in registry order."""
    return tuple(k for k in REGISTRY if soak in k.soaks and not k.disabled)


def find(soak: Soak, name: str) -> Kind | None:
    """The entry of ``name`` in ``soak`` (disabled or not); None: the registry does not know it there."""
    return next((k for k in REGISTRY if k.name == name and soak in k.soaks), None)


def get(soak: Soak, name: str) -> Kind:
    """:func:`find`, for a kind the soak is about to inject (KeyError: not one of its kinds)."""
    kind = find(soak, name)
    if kind is None:
        raise KeyError(f"no fault kind {name!r} in the {soak.value} soak")
    return kind


def worker_rules(soak: Soak, ttl: float) -> str:
    """The workers' ``SHOAL_FAULTS`` rules the kinds of ``soak`` need ("" for none)."""
    return ",".join(k.worker_rule(ttl) for k in of(soak) if k.worker_rule is not None)


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


# ---- the local soak: predicates and injections over its Injector ---------------------------

#: how long a ``coordinator_stop`` holds the leader stopped in the local soak (s, uniform)
STALL_S = (0.5, 3.0)
#: the workers' fault rule behind ``worker_slow``: the soak sets it for every worker, with S
#: past the heartbeat TTL (see :func:`slow_step_rule`)
SLOW_STEP_RULE = "*@usr1:mid_step:sleep={seconds:g}"


def slow_step_seconds(ttl: float) -> float:
    """How long a ``worker_slow`` stall lasts in a job with heartbeat TTL ``ttl``: past the TTL
    and past the 3 s collective timeout workers had before the step timeout (the stall that
    used to end every worker), far within the default step timeout."""
    return max(3.0, ttl + 1.0) + 1.0


def slow_step_rule(ttl: float) -> str:
    """The workers' fault rule behind ``worker_slow`` for a job with heartbeat TTL ``ttl``."""
    return SLOW_STEP_RULE.format(seconds=slow_step_seconds(ttl))


def past_ttl(ttl: float) -> float:
    """A ``worker_stop``'s freeze: long enough to be declared failed (TTL + 1 s)."""
    return ttl + 1.0


def _worker_fault_allowed(inj) -> bool:
    # after a fail-over the coordinator needs a moment back: a SIGSTOP held only TTL + 1 s
    # could end before anyone can declare the worker failed (seen: never detected, and
    # every later worker fault waited for a generation that never came)
    return inj.settled() and inj.worker_fault_allowed()


def _join_allowed(inj) -> bool:
    planned = [w for w in inj.workers().values() if w.state in PLANNED]
    return len(planned) + inj.shard_size <= inj.max_workers


def _leader_running(inj) -> bool:
    leader = inj.leader()
    return leader is not None and not inj.is_frozen(leader.pid)


def _always(inj) -> bool:
    return True


def _signal_worker(sig: int, takes_group: bool = True):
    """Inject: ``sig`` to an Active worker (``takes_group``: its replica group goes with it)."""
    def inject(inj, rng, hold) -> Hit:
        wid, pid, group = inj.pick_worker(rng)
        os.kill(pid, sig)
        return Hit(f"{wid} (pid {pid})", worker=wid, hits=group if takes_group else ())
    return inject


def _freeze_worker(inj, rng, hold) -> Hit:
    wid, pid, group = inj.pick_worker(rng)
    inj.freeze(pid, hold)
    return Hit(f"{wid} (pid {pid})", worker=wid, hits=group)


def _kill_leader(inj, rng, hold) -> Hit:
    proc = inj.leader()
    proc.signal(signal.SIGKILL)
    proc.wait(10)
    inj.coordinators.pop(proc.name, None)
    inj.new_coordinator()
    return Hit(proc.name)


def carried(soak: Soak) -> tuple[str, ...]:
    """The worker faults a ``coordinator_stop`` may carry inside its stall: those that take a
    worker out (a slow step does not: nothing would fail before the table)."""
    return tuple(k.name for k in of(soak) if k.worker_fault and k.may_fail_worker)


def _stall_leader(inj, rng, hold) -> Hit:
    """The leader stopped for the hold, and a worker fault inside the stall when one is
    allowed (recorded as a fault of its own, just after this one)."""
    proc = inj.leader()
    inner = rng.choice(carried(Soak.LOCAL)) if inj.worker_fault_allowed() else None
    inj.freeze(proc.pid, hold)

    def inside(fault: Injected) -> None:
        time.sleep(rng.uniform(0.1, min(0.5, hold / 2)))  # inside the stall: nothing to await
        worker = inj.inject(inner, rng, generation=fault.generation)
        target = worker.target
        worker.target = f"{target} (inside the stall)"
        fault.target += f"; {inner} of {target} inside it"

    return Hit(f"{proc.name} stopped {hold:.1f} s", then=inside if inner is not None else None)


def _fail_over(inj, rng, hold) -> Hit:
    return Hit(inj.fail_over())


def _join(inj, rng, hold) -> Hit:
    return Hit(", ".join(inj.new_worker().name for _ in range(inj.shard_size)))


# ---- the network soak: predicates and injections over its NetInjector ----------------------

#: the longest a network ``coordinator_stop`` holds the leader stopped (s): a stall, not an outage
STALL_MAX_S = 3.0
DELAY_MS = 20.0
LOSS_PERCENT = 5


def _spares_a_node(inj) -> bool:
    return bool(inj.node_picks())


def _spares_a_pair(ordered: bool):
    def allowed(inj) -> bool:
        return bool(inj.pair_picks(ordered))
    return allowed


def _primary_known(inj) -> bool:
    return inj.redis_host is not None or inj.net.ha_primary() is not None  # else: a fail-over under way


def _primary_known_and_spares_a_node(inj) -> bool:
    return _primary_known(inj) and _spares_a_node(inj)


def _leader_known(inj) -> bool:
    return inj.leader() is not None


def _leader_stoppable(inj) -> bool:
    leader = inj.leader()
    return leader is not None and leader.name in inj.coordinator_procs and _spares_a_node(inj)


def _partition(oneway: bool):
    def inject(inj, rng, hold) -> Hit:
        a, b = rng.choice(inj.pair_picks(oneway))
        inj.net.partition(a, b, oneway=oneway)
        return Hit(f"{a.name} {'->' if oneway else '<->'} {b.name} cut", nodes=(a.name, b.name))
    return inject


def _node_fault(act: Callable[[Any, Any], str]):
    """Inject ``act(injector, node) -> target`` on a worker node that spares an Active worker."""
    def inject(inj, rng, hold) -> Hit:
        node = rng.choice(inj.node_picks())
        return Hit(act(inj, node), nodes=(node.name,))
    return inject


def _cut_from_redis(inj, node) -> str:
    redis_host = inj.redis()
    inj.net.partition(node, redis_host)
    return f"{node.name} <-> redis ({redis_host.name}) cut"


def _delay(inj, node) -> str:
    inj.net.delay(node, DELAY_MS)
    return f"{node.name} +{DELAY_MS:g} ms each way"


def _lose_frames(inj, node) -> str:
    inj.net.loss(node, LOSS_PERCENT)
    return f"{node.name} {LOSS_PERCENT} % of frames dropped"


def _link_down(inj, node) -> str:
    inj.net.link_down(node)
    return f"{node.name} link down"


def _blackhole_redis(inj, rng, hold) -> Hit:
    redis_host = inj.redis()
    inj.net.loss(redis_host, 100)
    return Hit(f"redis ({redis_host.name}): every frame to and from it dropped", nodes=tuple(n.name for n in inj.nodes))


def _cut_leader_from_redis(inj, rng, hold) -> Hit:
    leader, redis_host = inj.leader(), inj.redis()
    inj.net.partition(leader, redis_host)
    return Hit(f"{leader.name} <-> redis ({redis_host.name}) cut (the leader)")


def _stop_leader_kill_inside(inj, rng, hold) -> Hit:
    leader = inj.leader()
    node = rng.choice(inj.node_picks())
    victims = sorted((wid, rec.pid) for wid, rec in inj.observe().items()
                     if rec.node == node.name and rec.state == WorkerState.ACTIVE)
    inj.stop_coordinator(leader.name)  # SIGCONT at the heal
    target = f"{leader.name} stopped"
    if victims:
        time.sleep(rng.uniform(0.1, 0.5))  # inside the stall: nothing to await
        wid, pid = rng.choice(victims)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        target += f"; {wid} (pid {pid}) on {node.name} killed inside the stall"
    return Hit(target, nodes=(node.name,))


def _isolate_primary(inj, rng, hold) -> Hit:
    redis_host = inj.redis()
    node = rng.choice(inj.node_picks())
    coordinator = inj.coordinators[rng.choice(sorted(inj.coordinators))]
    inj.net.isolate([redis_host, coordinator, node])
    return Hit(f"{redis_host.name} (the primary), {coordinator.name} and {node.name} cut off from the rest",
               nodes=tuple(n.name for n in inj.nodes))  # all lose the primary: the others until the promotion


# ---- the registry --------------------------------------------------------------------------

_LOCAL = frozenset({Soak.LOCAL})
_NET = frozenset({Soak.NETWORK, Soak.HA})
_HA = frozenset({Soak.HA})

#: Every fault kind. Each soak's table lists its kinds in this order.
REGISTRY: tuple[Kind, ...] = (
    # ---- shoal chaos: real signals into real processes -----------------------------------
    Kind("worker_kill", _LOCAL, "SIGKILL an Active worker (its agent starts a replacement)",
         _worker_fault_allowed, _signal_worker(signal.SIGKILL),
         recovery=NEW_GENERATION, timed=True, worker_fault=True),
    Kind("worker_segv", _LOCAL, "SIGSEGV an Active worker (an abrupt native crash, no Python cleanup)",
         _worker_fault_allowed, _signal_worker(signal.SIGSEGV),
         recovery=NEW_GENERATION, timed=True, worker_fault=True),
    Kind("worker_stop", _LOCAL,
         "SIGSTOP an Active worker for longer than the heartbeat TTL, then SIGCONT (it is declared failed while "
         "frozen, finds itself evicted when it wakes, and exits)",
         _worker_fault_allowed, _freeze_worker, hold=Fixed(past_ttl),
         # the survivors go on in a newer generation while it is still frozen: counted from the fault
         recovery=NEW_GENERATION, timed=True, worker_fault=True),
    Kind("worker_slow", _LOCAL,
         "SIGUSR1 to an Active worker, whose fault rule *@usr1:mid_step:sleep=S stalls its next step past the "
         "heartbeat TTL (and past the 3 s collective timeout shoal had before its step timeout) while its "
         "heartbeats go on: a slow peer, not a dead one. Its peers wait for it in their all-reduce; nobody is "
         "declared failed or exits, and the same generation goes on once the stall is over",
         _worker_fault_allowed, _signal_worker(signal.SIGUSR1, takes_group=False), hold=Fixed(slow_step_seconds),
         recovery=AFTER_HEAL, timed=True, worker_fault=True, may_fail_worker=False, worker_rule=slow_step_rule),
    Kind("coordinator_kill", _LOCAL,
         "SIGKILL the replica holding the job's lease (a new replica is started at once, so two always run; the "
         "standby takes over)",
         _leader_running, _kill_leader, recovery=ANY_GENERATION),
    Kind("coordinator_stop", _LOCAL,
         "SIGSTOP the replica holding the job's lease for 0.5-3 s (a busy node stalls a process that long), and - "
         "when a worker fault is allowed - a worker fault that takes its worker out (worker_kill, worker_segv or "
         "worker_stop, counted as its own fault) inside the stall: the survivors' step fails before any table "
         "says why, and the table comes only when the coordinator is back (or the standby took the lease over). "
         "The case that wedged elastic HSDP for good at 5e93599 (issue 34)",
         _leader_running, _stall_leader, hold=Uniform(*STALL_S), recovery=AFTER_HEAL),
    Kind("redis_failover", _LOCAL,
         "SIGKILL the Redis primary (the soak's Redis is a Sentinel set: a primary, 2 replicas, 3 sentinels); "
         "once the sentinels promoted a replica, the killed node comes back as a replica of the new primary, so "
         "the set stays whole for the next one",
         _always, _fail_over, recovery=ANY_GENERATION, settle_ttls=3.0),
    Kind("worker_join", _LOCAL,
         "start one more worker process outside the agent (up to max_workers; elastic HSDP: a whole replica "
         "group, shard_size processes)",
         _join_allowed, _join, recovery=ANY_GENERATION),
    # ---- shoal chaos --network: nftables rules, a delay line, signals, across namespaces ---
    Kind("peer_partition", _NET, "two worker nodes cannot reach each other (both ways), Redis still can",
         _spares_a_pair(False), _partition(False), hold=SoakRange(), recovery=AFTER_HEAL, timed=True),
    Kind("oneway_partition", _NET, "one worker node's frames to another vanish, the other way works",
         _spares_a_pair(True), _partition(True), hold=SoakRange(), recovery=AFTER_HEAL, timed=True),
    Kind("node_redis_cut", _NET,
         "one worker node and Redis cannot reach each other (a blackhole: frames vanish, nothing is refused; the "
         "node's peers still reach it)",
         _primary_known_and_spares_a_node, _node_fault(_cut_from_redis), hold=SoakRange(), recovery=AFTER_HEAL,
         timed=True),
    Kind("redis_blackhole", _NET, "every frame to and from Redis is dropped, for everyone",
         _primary_known, _blackhole_redis, hold=SoakRange(), recovery=AFTER_HEAL, timed=True),
    Kind("node_delay_20ms", _NET, f"every frame to and from one worker node is held {DELAY_MS:g} ms",
         _spares_a_node, _node_fault(_delay), hold=SoakRange(), recovery=AFTER_HEAL, timed=True),
    Kind("node_loss_5pct", _NET, f"{LOSS_PERCENT} % of the frames to and from one worker node are dropped at random",
         _spares_a_node, _node_fault(_lose_frames), hold=SoakRange(), recovery=AFTER_HEAL, timed=True),
    Kind("node_link_down", _NET, "one worker node's switch port goes down (the cable is pulled)",
         _spares_a_node, _node_fault(_link_down), hold=SoakRange(), recovery=AFTER_HEAL, timed=True),
    Kind("leader_redis_cut", _NET,
         "the coordinator replica holding the job's lease and Redis cannot reach each other (the standby must "
         "take over)",
         lambda inj: _primary_known(inj) and _leader_known(inj), _cut_leader_from_redis, hold=SoakRange(), recovery=AFTER_HEAL, timed=True),
    Kind("coordinator_stop", _NET,
         f"the coordinator replica holding the job's lease is SIGSTOPped for the hold (at most {STALL_MAX_S:g} s: "
         "a stall, not an outage), and an Active worker on a node the fault names is kill -9ed inside the stall: "
         "the survivors' step fails before any table says why (the local soak's kind of the same name; issue 34)",
         _leader_stoppable, _stop_leader_kill_inside, hold=SoakRange(cap=STALL_MAX_S), recovery=AFTER_HEAL,
         timed=True),
    Kind("redis_isolate", _HA,
         "the primary's host, one coordinator replica and one worker node are cut off together from every other "
         "host: inside, the old primary still acknowledges writes; outside, the sentinels promote a replica once "
         "the hold outlasts their down-after time. Only writes a replica confirmed may count "
         "(shoal.core.durable)",
         _primary_known_and_spares_a_node, _isolate_primary, hold=SoakRange(), recovery=AFTER_HEAL, timed=True),
)
