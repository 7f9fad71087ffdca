"""``shoal chaos --network``: the chaos soak across network namespaces, with network faults.

The same job, pace steering and verdict as the local soak (:mod:`shoal.ops.chaos.soak`), on a
network of hosts made with :mod:`shoal.ops.chaos.netns` (one Linux network namespace each, on
a bridge, private addresses): Redis on a host of its own, two coordinator replicas on two
more, and ``workers`` worker nodes, each a node agent (``--node nN``, restarts unlimited, no
``--iface``: the default address choice) running one worker. The soak itself reaches Redis
over its unix socket, which no network fault cuts.

For ``duration`` seconds it injects the next kind of a seeded, shuffled cycle over the
soak's kinds (:attr:`Soak.NETWORK` in :mod:`shoal.ops.chaos.kinds`: partitions two-way and
one-way, a node cut off from Redis, Redis blackholed, delay, loss, a link down, the leader cut
off from Redis, the leader stopped with a worker killed inside the stall), holds it for the
hold its kind declares (``min_hold``..``max_hold``, capped for some), heals it, waits for a
step to commit after the heal (at most :data:`RECOVER_WAIT` seconds), then ``min_gap``..
``max_gap`` seconds, and goes on.

With ``--ha`` Redis is a Sentinel set instead (a data node and a sentinel on each of ``r1``,
``r2``, ``r3``; every process connects through the ``redis+sentinel://`` URL; "Redis" in the
faults is the host of the primary the sentinels name at the time), and the soak's kinds are
:attr:`Soak.HA`'s: one more, ``redis_isolate`` (the primary, a coordinator replica and a worker
node cut off together).

The job is paced as in the local soak, steered every :data:`STEER_EVERY` seconds on the step
the workers' ledgers last committed; once the window closes, the pause is released and the
steps left run at full speed.

A fault that touches worker nodes comes only while an Active worker runs on a node it does
not touch: were every replica cut off at once, the job could only resume from a checkpoint
and re-commit the steps after it (the local soak's rule too). Every worker the coordinator
declares failed must have run on a host a fault touched (its failure declared after the fault
began; its join before the heal): the verdict's "no failure without a fault".

Every namespace, veth, bridge and nftables table the soak made is gone when it returns, also
when it failed or was interrupted (SIGINT or SIGTERM: both become KeyboardInterrupt here, and
are ignored while the namespaces are removed); a soak killed outright is swept by the next
harness start (``netns.sweep``).
"""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from shoal.core.registry import create_job
from shoal.events.keys import JobKeys, job_keys
from shoal.events.records import WorkerRecord
from shoal.ops.chaos.kinds import Injected, Soak, get, next_kind
from shoal.ops.chaos.netns import Host, Net, NetUnavailable, unavailable_reason
from shoal.ops.chaos.pace import PaceSteer
from shoal.ops.chaos.soak import (
    Background,
    ChaosConfig,
    committed_step,
    conclude,
    default_steps,
    ended,
    failures,
    finish_job,
    job_spec,
    reference_parameters,
    wait_state,
    worker_env,
)
from shoal.ops.chaos.sampler import Sampler
from shoal.ops.chaos.verdict import Verdict
from shoal.storage.uri import open_store
from shoal.events.states import WorkerState
from shoal.events import envvars

#: after a heal, the next fault waits for a step committed after it, this long at most (s)
RECOVER_WAIT = 10.0
#: seconds between two adjustments of the pause per step (PaceSteer)
STEER_EVERY = 10.0
#: the line printed where namespaces cannot be made
UNAVAILABLE = "shoal chaos --network: needs root with ip and nft (network namespaces): {reason}"


