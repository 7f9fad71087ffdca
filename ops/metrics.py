"""Prometheus text-format metrics of a coordinator process, over plain HTTP.

:class:`MetricsServer` serves ``GET /metrics`` from a daemon thread (stdlib
``http.server``), bound to 127.0.0.1 unless told otherwise. Each scrape reads job and
worker states from Redis (one pipeline per kind) and this replica's counters from
:class:`shoal.coordinator.loop.Stats`. When Redis cannot be read the scrape still answers, with
``shoal_redis_up 0`` and without the Redis-derived series.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import redis

from shoal.events.records import Evaluation, JobStatus, WorkerRecord
from shoal.events.states import JobState, RemovalCause, WorkerState
from shoal.events.keys import JOBS, job_keys
from shoal.events.models import ShardTable
from shoal.ops.status import median_rate, parse_heartbeat

log = logging.getLogger("shoal.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Failure-detection latency buckets, seconds (beyond the heartbeat TTL).
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Latency:
    """Histogram over ``Stats.detection_latency_ms``, which only grows: each scrape folds in
    the entries appended since the previous one."""

    def __init__(self) -> None:
        self.seen = 0
        self.counts = [0] * len(LATENCY_BUCKETS)
        self.total = 0
        self.sum_s = 0.0
        self._lock = threading.Lock()

    def update(self, values: list[int]) -> None:
        with self._lock:
            new = values[self.seen:len(values)]
            self.seen += len(new)
            for ms in new:
                s = max(0, ms) / 1000
                self.total += 1
                self.sum_s += s
                for i, bound in enumerate(LATENCY_BUCKETS):
                    if s <= bound:
                        self.counts[i] += 1

    def lines(self) -> list[str]:
        name = "shoal_failure_detection_latency_seconds"
        out = [f"# HELP {name} Time from a worker's heartbeat TTL expiry to this replica declaring it failed.",
               f"# TYPE {name} histogram"]
        with self._lock:
            for bound, n in zip(LATENCY_BUCKETS, self.counts):
                out.append(f'{name}_bucket{{le="{bound}"}} {n}')
            out += [f'{name}_bucket{{le="+Inf"}} {self.total}', f"{name}_sum {self.sum_s:.6f}", f"{name}_count {self.total}"]
        return out


def redis_lines(client: redis.Redis) -> list[str]:
    """Series read from Redis: jobs by state, workers by state, each job's generation, and
    each job's training series (step, loss, steps/s from the Active members' heartbeats; world
    size, restarts, failures) and its newest evaluation (one ``shoal_job_eval`` series per
    metric, labelled ``metric``, and the step it evaluated)."""
    job_ids = sorted(j.decode() for j in client.smembers(JOBS))
    keys = []
    for jid in job_ids:
        try:
            keys.append(job_keys(jid))
        except ValueError:
            continue
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.hmget(k.state, ["state", "generation", "eval"])
        pipe.hvals(k.workers)
        pipe.get(k.shard)
        pipe.xlen(k.failures)
    replies = pipe.execute() if keys else []
    jobs = {s.value: 0 for s in JobState}
    workers = {s.value: 0 for s in WorkerState}
    gens = []
    evals: list[tuple[str, Evaluation]] = []  # job, its newest evaluation
    per_job: list[tuple[str, int, int, int, list[str]]] = []  # job, world size, restarts, failures, active ids
    removed: list[tuple[str, dict[str, int]]] = []  # job, its failed or left workers by removal cause
    for i, k in enumerate(keys):
        (state, gen, ev), records, shard, failures = replies[4 * i: 4 * i + 4]
        st = state.decode() if state else JobState.PENDING.value
        last = JobStatus.from_hash({"eval": ev}).eval if ev else None
        if last is not None:
            evals.append((k.job_id, last))
        jobs[st] = jobs.get(st, 0) + 1
        gens.append((k.job_id, int(gen or 0)))
        restarts, active, causes = 0, [], {}
        for raw in records:
            try:
                doc = WorkerRecord.from_json(raw)
            except ValueError:  # pydantic's ValidationError is one: a malformed record is skipped
                continue
            workers[doc.state.value] = workers.get(doc.state.value, 0) + 1
            restarts += doc.restarts
            if doc.state == WorkerState.ACTIVE:
                active.append(doc.worker_id)
            elif doc.state in (WorkerState.FAILED, WorkerState.LEFT):  # typed: the record's state and cause
                cause = (RemovalCause.LEFT if doc.state == WorkerState.LEFT
                         else RemovalCause.parse(doc.cause.value)).value
                causes[cause] = causes.get(cause, 0) + 1
        removed.append((k.job_id, causes))
        try:
            world = ShardTable.model_validate_json(shard).world_size if shard else 0
        except ValueError:
            world = 0
        per_job.append((k.job_id, world, restarts, int(failures), active))
    pipe = client.pipeline(transaction=False)
    for (jid, *_rest, active), k in zip(per_job, keys):
        pipe.mget([k.heartbeat(w) for w in active] or [k.heartbeat("-")])
    beats = pipe.execute() if keys else []
    out = ["# HELP shoal_jobs Registered jobs by state.", "# TYPE shoal_jobs gauge"]
    out += [f'shoal_jobs{{state="{_label(s)}"}} {n}' for s, n in jobs.items()]
    out += ["# HELP shoal_workers Worker records of all jobs by state.", "# TYPE shoal_workers gauge"]
    out += [f'shoal_workers{{state="{_label(s)}"}} {n}' for s, n in workers.items()]
    out += ["# HELP shoal_job_generation Current generation (shard table number) of each job.",
            "# TYPE shoal_job_generation gauge"]
    out += [f'shoal_job_generation{{job="{_label(j)}"}} {g}' for j, g in gens]
    series: dict[str, list[str]] = {name: [] for name in _TRAINING}
    for (jid, world, restarts, failures, _active), raws in zip(per_job, beats):
        label = f'job="{_label(jid)}"'
        series["shoal_job_world_size"].append(f"shoal_job_world_size{{{label}}} {world}")
        series["shoal_job_worker_restarts_total"].append(f"shoal_job_worker_restarts_total{{{label}}} {restarts}")
        series["shoal_job_failures_total"].append(f"shoal_job_failures_total{{{label}}} {failures}")
        hbs = [hb for hb in (parse_heartbeat(raw) for raw in raws) if hb is not None]
        if hbs:
            series["shoal_job_step"].append(f"shoal_job_step{{{label}}} {max(hb.step for hb in hbs)}")
            loss = next((hb.loss for hb in hbs if hb.loss is not None), None)
            if loss is not None:
                series["shoal_job_loss"].append(f"shoal_job_loss{{{label}}} {loss}")
            rate = median_rate(hbs)
            if rate:
                series["shoal_job_steps_per_second"].append(f"shoal_job_steps_per_second{{{label}}} {rate:.6g}")
            for part, field in _STEP_PARTS.items():  # where the median member's last step went
                times = sorted(t for t in (getattr(hb, field) for hb in hbs) if t is not None)
                if times:
                    series["shoal_job_step_part_seconds"].append(
                        f'shoal_job_step_part_seconds{{{label},part="{part}"}} {times[len(times) // 2]:.6g}')
            for name, field in _STREAM_SERIES.items():  # a streaming dataset's input, per worker
                for hb in hbs:
                    value = getattr(hb, field)
                    if value is not None:
                        series[name].append(f'{name}{{{label},worker="{_label(hb.worker_id)}"}} {value:.6g}')
    for jid, causes in removed:
        series["shoal_job_workers_removed"] += [f'shoal_job_workers_removed{{job="{_label(jid)}",cause="{c}"}} {n}'
                                                for c, n in sorted(causes.items())]
    for name, (kind, text) in _TRAINING.items():
        out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *series[name]]
    out += ["# HELP shoal_job_eval Newest evaluation of each job (its eval_fn's metrics), one series per metric.",
            "# TYPE shoal_job_eval gauge"]
    out += [f'shoal_job_eval{{job="{_label(j)}",metric="{_label(str(m))}"}} {float(v):.10g}'
            for j, ev in evals for m, v in ev.metrics.items()]
    out += ["# HELP shoal_job_eval_step Committed step of each job's newest evaluation.",
            "# TYPE shoal_job_eval_step gauge"]
    out += [f'shoal_job_eval_step{{job="{_label(j)}"}} {ev.step}' for j, ev in evals]
    return out


#: Per-job training series: name -> (Prometheus type, help).
_TRAINING = {
    "shoal_job_step": ("gauge", "Newest committed step of each running job (its Active members' heartbeats)."),
    "shoal_job_loss": ("gauge", "Global mean loss of the newest committed step of each running job."),
    "shoal_job_steps_per_second": ("gauge", "Committed steps per second of each running job (median member)."),
    "shoal_job_world_size": ("gauge", "Members of each job's current generation."),
    "shoal_job_worker_restarts_total": ("counter", "Worker restarts by node agents, per job."),
    "shoal_job_failures_total": ("counter", "Worker failures recorded per job (the failures stream; capped)."),
    "shoal_job_workers_removed": ("gauge", "Workers on a job's record that failed or left, by cause (exited, "
                                           "heartbeat_timeout, step_timeout, left): their records' typed state and "
                                           "cause."),
    "shoal_job_step_part_seconds": ("gauge", "Seconds of the last committed step of each job's median member, by "
                                             "part: compute (data, forward, backward), input_wait (waiting for its "
                                             "batches, within compute), exposed_comm (all-reduce not hidden by backward)."),
    "shoal_stream_bytes_downloaded": ("counter", "Bytes a worker downloaded from its streaming dataset (whole "
                                                 "shards and ranged reads), per job and worker."),
    "shoal_stream_cache_hit_ratio": ("gauge", "Share of a worker's samples read from its shard cache."),
    "shoal_stream_shards_owned": ("gauge", "Shards of the streaming dataset a worker owns in its job's table."),
    "shoal_stream_remote_reads": ("counter", "Samples a worker read by ranged reads (shards it does not own)."),
    "shoal_stream_balance_error": ("gauge", "Largest minus smallest rank's sample count in a worker's last step."),
}
#: streaming series -> the heartbeat field it is read from
_STREAM_SERIES = {"shoal_stream_bytes_downloaded": "bytes_downloaded", "shoal_stream_cache_hit_ratio": "cache_hit_rate",
                  "shoal_stream_shards_owned": "shards_owned", "shoal_stream_remote_reads": "remote_reads",
                  "shoal_stream_balance_error": "balance_error"}
#: ``part`` label -> the heartbeat field it is read from
_STEP_PARTS = {"compute": "compute_time", "input_wait": "input_wait_time", "exposed_comm": "exposed_comm_time"}


class MetricsServer:
    """``GET /metrics`` for one coordinator replica. ``coordinator`` may be None (Redis
    series only). ``port=0`` binds an ephemeral port (see :attr:`port`)."""

    def __init__(self, client: redis.Redis, coordinator=None, *, host: str = "127.0.0.1", port: int = 0):
        self.client = client
        self.coordinator = coordinator
        self._latency = _Latency()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 10  # a stalled client never pins a thread

            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                    self.send_error(404, "try /metrics")
                    return
                body = owner.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args) -> None:
                log.debug("metrics %s " + fmt, self.address_string(), *args)

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            from shoal.core.errors import ConfigError

            raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        return self._server.server_address[0]

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def render(self) -> str:
        lines = []
        try:
            lines += redis_lines(self.client)
            up = 1
        except redis.RedisError as exc:
            log.warning("metrics: cannot read Redis: %s", exc)
            up = 0
        lines += ["# HELP shoal_redis_up Whether this scrape could read Redis.", "# TYPE shoal_redis_up gauge",
                  f"shoal_redis_up {up}"]
        coord = self.coordinator
        if coord is not None:
            st = coord.stats
            counters = [
                ("shoal_events_handled_total", "Worker events applied by this replica.", st.events_handled),
                ("shoal_events_dead_lettered_total", "Events this replica moved to a dead-letter stream.", st.dead_lettered),
                ("shoal_generations_total", "Shard-table generations this replica published.", st.generations),
                ("shoal_failures_detected_total", "Workers this replica declared failed on heartbeat expiry.", st.failures_detected),
                ("shoal_takeovers_total", "Job leases this replica took (fencing epoch increments).", st.takeovers),
                ("shoal_handoffs_total", "Job leases this replica handed to a less loaded replica.", st.handoffs),
                ("shoal_ticks_total", "Heartbeat-scan ticks of this replica.", st.ticks),
            ]
            for name, help_, value in counters:
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {int(value)}"]
            lines += ["# HELP shoal_leading_jobs Jobs whose lease this replica holds.", "# TYPE shoal_leading_jobs gauge",
                      f"shoal_leading_jobs {len(coord.leads)}"]
            self._latency.update(st.detection_latency_ms)
            lines += self._latency.lines()
        return "\n".join(lines) + "\n"

    def start(self) -> "MetricsServer":
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="metrics-http", daemon=True)
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout)
        self._server.server_close()

    def __enter__(self) -> "MetricsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
