"""What both chaos soaks share: their configuration, the job they run, the failure-free
reference, how they follow the job, and how they conclude.

The local soak (:mod:`shoal.ops.chaos.run`) and the network soak (:mod:`shoal.ops.chaos.network`)
each import this module; the network soak imports nothing of the local one (``run_chaos``, in
``run``, picks the soak and imports ``network`` at the top). Their fault kinds are
:mod:`shoal.ops.chaos.kinds`, their pace steering :mod:`shoal.ops.chaos.pace`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.core.jobspec import JobSpec
from shoal.events.states import is_terminal
from shoal.ops.chaos.kinds import Injected, Soak, worker_rules
from shoal.ops.chaos.sampler import Samples
from shoal.ops.chaos.verdict import Verdict, judge, load_finals
from shoal.worker import ledger
from shoal.worker.data import DataOrder
from shoal.worker.engine import StepEngine
from shoal.worker.userapi import load_entrypoint
from shoal.events import envvars

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

    @property
    def soak(self) -> Soak:
        """Which soak this configuration runs (its fault kinds: :mod:`shoal.ops.chaos.kinds`)."""
        if not self.network:
            return Soak.LOCAL
        return Soak.HA if self.ha else Soak.NETWORK

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
    parameters, the pause per step (first value; then the file PaceSteer writes), and the
    fault rules the soak's kinds need the workers to hold (``SHOAL_FAULTS``; none: unset)."""
    env = {envvars.LEDGER_DIR: str(root / "ledger"), envvars.EXPORT_DIR: str(root / "final"),
           envvars.STEP_PACE: str(cfg.step_pace), envvars.STEP_PACE_FILE: str(root / "pace")}
    rules = worker_rules(cfg.soak, cfg.ttl)
    if rules:
        env[envvars.FAULTS] = rules
    return env


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
             more: tuple[tuple[str, bool, str], ...] = ()) -> Verdict:
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
                    window=window, duration=cfg.duration, failed=failed, soak=cfg.soak)
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
