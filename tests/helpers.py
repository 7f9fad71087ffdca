"""Test helpers shared by every layer: one :func:`wait_until` for anything a test awaits,
:class:`ControlWatcher` to await coordinator decisions on a job's control stream,
:func:`run_cli` to run ``python -m shoal ...`` as an operator would, :func:`job_spec` for the
tests' job specs and :func:`run_job` to run one on local processes to its end."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import redis

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.events.models import ShardTable
from shoal.events.records import WorkerRecord
from shoal.events.streams import ControlEntry
from shoal.ops.localproc import LocalProcs

#: the repository root
ROOT = Path(__file__).resolve().parent.parent

T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout: float, what: str | Callable[[], str], interval: float = 0.05) -> T:
    """Call ``pred`` until it returns something truthy, and return that value.

    ``pred`` is called at least once, and once more at the deadline; ``interval`` seconds
    pass between calls (0 for a ``pred`` that blocks or drives a loop itself). Past
    ``timeout`` seconds: AssertionError naming ``what`` and the timeout. ``what`` may be a
    callable, evaluated only then, to report the state seen at the timeout. An exception
    raised by ``pred`` propagates at once: a ``pred`` can fail fast, e.g. when the process
    it watches has died."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what() if callable(what) else what}")
        time.sleep(min(interval, left))