@dataclass
class NetInjector:
    """Performs network faults on the soak's hosts, one at a time (:meth:`inject`, then
    :meth:`heal`), and keeps which node every worker it saw ran on. The kinds themselves are
    entries of :data:`shoal.ops.chaos.kinds.REGISTRY` for ``soak``; :meth:`allowed` and
    :meth:`inject` look the entry up and call it with this injector's primitives."""

    net: Net
    client: redis.Redis
    keys: JobKeys
    nodes: list[Host]
    redis_host: Host | None  #: None: the HA set's primary, whichever it is (``net.ha_primary``)
    coordinators: dict[str, Host]  #: replica id (= host name) -> host
    #: replica id -> its process (``coordinator_stop`` signals it)
    coordinator_procs: dict = field(default_factory=dict)
    soak: Soak = Soak.NETWORK  #: whose kinds it injects (HA: Redis under Sentinel)
    hold_range: tuple[float, float] = (2.0, 5.0)  #: the soak's (--min-hold, --max-hold)
    ttl: float = 1.5  #: the job's heartbeat TTL
    done: list[Injected] = field(default_factory=list)
    current: Injected | None = None
    node_of: dict[str, str] = field(default_factory=dict)  #: worker id -> node name
    joined_ms: dict[str, int] = field(default_factory=dict)  #: worker id -> when it joined (server ms)
    _stopped: object = None  #: the coordinator process a ``coordinator_stop`` holds stopped

    # ---- what it observes ----------------------------------------------------------------

    def observe(self) -> dict[str, WorkerRecord]:
        """The job's worker records (and which node each ran on, remembered)."""
        docs = {k.decode(): WorkerRecord.from_json(v) for k, v in self.client.hgetall(self.keys.workers).items()}
        for wid, doc in docs.items():
            if doc.node:
                self.node_of[wid] = doc.node
                self.joined_ms[wid] = doc.joined_ms
        return docs

    def holders(self) -> set[str]:
        """Nodes running an Active worker."""
        return {d.node for d in self.observe().values() if d.state == WorkerState.ACTIVE}

    def leader(self) -> Host | None:
        token = self.client.get(self.keys.lease)
        return self.coordinators.get(token.decode().split(":", 1)[0]) if token else None

    def node_picks(self) -> list[Host]:
        """The worker nodes a fault may hit now: some Active worker runs on a node it spares."""
        held = self.holders()
        return [n for n in self.nodes if held - {n.name}]

    def pair_picks(self, ordered: bool) -> list[tuple[Host, Host]]:
        """The pairs of worker nodes a fault between two may hit now (``ordered``: (a, b) and
        (b, a) both, for a one-way fault; else each pair once): some Active worker runs on a
        node outside the pair."""
        held = self.holders()
        return [(a, b) for a in self.nodes for b in self.nodes
                if a is not b and (ordered or a.name < b.name) and held - {a.name, b.name}]

    def redis(self) -> Host:
        """The host of Redis (under Sentinel: of the primary now)."""
        if self.redis_host is not None:
            return self.redis_host
        name = self.net.ha_primary()
        if name is None:
            raise RuntimeError("the sentinels name no primary")
        return self.net.hosts[name]

    # ---- the registry's entry point ------------------------------------------------------

    def allowed(self, kind: str) -> bool:
        return get(self.soak, kind).allowed(self)

    def inject(self, kind: str, rng: random.Random) -> Injected:
        """Inject ``kind`` and record it as the current fault; it is held ``fault.hold`` seconds
        (its kind's hold), until :meth:`heal`."""
        if self.current is not None:
            raise RuntimeError(f"{self.current.kind} is still injected")
        entry = get(self.soak, kind)
        hold = entry.hold.seconds(rng, self.ttl, self.hold_range)
        hit = entry.inject(self, rng, hold)
        fault = Injected(kind, time.time(), hit.target, -1, nodes=hit.nodes, hold=hold)
        self.done.append(fault)
        self.current = fault
        return fault

    # ---- primitives the kinds use (besides ``net``'s) ------------------------------------

    def stop_coordinator(self, name: str) -> None:
        """SIGSTOP the coordinator replica ``name``; :meth:`heal` sends SIGCONT."""
        proc = self.coordinator_procs[name]
        proc.signal(signal.SIGSTOP)
        self._stopped = proc

    def heal(self) -> None:
        self.net.heal()
        stopped, self._stopped = self._stopped, None
        if stopped is not None:
            stopped.signal(signal.SIGCONT)
        if self.current is not None:
            self.current.healed = time.time()
            self.current = None

    def attribute(self, declared: list[tuple[int, str]]) -> None:
        """Fill in each fault's ``hits``: the workers declared failed (``declared``: (server ms,
        worker id)) that ran on a node it touched, joined before its heal and were declared
        failed after it began."""
        self.observe()
        for f in self.done:
            healed_ms = (f.healed or time.time()) * 1000
            f.hits = tuple(sorted({wid for ts, wid in declared if self.node_of.get(wid) in f.nodes
                                   and self.joined_ms.get(wid, 0) <= healed_ms and ts >= f.t * 1000 - 1}))


