"""The launch unit: the RQ job function a node runs for a submitted job.

``run_launch(job_id, workers)`` runs a :class:`shoal.worker.agent.NodeAgent` with ``workers``
worker processes of the job on this node until they are done (the job ended, or the node
was asked to drain with SIGTERM), reports progress in the RQ job's ``meta`` every few
seconds, and returns the job's summary as the RQ result. It connects with ``REDIS_URL``
from this node's environment: the RQ payload holds only the job id and the worker count.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import redis

from shoal.events import envvars
from shoal.events.keys import AGENT_HEARTBEAT_S, job_keys
from shoal.events.models import ShardTable
from shoal.core.connection import connect, redact_url, url_from_env
from shoal.ops.embedded import default_run_dir
from shoal.ops.status import job_summary, parse_heartbeat, progress
from shoal.core.errors import ConfigError, ShoalError
from shoal.core.jobspec import JobSpec
from shoal.events.states import is_terminal

log = logging.getLogger("shoal.launch")

#: Seconds between two progress reports in the RQ job's meta.
META_INTERVAL = 3.0


class Progress:
    """Job-level progress (step, loss, generation, steps/s, ETA) from the shard table,
    the state hash and the members' heartbeats: three reads per report."""

    def __init__(self, client: redis.Redis, job_id: str, spec: JobSpec):
        self.client = client
        self.keys = job_keys(job_id)
        self.spec = spec
        self._last: tuple[float, int] | None = None
        self.rate: float | None = None
        self.max_step = 0

    def sample(self) -> dict:
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.keys.shard)
        pipe.hmget(self.keys.state, ["state", "generation"])
        raw, (state, gen) = pipe.execute()
        table = ShardTable.model_validate_json(raw) if raw else None
        members = sorted(table.members, key=lambda m: m.rank) if table else []
        hbs = self.client.mget([self.keys.heartbeat(m.worker_id) for m in members]) if members else []
        beats = [hb for hb in map(parse_heartbeat, hbs) if hb is not None]
        step = max((hb.step for hb in beats), default=self.max_step)
        self.max_step = max(self.max_step, step)
        loss = next((hb.loss for hb in beats if hb.loss is not None), None)
        now = time.monotonic()
        if self._last is not None and now > self._last[0] and step >= self._last[1]:
            inst = (step - self._last[1]) / (now - self._last[0])
            self.rate = inst if self.rate is None else 0.5 * self.rate + 0.5 * inst
        self._last = (now, step)
        return {
            # the job's length: max_steps, else what the workers computed from their dataset
            **progress(beats, self.max_step, self.rate, total=self.spec.max_steps),
            "state": state.decode() if state else "pending",
            "generation": int(gen or 0),
            "world_size": table.world_size if table else 0,
            "loss": loss,
            "updated_at": time.time(),
        }


def _save_meta(rq_job, fields: dict) -> None:
    if rq_job is None:
        return
    try:
        rq_job.meta.update(fields)
        rq_job.save_meta()
    except redis.RedisError as exc:  # progress is best effort; the workers keep training
        log.warning("could not update the launch unit's progress: %s", exc)