def run_cli(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m shoal ARGS`` from the repository root with ``env``; its output as text."""
    return subprocess.run([sys.executable, "-m", "shoal", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


#: What a test's job is unless the test says otherwise (JobSpec's own defaults are for real
#: clusters): a failure is seen within 1.5 s (a heartbeat every 0.2 s), at most 3 workers.
TEST_JOB = {"max_workers": 3, "heartbeat_interval": 0.2, "heartbeat_ttl": 1.5}


def job_spec(name: str, *shapes: Mapping, **fields) -> JobSpec:
    """The spec of job ``name``: :data:`TEST_JOB`, then each of ``shapes`` (a test file's job,
    e.g. its entrypoint and batch), then ``fields``, each over the ones before; everything
    else is JobSpec's default. ValidationError as JobSpec raises it."""
    merged: dict = dict(TEST_JOB)
    for shape in shapes:
        merged |= shape
    return JobSpec(**(merged | fields | {"name": name}))


def run_job(r: redis.Redis, redis_url: str, run_dir: Path, spec: JobSpec, workers: int, extra_env: dict[str, str],
            script: Callable | None = None, end_states: tuple[str, ...] = ("completed",)):
    """Register ``spec``, start a coordinator (``coord``) and ``workers`` workers (``p0``,
    ``p1``, ...) as real processes against ``redis_url`` with ``extra_env`` (logs under
    ``run_dir/logs``), call ``script(watch, procs, workers)`` while they run, wait up to 240 s
    for a decision whose job state is one of ``end_states``, then up to 60 s for every process
    but the coordinator to exit. Returns ``(watch, procs, exit codes by process name)``; every
    process is reaped. On any failure the tail of every log is printed, then it re-raises."""
    create_job(r, spec)
    watch = ControlWatcher(r, spec.name)
    with LocalProcs(redis_url, run_dir / "logs", extra_env=extra_env) as procs:
        procs.coordinator("coord")
        ws = [procs.worker(spec.name, f"p{i}") for i in range(workers)]
        try:
            if script:
                script(watch, procs, ws)
            watch.wait_for(lambda d: d.job_state in end_states, 240)
            codes = {p.name: p.wait(60) for p in procs.procs if p.name != "coord"}
        except BaseException:
            for p in procs.procs:
                print(f"===== {p.name}\n{p.log_tail(30)}")
            raise
    return watch, procs, codes


def dump_logs(procs, agent_dir: Path, lines: int = 40) -> None:
    """Print the tail of every process's log and of every node-agent slot log under
    ``agent_dir``: what a failing process test shows (pytest prints it with the failure)."""
    for p in procs.procs:
        print(f"===== {p.name}\n{p.log_tail(lines)}")
    for f in sorted(agent_dir.glob("*.log")):
        print(f"===== {f.name}\n" + "\n".join(f.read_text().splitlines()[-lines:]))


class ControlWatcher:
    """Reads a job's control stream (the coordinator's decisions) from the beginning, each
    entry through its model (:class:`~shoal.events.streams.ControlEntry`): predicates read
    its typed fields (``d.world_size``, ``d.failed``, ``d.joined``, ``d.job_state``...)."""

    #: longest single XREAD block: how far past its timeout ``wait_for`` may return
    BLOCK_MS = 200

    def __init__(self, client: redis.Redis, job_id: str):
        self.client = client
        self.keys = job_keys(job_id)
        self.last = "0-0"
        self.seen: list[ControlEntry] = []
        self._pos = 0

    def wait_for(self, pred: Callable[[ControlEntry], object], timeout: float) -> ControlEntry:
        """The first decision after the previous match that satisfies ``pred``, blocking on
        XREAD until it arrives; AssertionError on timeout, naming the last decisions seen."""
        while self._pos < len(self.seen):
            d = self.seen[self._pos]
            self._pos += 1
            if pred(d):
                return d

        def next_match() -> ControlEntry | None:
            resp = self.client.xread({self.keys.control: self.last}, count=100, block=self.BLOCK_MS)
            for _s, entries in resp or []:
                for sid, f in entries:
                    self.last = sid.decode()
                    d = ControlEntry.from_fields(f)
                    self.seen.append(d)
                    self._pos = len(self.seen)
                    if pred(d):
                        return d
            return None

        return wait_until(next_match, timeout, lambda: f"a matching decision on {self.keys.control}; saw: "
                          f"{[d.reason for d in self.seen][-10:]}", interval=0)

    def planned(self) -> list[ControlEntry]:
        """The decisions seen so far that planned a generation (a membership change)."""
        return [d for d in self.seen if d.planned]

    def table(self) -> ShardTable:
        return ShardTable.model_validate_json(self.client.get(self.keys.shard))

    def workers(self) -> dict[str, dict]:
        """The job's worker records, each read through its model (``WorkerRecord``), as dicts."""
        return {k.decode(): WorkerRecord.from_json(v).to_json_dict()
                for k, v in self.client.hgetall(self.keys.workers).items()}


def server_ms(client: redis.Redis) -> int:
    """Redis server time in ms (the clock the coordinator decides by)."""
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


def run_ranks(module: str, mode: str, n: int, job_id: str, env: dict[str, str], timeout: float = 120) -> list[dict]:
    """Run ``python -m module mode RANK job_id`` for ranks 0..n-1 together and return each
    rank's ``RESULT {json}`` line, in rank order; a rank that fails fails the test with its
    stderr. Every process is killed at the end."""
    env = dict(env, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", module, mode, str(r), job_id], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            assert p.returncode == 0, stderr[-3000:]
            results.append(json.loads([ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1][7:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def generation_tables(client: redis.Redis, job: str) -> dict[int, int]:
    """Generation -> world size of every table in the job's generations stream."""
    tables = [ShardTable.model_validate_json(f[b"data"]) for _sid, f in client.xrange(job_keys(job).generations)]
    return {t.generation: t.world_size for t in tables}


def check_failover_history(control: list, epoch_key: int, latest: list[int], entries: list[dict],
                           promoted: float, tables: dict[int, int]) -> tuple[dict, float, float]:
    """What a Redis fail-over under a job must leave (issue 29): the LATEST samples never move
    back; along the control stream the new primary holds (``control``, ControlEntry) the fencing
    epochs never go back and each belongs to one coordinator; the epoch key is at least the
    last of them; every generation a step was committed in is a table the new primary holds
    (``tables``, :func:`generation_tables`), of the world size the step ran with (workers train
    only in a table a replica confirmed). Returns (epoch -> coordinators, seconds from
    ``promoted`` to the next committed step, the longest spell between two committed steps),
    from the ledger ``entries``."""
    trained = {(e["generation"], e["world"]) for e in entries}
    assert all(tables.get(g) == w for g, w in trained), (sorted(trained), tables)
    moves = [v for i, v in enumerate(latest) if not i or v != latest[i - 1]]
    assert latest and all(a <= b for a, b in zip(moves, moves[1:])), f"LATEST moved back: {' > '.join(map(str, moves))}"
    epochs = [d.epoch for d in control]
    assert all(a <= b for a, b in zip(epochs, epochs[1:])), epochs
    owners: dict[int, set[str]] = {}
    for d in control:
        owners.setdefault(d.epoch, set()).add(d.coordinator)
    assert all(len(o) == 1 and "" not in o for o in owners.values()), owners
    assert epoch_key >= max(epochs)
    steps = sorted({e["step"]: e["t"] for e in entries}.items())
    resumed = min(t for _s, t in steps if t > promoted) - promoted
    stall = max(b[1] - a[1] for a, b in zip(steps, steps[1:]))
    return owners, resumed, stall