class FollowingClient:
    """The soak's own client of an HA set: each command goes, over its unix socket, to the data
    node the sentinels name as the primary at that moment (no network fault cuts it)."""

    def __init__(self, net: Net):
        self._net = net
        self._clients: dict[str, redis.Redis] = {}

    def _current(self) -> redis.Redis:
        name = self._net.ha_primary()
        if name is None:
            raise redis.ConnectionError("the sentinels name no primary (a fail-over under way)")
        if name not in self._clients:
            self._clients[name] = self._net.ha_client(name)
        return self._clients[name]

    def __getattr__(self, attr: str):
        return getattr(self._current(), attr)


@contextlib.contextmanager
def _interrupts_raise():
    """SIGINT and SIGTERM raise KeyboardInterrupt (so that clean-up runs), in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupted(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    before = {s: signal.signal(s, interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _shielded():
    """SIGINT and SIGTERM ignored (in the main thread): a second Ctrl-C cannot cut clean-up short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def run_network(cfg: ChaosConfig, out=print) -> Verdict:
    """Run the soak; raises :class:`NetUnavailable` (before making anything) where namespaces
    cannot be made, KeyboardInterrupt when interrupted (everything made is removed first)."""
    reason = unavailable_reason(faults=True)
    if reason:
        raise NetUnavailable(reason)
    if cfg.workers < 3:
        raise ValueError("shoal chaos --network needs at least 3 worker nodes")
    with tempfile.TemporaryDirectory(prefix="shoal-chaos-net-") as tmp, _interrupts_raise():
        root = Path(cfg.run_dir) if cfg.run_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        try:
            net = Net(root / "net")
        except RuntimeError as exc:  # a command of the harness failed: namespaces cannot be made
            raise NetUnavailable(str(exc)) from exc
        try:
            run = _soak(cfg, net, root, out)
        finally:
            with _shielded():  # the job is over (or abandoned): its processes need not drain long
                net.close(timeout=3.0)
        return conclude(cfg, root, out, **run)


