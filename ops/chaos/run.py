"""``shoal chaos``: a training job under random faults, then a check of its end state.

The soak starts its own Redis under Sentinel (a primary, 2 replicas, 3 sentinels; AOF,
``appendfsync always``) in a run directory, every process connected through its
``redis+sentinel://`` URL, a local
checkpoint store, two coordinator replicas, and a node agent with ``workers`` workers of the
digits example in float64 (restarts unlimited). For ``duration`` seconds it injects a fault
every ``min_gap``..``max_gap`` seconds (default 2..5; kinds in a seeded, shuffled cycle, so each kind comes
up about equally; see :mod:`shoal.ops.chaos.inject`). Then it lets the job finish, and judges the
end state (:mod:`shoal.ops.chaos.verdict`) against a failure-free single-process run of the same
number of steps, computed meanwhile in a background thread.

The job has a fixed length (``steps``); so that it neither ends before the window nor drags
on long after it, the soak steers the pause each step takes (``PaceSteer``, through the file
the paced entrypoint re-reads every second): the job is paced to reach its last step as the
window closes. If it still ends first, the window is cut short and the table says so.

``shoal chaos --network`` (:mod:`shoal.ops.chaos.network`) runs the same job, steering and
verdict across network namespaces, with network faults instead.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.events.keys import job_keys
from shoal.ops.chaos.inject import KINDS, Injected, Injector, next_kind, slow_step_rule
from shoal.ops.chaos.sampler import Sampler, Samples
from shoal.ops.chaos.verdict import LOCAL, Profile, Verdict, judge, load_finals
from shoal.core.connection import connect
from shoal.ops.embedded import start_ha
from shoal.core.registry import create_job
from shoal.core.jobspec import JobSpec
from shoal.ops.localproc import LocalProcs
from shoal.storage.uri import open_store
from shoal.worker import ledger
from shoal.worker.data import DataOrder
from shoal.worker.engine import StepEngine
from shoal.worker.userapi import load_entrypoint
from shoal.events.states import is_terminal

ENTRYPOINT = "shoal.examples.digits:build_double_paced"
REFERENCE = "shoal.examples.digits:build_double"  #: the same arithmetic, without the pause
BATCH = 64
#: elastic HSDP's global batch: every rank of every world size the soak can reach splits it
#: evenly (shard_size x 1..3 replica groups of 2)
HSDP_BATCH = 48
#: Steps per second the default job length assumes; the pace steering makes it so.
TARGET_RATE = 20.0


@dataclass
class ChaosConfig:
    duration: float = 60.0
    seed: int = 1
    workers: int = 3
    steps: int | None = None  #: job length; default: ``duration`` at TARGET_RATE steps/s
    min_gap: float | None = None  #: seconds between faults, at least (None: the mode's default, GAPS) ...
    max_gap: float | None = None  #: ... and at most
    ttl: float = 1.5
    run_dir: Path | None = None
    finish_timeout: float = 300.0  #: grace after the window, on top of the time the steps still to go need
    step_pace: float = 0.03  #: first seconds of sleep per step; then steered (PaceSteer)
    agent_backoff_max: float = 2.0  #: replacements come quickly: the soak tests faults, not crash loops
    network: bool = False  #: ``shoal chaos --network``: across network namespaces, network faults
    min_hold: float = 2.0  #: ``network``: each fault is held this long at least ...
    max_hold: float = 5.0  #: ... and at most, then healed
    ha: bool = False  #: ``network``: Redis under Sentinel, with the ``redis_isolate`` fault
    shard_size: int = 1  #: elastic HSDP's replica group size (1: data parallelism)

    @property
    def batch(self) -> int:
        return BATCH if self.shard_size == 1 else HSDP_BATCH

    def gaps(self) -> tuple[float, float]:
        lo, hi = GAPS[self.network]
        return (lo if self.min_gap is None else self.min_gap, hi if self.max_gap is None else self.max_gap)


#: (min, max) seconds between faults by default: locally, and (shorter: each network fault is
#: also held for a while, and all eight kinds come up in a 60 s window) with ``network``
GAPS = {False: (2.0, 5.0), True: (1.0, 2.0)}


def default_steps(cfg: ChaosConfig) -> int:
    """The job's length: ``--steps``, or ``duration`` at TARGET_RATE steps/s and some to spare."""
    return cfg.steps or int(cfg.duration * TARGET_RATE) + 200