def run_launch(job_id: str, workers: int, *, meta_interval: float | None = None,
               stop: threading.Event | None = None) -> dict:
    """Run ``workers`` worker processes of ``job_id`` on this node until they are done;
    returns :func:`job_summary` plus ``node``, ``workers`` and ``agent_exit_code``.
    Progress goes to the RQ job's meta every ``meta_interval`` s (default: the node's
    ``SHOAL_LAUNCH_META_INTERVAL``, else 3).

    ``stop``: set, it drains the workers (they leave the job; the queue agent sets it on its
    first SIGTERM). Without it, a unit run in the main thread drains on SIGTERM itself.

    Redis being unreachable while the workers run ends nothing (``NodeAgent.run``): a
    fail-over, a restart, a name that does not resolve or a refused connection is waited out
    with backoff, the workers keep training, and the unit's own reads at its end wait for
    Redis too (:func:`_when_reachable`)."""
    from rq import get_current_job

    from shoal.worker.agent import NodeAgent

    if meta_interval is None:
        try:
            meta_interval = max(0.1, float(os.environ.get(envvars.LAUNCH_META_INTERVAL) or META_INTERVAL))
        except ValueError:
            meta_interval = META_INTERVAL
    url = url_from_env()
    if not url:
        raise ConfigError("REDIS_URL is not set on this node")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"workers must be a positive integer, got {workers!r}")
    try:
        keys = job_keys(job_id)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    rq_job = get_current_job()
    # the agent's loop handles outages past this ride-out itself (as `shoal agent JOB` does)
    client = connect(url, ride_out=UNIT_RIDE_OUT_S)
    try:
        raw = client.get(keys.spec)
        if raw is None:  # the unit fails with this one line as its reason
            raise ConfigError(f"job {job_id!r} does not exist in this Redis (deleted?): nothing to launch")
        spec = JobSpec.from_stored(raw)
        if workers > spec.max_workers:  # never start more processes than the job can use
            raise ConfigError(f"workers {workers} exceeds job {job_id!r}'s max_workers={spec.max_workers}")
        state = client.hget(keys.state, "state")
        if is_terminal(state):
            log.info("job %s already %s: no workers started", job_id, state.decode())
            return {**job_summary(client, job_id), "node": "", "workers": 0, "agent_exit_code": None}
        unit = rq_job.id if rq_job is not None else f"direct-{uuid.uuid4().hex[:12]}"
        run_dir = Path(os.environ.get(envvars.AGENT_DIR) or default_run_dir().parent / "agent") / job_id / unit
        agent = NodeAgent(client, url, job_id, workers, run_dir=run_dir, max_restarts=spec.max_restarts,
                          node=os.environ.get(envvars.NODE) or None, spec=spec)
        if stop is not None:
            agent.stop = stop
        log.info("launch unit %s: %d worker(s) of job %s on node %s (Redis %s, logs in %s)",
                 unit, workers, job_id, agent.node, redact_url(url), run_dir)
        progress = Progress(client, job_id, spec)
        base = {"job_id": job_id, "node": agent.node, "workers": workers, "run_dir": str(run_dir)}
        _save_meta(rq_job, {**base, "state": "starting", "step": 0, "updated_at": time.time()})
        previous = None
        if stop is None and threading.current_thread() is threading.main_thread():
            # SIGTERM to the unit drains the workers
            previous = signal.signal(signal.SIGTERM, lambda *_: agent.stop.set())
        next_report = time.monotonic() + meta_interval

        def report() -> None:  # Redis unreachable: an outage the agent's loop waits out
            nonlocal next_report
            if time.monotonic() >= next_report:
                next_report = time.monotonic() + meta_interval
                try:
                    sample = progress.sample()
                except _REDIS_DOWN:
                    raise
                except (redis.RedisError, ValueError) as exc:  # best effort: the workers go on
                    log.warning("progress sample failed: %s", exc)
                    return
                _save_meta(rq_job, {**base, **sample})

        try:
            rc = agent.run(report)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if rc:  # the coordinator may fail the job on the agent's last report: give it a moment
            deadline = time.monotonic() + GIVE_UP_WAIT_S
            while time.monotonic() < deadline and not _when_reachable(
                    lambda: is_terminal(client.hget(keys.state, "state"))):
                time.sleep(0.1)
        try:
            final = progress.sample()
        except (redis.RedisError, ValueError):
            final = {}
        result = {**_when_reachable(lambda: job_summary(client, job_id, steps=progress.max_step)),
                  "node": agent.node, "workers": workers, "agent_exit_code": rc}
        _save_meta(rq_job, {**base, **final, "state": result["state"], "step": result["steps"], "done": True})
        log.info("launch unit %s done: job %s is %s (%s)", unit, job_id, result["state"], result["reason"])
        if result["state"] == "failed" or rc:
            # RQ sees a failed unit (its failed registry, `rq info`, retries), with the cause as
            # its exception; the summary stays in the unit's meta
            gave_up = sum(1 for s in agent.slots if s.gave_up)
            why = (f"job {job_id} failed: {result['reason']}" if result["state"] == "failed"
                   else f"job {job_id} is {result['state']}, but this unit gave up on {gave_up} of {workers} worker slot(s)")
            raise LaunchFailed(why)
        return result
    finally:
        client.close()