def _soak(cfg: ChaosConfig, net: Net, root: Path, out) -> dict:
    """The hosts, the processes and the fault window; what :func:`conclude` needs."""
    rng = random.Random(cfg.seed)
    steps = default_steps(cfg)
    if cfg.ha:
        redis_host = None
        data = [net.add_host(f"r{i}") for i in (1, 2, 3)]
    else:
        redis_host = net.add_host("redis")
    coordinators = {name: net.add_host(name) for name in ("coord1", "coord2")}
    nodes = [net.add_host(f"n{i + 1}") for i in range(cfg.workers)]
    if cfg.ha:
        net.start_ha(data[0], data[1:], data)
        client = FollowingClient(net)
    else:
        net.start_redis(redis_host)
        client = net.client()
    job = "chaos"
    keys = job_keys(job)
    ckpt = f"file://{root / 'ckpt'}"
    create_job(client, job_spec(cfg, steps, ckpt, len(nodes) * cfg.shard_size, job))
    env = {**worker_env(root, cfg), envvars.HOME: str(root / "home")}
    # steered on a longer interval than the local soak's: each interval then spans several
    # faults held for seconds (a stall at each); at the window's end the pause is released
    steer = PaceSteer(root / "pace", steps, cfg.step_pace, every=STEER_EVERY)
    ledger_dir = root / "ledger"
    min_gap, max_gap = cfg.gaps()
    what = "Redis under Sentinel (a data node and a sentinel on each of r1, r2, r3)" if cfg.ha else "Redis"
    per_node = f"{cfg.shard_size} workers each, one HSDP replica group" if cfg.shard_size > 1 else "one worker each"
    out(f"shoal chaos --network: {cfg.duration:.0f} s of network faults, seed {cfg.seed}; {what}, 2 coordinators and "
        f"{len(nodes)} worker nodes (an agent with {per_node}), each its own network namespace ({net.tag}-*); "
        f"faults held {cfg.min_hold:g}-{cfg.max_hold:g} s, {min_gap:g}-{max_gap:g} s apart; job of {steps} steps; "
        f"run dir {root}")
    reference = Background(lambda: reference_parameters(steps, cfg.seed, cfg.batch))
    coords = [host.shoal(name, "coordinator", "--id", name, "--no-launcher", "--lease-ttl", "1", env=env)
              for name, host in coordinators.items()]
    # elastic HSDP: one replica group per node (its shard group's all-gathers stay on the node)
    agents = [n.shoal(f"agent-{n.name}", "agent", job, "--workers", str(cfg.shard_size), "--node", n.name,
                      "--max-restarts", "100000",
                      "--backoff", "0.1", "--backoff-max", str(cfg.agent_backoff_max),
                      "--run-dir", str(root / f"agent-{n.name}"), env=env) for n in nodes]
    injector = NetInjector(net, client, keys, nodes, redis_host, coordinators,
                           coordinator_procs={c.name: c for c in coords}, soak=cfg.soak,
                           hold_range=(cfg.min_hold, cfg.max_hold), ttl=cfg.ttl)
    sampler = Sampler(FollowingClient(net) if cfg.ha else net.client(), keys, open_store(ckpt))
    try:
        if not wait_state(client, keys, ("running",), 120):
            raise RuntimeError(f"the job did not start training; the logs are in {net.log_dir}\n{net.dump(10)}")
        deadline = time.monotonic() + 60  # every node trains before the first fault (if it can)
        while len(injector.holders()) < len(nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
        sampler.start()
        cycle: list[str] = []
        started = time.monotonic()  # the window starts once the job trains
        window_end = started + cfg.duration
        next_at = started + rng.uniform(min_gap, max_gap)
        heal_at = recover_by = 0.0
        healed_step = -1  # >= 0: healed at this step, waiting for a commit after it
        observed = 0.0
        while (now := time.monotonic()) < window_end and not ended(client, keys):
            if steer.due():
                steer.update(committed_step(ledger_dir), window_end)
            if now - observed >= 0.5:
                injector.observe()
                observed = now
            if injector.current is not None:
                if now >= heal_at:
                    healed_step = committed_step(ledger_dir)
                    injector.heal()
                    recover_by = time.monotonic() + RECOVER_WAIT
                time.sleep(0.05)
                continue
            if healed_step >= 0:
                if now < recover_by and committed_step(ledger_dir) <= healed_step:
                    time.sleep(0.2)
                    continue
                healed_step = -1
                next_at = now + rng.uniform(min_gap, max_gap)
            if now < next_at:
                time.sleep(0.05)
                continue
            kind = next_kind(cycle, cfg.soak.kinds, injector.allowed, rng)
            if kind is None:
                next_at = now + 0.5
                continue
            f = injector.inject(kind, rng)
            heal_at = time.monotonic() + f.hold
            out(f"  {time.monotonic() - started:6.1f} s  {f.kind:<17} {f.target}, held {f.hold:.1f} s")
        window = time.monotonic() - started
        if injector.current is not None:
            injector.heal()
        steer.release()
        completed = finish_job(client, keys, cfg, steps, steer.pace, window, out)
        elapsed = time.monotonic() - started
        samples = sampler.stop()
        final_step = int(client.hget(keys.state, "latest_step") or 0)
        running = [c.name for c in coords if c.popen.poll() is None]
        agent_rcs = {}
        for a in agents:  # after the job ends, each agent exits by itself
            try:
                agent_rcs[a.name] = a.wait(60)
            except subprocess.TimeoutExpired:
                agent_rcs[a.name] = None
        declared = failures(client, keys)
        injector.attribute(declared)
    finally:
        sampler.stop()  # Net.close heals whatever is still injected
    more = (("coordinators ran throughout", len(running) == len(coords),
             f"{len(running)} of {len(coords)} replicas still running at the end"),
            ("agents exited cleanly", all(rc == 0 for rc in agent_rcs.values()),
             ", ".join(f"{name} exit {rc}" for name, rc in agent_rcs.items())))
    return dict(steps=steps, reference=reference, completed=completed, final_step=final_step, elapsed=elapsed,
                samples=samples, faults=injector.done, window=window, failed=[wid for _ts, wid in declared], more=more)