def job_spec(cfg: ChaosConfig, steps: int, ckpt: str, max_workers: int, job: str = "chaos") -> JobSpec:
    """The soak's job: the paced float64 digits example, restarts unlimited, TTL ``cfg.ttl``,
    a checkpoint every 25 steps in ``ckpt``; elastic HSDP with ``cfg.shard_size`` > 1."""
    return JobSpec(name=job, entrypoint=ENTRYPOINT, global_batch_size=cfg.batch, seed=cfg.seed, max_steps=steps,
                   epochs=10_000, min_workers=cfg.shard_size, max_workers=max_workers, heartbeat_interval=0.2,
                   heartbeat_ttl=cfg.ttl, max_restarts=1000, checkpoint_uri=ckpt, checkpoint_interval=25,
                   checkpoint_keep=3, shard_size=cfg.shard_size)


def worker_env(root: Path, cfg: ChaosConfig) -> dict[str, str]:
    """What every process of the soak gets: where workers write their ledger and final
    parameters, and the pause per step (first value; then the file PaceSteer writes)."""
    return {"SHOAL_LEDGER_DIR": str(root / "ledger"), "SHOAL_EXPORT_DIR": str(root / "final"),
            "SHOAL_STEP_PACE": str(cfg.step_pace), "SHOAL_STEP_PACE_FILE": str(root / "pace")}