#: How long the launch unit's own client retries a command before the agent's loop sees the
#: outage (and waits it out with its own backoff, the workers running meanwhile).
UNIT_RIDE_OUT_S = 5.0
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


def _when_reachable(read, *, first: float = 0.5, most: float = 30.0):
    """``read()``, tried again with backoff (``first`` doubling to ``most`` seconds) for as
    long as Redis is unreachable: the unit's result is read once Redis is back, never lost to
    an outage at the unit's end."""
    delay = first
    while True:
        try:
            return read()
        except _REDIS_DOWN as exc:
            log.warning("Redis is unreachable (%s); reading the unit's result again in %.1f s", exc, delay)
            time.sleep(delay)
            delay = min(2 * delay, most)


#: After a unit gave up on a worker slot, how long it waits for the coordinator to decide
#: (fail the job with the first cause) before it reports its own result.
GIVE_UP_WAIT_S = 5.0


class LaunchFailed(ShoalError):
    """The job of a launch unit failed (or the unit gave up on its workers): RQ records the
    unit as failed, with this one line as its cause."""


class LaunchRefused(ConfigError):
    """An RQ job on the launch queue that is not a well-formed launch unit."""


def _show(value: object) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


def unit_args(func_name: object, args: object, kwargs: object) -> tuple[str, int]:
    """``(job_id, workers)`` of a launch unit's payload, checked before anything is imported
    or run: the function must be ``run_launch`` and the arguments exactly a valid job id and a
    positive worker count. Anything else (another function, e.g. one pushed onto the queue
    by hand) raises LaunchRefused with a one-line reason."""
    from shoal.coordinator.launcher import LAUNCH_FUNC
    from shoal.events.keys import valid_job_id

    if func_name != LAUNCH_FUNC:
        raise LaunchRefused(f"refused: {_show(func_name)} is not a launch unit (only {LAUNCH_FUNC} runs here)")
    if kwargs:
        raise LaunchRefused(f"refused: a launch unit takes no keyword arguments, got {_show(kwargs)}")
    if not isinstance(args, (list, tuple)) or len(args) != 2:
        raise LaunchRefused(f"refused: a launch unit's arguments are [job_id, workers], got {_show(args)}")
    job_id, workers = args
    if not isinstance(job_id, str) or not valid_job_id(job_id):
        raise LaunchRefused(f"refused: job id must be 1-64 letters, digits, '_', '.', '-', got {_show(job_id)}")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise LaunchRefused(f"refused: workers must be a positive integer, got {_show(workers)}")
    return job_id, workers


