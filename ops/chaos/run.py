"""``shoal chaos``: a training job under random faults, then a check of its end state.

The soak starts its own Redis under Sentinel (a primary, 2 replicas, 3 sentinels; AOF,
``appendfsync always``) in a run directory, every process connected through its
``redis+sentinel://`` URL, a local
checkpoint store, two coordinator replicas, and a node agent with ``workers`` workers of the
digits example in float64 (restarts unlimited). For ``duration`` seconds it injects a fault
every ``min_gap``..``max_gap`` seconds (default 2..5; kinds in a seeded, shuffled cycle, so each kind comes
up about equally; see :mod:`shoal.ops.chaos.kinds`). Then it lets the job finish, and judges the
end state (:mod:`shoal.ops.chaos.verdict`) against a failure-free single-process run of the same
number of steps, computed meanwhile in a background thread.

The job has a fixed length (``steps``); so that it neither ends before the window nor drags
on long after it, the soak steers the pause each step takes (:class:`~shoal.ops.chaos.pace.PaceSteer`, through the file
the paced entrypoint re-reads every second): the job is paced to reach its last step as the
window closes. If it still ends first, the window is cut short and the table says so.

``shoal chaos --network`` (:mod:`shoal.ops.chaos.network`) runs the same job, steering and
verdict across network namespaces, with network faults instead; :func:`run_chaos` picks the
soak. What both soaks share (the configuration, the job, the reference run, following the job,
the conclusion) is :mod:`shoal.ops.chaos.soak`.
"""


from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from shoal.core.connection import connect
from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.ops.chaos.inject import Injector
from shoal.ops.chaos.kinds import next_kind
from shoal.ops.chaos.network import run_network
from shoal.ops.chaos.pace import PaceSteer
from shoal.ops.chaos.sampler import Sampler
from shoal.ops.chaos.soak import (
    BATCH,  # noqa: F401 - tests/multihost (test_faults, test_redis_partition) import it from here
    Background,
    ChaosConfig,
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
from shoal.ops.chaos.verdict import Verdict
from shoal.ops.embedded import start_ha
from shoal.ops.localproc import LocalProcs
from shoal.storage.uri import open_store


def run_chaos(cfg: ChaosConfig, out=print) -> Verdict:
    """Run the soak ``cfg`` asks for (the network soak with ``cfg.network``); its verdict."""
    if cfg.network:
        return run_network(cfg, out)
    with tempfile.TemporaryDirectory(prefix="shoal-chaos-") as tmp:
        return _run(cfg, Path(cfg.run_dir) if cfg.run_dir else Path(tmp), out)


def _run(cfg: ChaosConfig, root: Path, out) -> Verdict:
    rng = random.Random(cfg.seed)
    steps = default_steps(cfg)
    server = start_ha(root / "redis-ha", appendonly=True)
    client = connect(server.url, ride_out=60)
    job = "chaos"
    keys = job_keys(job)
    ckpt = f"file://{root / 'ckpt'}"
    spec = job_spec(cfg, steps, ckpt, cfg.workers + cfg.shard_size, job)
    create_job(client, spec)
    env = worker_env(root, cfg)
    steer = PaceSteer(root / "pace", steps, cfg.step_pace)
    layout = f"elastic HSDP in replica groups of {cfg.shard_size}, " if cfg.shard_size > 1 else ""
    out(f"shoal chaos: {cfg.duration:.0f} s of faults, seed {cfg.seed}, {layout}{cfg.workers} workers under an agent, "
        f"2 coordinators, Redis under Sentinel (a primary, 2 replicas, 3 sentinels); job of {steps} steps; run dir {root}")
    state = {"server": server, "coords": 0, "joiners": 0}
    procs = LocalProcs(server.url, root / "logs", extra_env=env)
    reference = Background(lambda: reference_parameters(steps, cfg.seed, cfg.batch))
    coordinators: dict = {}

    def new_coordinator():
        state["coords"] += 1
        name = f"coord{state['coords']}"
        coordinators[name] = procs.coordinator(name, "--lease-ttl", "1")
        return coordinators[name]

    def fail_over() -> str:
        ha = state["server"]
        old = ha.kill_primary()
        killed = time.monotonic()
        new = ha.wait_failover(old)
        took = time.monotonic() - killed
        ha.rejoin(old, new)
        return f"primary :{old.port} killed; :{new.port} promoted after {took:.2f} s"

    def new_worker():
        state["joiners"] += 1
        return procs.worker(job, f"joiner{state['joiners']}")

    injector = Injector(client, keys, cfg.ttl, spec.max_workers, coordinators, fail_over, new_coordinator, new_worker,
                        shard_size=cfg.shard_size)
    sampler = Sampler(connect(server.url, ride_out=60), keys, open_store(ckpt))
    started = time.monotonic()
    completed = False
    try:
        with procs:
            new_coordinator()
            new_coordinator()
            procs.start("agent", "agent", job, "--workers", str(cfg.workers), "--max-restarts", "100000",
                        "--backoff", "0.1", "--backoff-max", str(cfg.agent_backoff_max), "--run-dir", str(root / "agent"))
            wait_state(client, keys, ("running",), 120)
            sampler.start()
            cycle: list[str] = []
            started = time.monotonic()  # the window starts once the job trains
            window_end = started + cfg.duration
            next_at = time.monotonic() + rng.uniform(*cfg.gaps())
            while time.monotonic() < window_end and not ended(client, keys):
                if steer.due():
                    steer.update(int(client.hget(keys.state, "latest_step") or 0), window_end)
                if time.monotonic() < next_at:
                    time.sleep(0.05)
                    continue
                kind = next_kind(cycle, cfg.soak.kinds, injector.allowed, rng)
                if kind is None:
                    next_at = time.monotonic() + 0.5
                    continue
                f = injector.inject(kind, rng)
                out(f"  {time.monotonic() - started:6.1f} s  {f.kind:<17} {f.target}")
                next_at = time.monotonic() + rng.uniform(*cfg.gaps())
            window = time.monotonic() - started
            injector.let_stops_finish()
            completed = finish_job(client, keys, cfg, steps, steer.pace, window, out)
            elapsed = time.monotonic() - started
            samples = sampler.stop()
            final_step = int(client.hget(keys.state, "latest_step") or 0)
            failed = [wid for _ts, wid in failures(client, keys)]
    finally:
        sampler.stop()
        injector.thaw_all()
        state["server"].stop()
    return conclude(cfg, root, out, steps=steps, reference=reference, completed=completed, final_step=final_step,
                    elapsed=elapsed, samples=samples, faults=injector.done, window=window, failed=failed)