def reference_parameters(steps: int, seed: int, batch: int = BATCH) -> dict:
    """The failure-free run: one process, the same global batches, no collectives."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        setup = load_entrypoint(REFERENCE, seed)
        engine = StepEngine.from_setup(setup, require_group=False)
        order = DataOrder(len(setup.dataset), seed, batch)
        cursor = 0
        for _ in range(steps):
            batch = order.batch(cursor)
            engine.step(batch.indices, batch.count, 0)
            cursor = batch.next_cursor
        return {k: v.detach().clone() for k, v in setup.model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def run_chaos(cfg: ChaosConfig, out=print) -> Verdict:
    if cfg.network:
        from shoal.ops.chaos.network import run_network

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
    env = {**worker_env(root, cfg), "SHOAL_FAULTS": slow_step_rule(cfg.ttl)}
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
                kind = next_kind(cycle, KINDS, injector.allowed, rng)
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


def finish_job(client, keys, cfg: ChaosConfig, steps: int, pace: float, window: float, out) -> bool:
    """After the window: wait for the job to complete (True) or end otherwise / time out."""
    to_go = max(0, steps - int(client.hget(keys.state, "latest_step") or 0))
    out(f"fault window over after {window:.1f} s (from the first committed steps); "
        f"letting the job finish its last {to_go} steps")
    # Faults slow a long soak down, so the steps left at the window's end are not known in
    # advance; allow each of them twice the nominal pace on top of the fixed grace.
    return wait_state(client, keys, ("completed",), cfg.finish_timeout + 2 * to_go * (pace + 0.02))


def conclude(cfg: ChaosConfig, root: Path, out, *, steps: int, reference: "Background", completed: bool, final_step: int,
             elapsed: float, samples: Samples, faults: list[Injected], window: float, failed: list[str],
             profile: Profile = LOCAL, more: tuple[tuple[str, bool, str], ...] = ()) -> Verdict:
    """Judge a soak's end state from what it left in ``root`` (ledger, final parameters),
    print the table, write it as ``root/summary.json``. ``more``: checks of the soak's own
    (name, ok, detail), added to the table."""
    entries = ledger.read(root / "ledger")
    last_step = max((e["step"] for e in entries), default=0)
    finals = load_finals(root / "final")
    if last_step != steps:
        out(f"the job stopped at step {last_step} of {steps}: computing the failure-free run of {last_step} steps...")
        ref = reference_parameters(last_step, cfg.seed, cfg.batch) if last_step else None
    else:
        out("waiting for the failure-free reference run...")
        ref = reference.result()
    verdict = judge(completed=completed, final_step=max(last_step, final_step), elapsed=elapsed, entries=entries,
                    num_samples=_num_samples(), finals=finals, reference=ref, samples=samples, faults=faults,
                    window=window, duration=cfg.duration, failed=failed, profile=profile)
    for name, ok, detail in more:
        verdict.add(name, ok, detail)
    out("")
    out(verdict.table())
    (root / "summary.json").write_text(json.dumps(verdict.summary(), indent=1) + "\n")
    return verdict


def failures(client, keys) -> list[tuple[int, str]]:
    """(Redis server time in ms, worker id) of every failure the coordinator declared."""
    return [(int(sid.split(b"-")[0]), f[b"worker"].decode()) for sid, f in client.xrange(keys.failures) if b"worker" in f]


class Background:
    """``fn()`` in a daemon thread; :meth:`result` waits for it (re-raising its error)."""

    def __init__(self, fn) -> None:
        self._out: dict = {}

        def run() -> None:
            try:
                self._out["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to result()
                self._out["error"] = exc

        self._thread = threading.Thread(target=run, name="chaos-reference", daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join()
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]


class PaceSteer:
    """Steers the per-step pause so that the job reaches ``steps`` as the window closes.

    Every ``every`` seconds it estimates a step's own cost - the step time of the last
    interval less the pause it ran with, the smallest of the last few intervals, since a
    fault's stall makes an interval look slow - and sets the pause to the step time still
    needed less that cost (kept within [0, ``max_pace``]). It writes the pause to ``path``
    (atomically); workers re-read it. (It used to move the pause by half the difference
    between the measured and the needed step time: after stalls the job raced, and on a fast
    machine the 60 s soak's job ended 5 s before its window.)"""

    def __init__(self, path: Path, steps: int, pace: float, every: float = 5.0, max_pace: float = 0.5) -> None:
        self.path, self.steps, self.pace, self.every, self.max_pace = path, steps, pace, every, max_pace
        self._last: tuple[float, int] | None = None
        self._costs: list[float] = []  #: a step's own cost (pause excluded), recent intervals
        self.history: list[float] = [pace]
        self._write()

    def due(self, now: float | None = None) -> bool:
        """Whether :meth:`update` would act now (so the caller reads the step only then)."""
        now = time.monotonic() if now is None else now
        return self._last is None or now - self._last[0] >= self.every

    def update(self, step: int, window_end: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._last is None:
            self._last = (now, step)
            return
        t0, s0 = self._last
        if now - t0 < self.every:
            return
        self._last = (now, step)
        if step <= s0:
            return  # nothing committed in the interval (a fault): no evidence of the rate
        measured = (now - t0) / (step - s0)  # seconds per step, pause included
        self._costs = (self._costs + [max(0.0, measured - self.pace)])[-4:]
        left, time_left = self.steps - step, window_end - now
        # aim to commit the last step a little after the window closes, so that the job
        # outlasts the window rather than cutting it short
        needed = (time_left + self.every * 4) / left if left > 0 and time_left > 0 else self.max_pace
        self.pace = min(self.max_pace, max(0.0, needed - min(self._costs)))
        self.history.append(self.pace)
        self._write()

    def release(self) -> None:
        """No pause any more: the steps left after the window run at full speed."""
        self.pace = 0.0
        self.history.append(self.pace)
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{self.pace:.5f}\n")
        os.replace(tmp, self.path)


def committed_step(ledger_dir: Path, newest: int = 3) -> int:
    """The last step the workers' ledgers record as committed (0 before any): the last whole
    line of each of the ``newest`` most recently written ledger files. Exact and independent of
    Redis (``latest_step`` in the job's state is the last checkpoint's step)."""
    def mtime(f: Path) -> float:
        try:
            return f.stat().st_mtime
        except FileNotFoundError:
            return 0.0

    best = 0
    for f in sorted(ledger_dir.glob("ledger-*.jsonl"), key=mtime, reverse=True)[:newest]:
        try:
            with open(f, "rb") as fh:
                fh.seek(max(0, fh.seek(0, os.SEEK_END) - 65536))
                lines = fh.read().split(b"\n")
        except FileNotFoundError:
            continue
        for line in reversed(lines):  # the last one may be half written
            try:
                best = max(best, int(json.loads(line)["step"]))
                break
            except (ValueError, KeyError, TypeError):
                continue
    return best


def _num_samples() -> int:
    return len(load_entrypoint(REFERENCE, 0).dataset)


def ended(client, keys) -> bool:
    raw = client.hget(keys.state, "state")
    return is_terminal(raw)


def wait_state(client, keys, wanted: tuple[str, ...], timeout: float) -> bool:
    """Follow the job's control stream until its state is one of ``wanted`` (True) or the
    job ended otherwise / ``timeout`` passed (False)."""
    deadline = time.monotonic() + timeout
    last = "0-0"
    while (left := deadline - time.monotonic()) > 0:
        raw = client.hget(keys.state, "state")
        st = raw.decode() if raw else "pending"
        if st in wanted:
            return True
        if is_terminal(st):
            return False
        resp = client.xread({keys.control: last}, count=100, block=max(1, int(min(left, 1.0) * 1000)))
        for _s, entries in resp or []:
            last = entries[-1][0].decode()
    return False