def launch_worker(client: redis.Redis, *, name: str | None = None, heartbeat: float = AGENT_HEARTBEAT_S):
    """An RQ worker on the launch queue (JSON payloads) that runs each launch unit in its own
    process (RQ's ``SimpleWorker``, no forked work horse): the node agent, and so the
    supervision of the job's worker processes, is this process, whose loop waits out Redis
    outages (:func:`run_launch`). RQ's code runs only before a unit (dequeue, start
    bookkeeping), after it (its result) and in a heartbeat thread; give it a client that
    rides out outages for as long as they last (``connect(url, ride_out=math.inf)``), so that
    a fail-over, a restart or a primary's name that does not resolve makes those calls wait,
    never ends the worker.

    Why not RQ's forking ``Worker``: its parent watches the work horse in
    ``monitor_work_horse``, whose Redis calls (``maintain_heartbeats``, ``job.get_status``)
    raise on a fail-over; ``work()`` then quits and the horse's workers go with it (a
    container's PID 1). Here nothing of RQ stands between the agent and its workers.

    SIGTERM (warm shutdown) drains the running unit: its agent asks its workers to leave the
    job (Draining -> Left) and the worker exits once they did; a second SIGTERM is RQ's cold
    shutdown (SystemExit: the workers still running are killed).

    It runs launch units only (:func:`unit_args`), never whatever function a payload names.
    A unit that is refused, or whose launch fails with a ShoalError (e.g. the job does not
    exist), fails with that one line as its RQ failure reason; other exceptions are bugs and
    keep their traceback.

    ``heartbeat``: the worker refreshes its registration (``last_heartbeat`` of its RQ worker
    hash) at least this often, idle (its blocking dequeue waits that long) or running a unit
    (its heartbeat thread): ``shoal health agent`` reads it."""
    from rq.exceptions import DeserializationError
    from rq.job import Job
    from rq.serializers import JSONSerializer
    from rq.worker import SimpleWorker, WorkerStatus
    from rq.worker.base import BaseWorker

    from shoal.coordinator.launcher import launch_queue

    #: set by the first SIGTERM: the running unit's agent drains its workers
    stopping = threading.Event()

    class LaunchUnit(Job):
        shoal_error: str | None = None

        @property
        def func(self):
            try:
                job_id, workers = unit_args(self.func_name, self.args, self.kwargs)
            except LaunchRefused as exc:
                self.shoal_error = str(exc)
                raise

            def launch(*_args, **_kwargs):  # the checked arguments, whatever the payload says
                try:
                    return run_launch(job_id, workers, stop=stopping)
                except ShoalError as exc:
                    self.shoal_error = str(exc)
                    raise

            return launch

    def one_line(job) -> str | None:
        if getattr(job, "shoal_error", None):
            return job.shoal_error
        try:
            job.func_name
        except DeserializationError:
            return "refused: the payload is not an RQ JSON job (function, instance, args, kwargs)"
        return None

    class LaunchWorker(SimpleWorker):
        def execute_job(self, job, queue):
            """The unit in this process, RQ's heartbeats for it from a thread: a heartbeat
            that waits for Redis never holds up the agent's loop."""
            execution = self.prepare_execution(job)
            done = threading.Event()
            beats = threading.Thread(target=self._beat_until, args=(done, job, execution), daemon=True,
                                     name="rq-heartbeat")
            beats.start()
            try:
                self.perform_job(job, queue, execution)
            finally:
                done.set()
                while beats.is_alive():  # in steps: a signal is still handled meanwhile
                    beats.join(1.0)
            self.set_state(WorkerStatus.IDLE)

        def _beat_until(self, done: threading.Event, job, execution) -> None:
            while not done.wait(self.job_monitoring_interval):
                try:
                    self.maintain_heartbeats(job, execution)
                except redis.RedisError as exc:  # best effort: the next beat tries again
                    self.log.warning("launch unit %s: heartbeat failed: %s", job.id, exc)

        def get_heartbeat_ttl(self, job, working_time: float = 0.0) -> int:
            # a unit never times out: its registration lives one monitoring interval + 60 s
            # past each beat (SimpleWorker would hold it 420 s past a vanished node)
            return BaseWorker.get_heartbeat_ttl(self, job, working_time)

        def handle_exception(self, job, *exc_info):
            reason = one_line(job)
            if reason is None:
                return super().handle_exception(job, *exc_info)
            self.log.warning("launch unit %s failed: %s", job.id, reason)

        def handle_job_failure(self, job, queue, *args, **kwargs):
            reason = one_line(job)
            if reason is not None:
                kwargs["exc_string"] = reason
            return super().handle_job_failure(job, queue, *args, **kwargs)

        def request_stop(self, signum, frame):
            stopping.set()
            super().request_stop(signum, frame)

    beat = max(1, round(heartbeat))
    # RQ's idle dequeue blocks for worker_ttl - 15 s between heartbeats
    return LaunchWorker([launch_queue(client)], connection=client, serializer=JSONSerializer, name=name,
                        job_class=LaunchUnit, worker_ttl=beat + 15, job_monitoring_interval=beat)
