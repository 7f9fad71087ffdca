"""The ``shoal`` command line. Each subcommand is a small function; errors a user can cause
(ShoalError) print one line ``shoal: <message>`` and exit non-zero without a traceback."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from shoal.events import envvars
from shoal.core.connection import connect, redact_url, url_from_env
from shoal.ops.embedded import default_run_dir, redis_url
from shoal.core.errors import ConfigError, ConnectionFailed, ShoalError
from shoal.core.yamlfile import escape_controls

log = logging.getLogger("shoal.cli")

#: How long workers and agents keep retrying Redis commands through an outage.
RIDE_OUT_S = 60.0


@contextlib.contextmanager
def redis_client(*, start_embedded: bool, ride_out: float = 0.0, timeout: float = 5.0) -> Iterator[redis.Redis]:
    """A client for ``REDIS_URL``, or for the embedded server (started if allowed).
    ``ride_out`` and ``timeout`` (socket): see :func:`shoal.core.connection.connect`."""
    url, server = redis_url(start_embedded=start_embedded)
    client = connect(url, ride_out=ride_out, timeout=timeout)
    try:
        yield client
    finally:
        client.close()
        if server is not None:
            server.stop()


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def _stop_on_signals(stop: threading.Event) -> None:
    def handler(signum, _frame):
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


# ---- subcommands ----------------------------------------------------------------------------


def _every(stop: threading.Event, interval: float, fn, name: str) -> threading.Thread:
    """Run ``fn`` every ``interval`` s in a daemon thread until ``stop``; errors are logged."""

    def loop() -> None:
        while not stop.wait(interval):
            try:
                fn()
            except redis.RedisError as exc:
                log.warning("%s: Redis error: %s", name, exc)
            except Exception:  # a launcher bug must not take the coordinator down
                log.exception("%s failed", name)

    t = threading.Thread(target=loop, name=name, daemon=True)
    t.start()
    return t


def cmd_coordinator(args: argparse.Namespace) -> int:
    from shoal.coordinator.loop import Coordinator

    if not 0 <= args.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port must be 0..65535, got {args.metrics_port}")
    if args.launch_interval <= 0:
        raise ConfigError("--launch-interval must be > 0")
    stop = threading.Event()
    _stop_on_signals(stop)
    with redis_client(start_embedded=True) as client:
        coord = Coordinator(client, instance_id=args.id, lease_ttl=args.lease_ttl, tick_interval=args.tick)
        metrics = None
        if args.metrics_port:
            from shoal.ops.metrics import MetricsServer

            metrics = MetricsServer(client, coord, host=args.metrics_host, port=args.metrics_port).start()
        if args.launcher:
            # not part of the fenced decision path: it only enqueues RQ launch units
            from shoal.coordinator.launcher import Launcher

            launcher = Launcher(client, instance_id=coord.instance_id, cooldown=args.launch_cooldown)
            _every(stop, args.launch_interval, launcher.run_once, "launcher")
        log.info("coordinator %s serving (lease ttl %.1fs)", coord.instance_id, args.lease_ttl)
        try:
            coord.run(stop)
        finally:
            stop.set()
            if metrics is not None:
                metrics.stop()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from shoal.core.jobspec import JobSpec
    from shoal.events.keys import job_keys
    from shoal.worker.membership import Membership, MembershipError
    from shoal.worker.simulated import SimulatedWorker

    # a worker lives through a Redis restart: its commands retry while training goes on
    with redis_client(start_embedded=False, ride_out=RIDE_OUT_S) as client:
        raw = client.get(job_keys(args.job).spec)
        if raw is None:
            raise MembershipError(f"job {args.job!r} does not exist")
        spec = JobSpec.from_stored(raw)
        membership = Membership(client, args.job, node=args.node or "")
        if spec.entrypoint != "simulate":
            from shoal.worker.training import TrainingWorker  # the elastic training runtime

            runner = TrainingWorker(membership, spec, join_timeout=args.join_timeout, iface=args.iface)
        else:
            runner = SimulatedWorker(membership, spec, join_timeout=args.join_timeout)
        signal.signal(signal.SIGTERM, lambda *_: runner.stop.set())
        signal.signal(signal.SIGINT, lambda *_: runner.stop.set())
        from shoal.worker.loghandler import redis_logging  # log lines also go to keys.logs (`shoal logs`)

        with redis_logging(client, args.job, lambda: membership.worker_id or f"pid{os.getpid()}"):
            return runner.run()


def cmd_agent(args: argparse.Namespace) -> int:
    from shoal.events.keys import job_keys
    from shoal.core.jobspec import JobSpec
    from shoal.worker.agent import NodeAgent

    if args.queue or args.job is None:
        if args.job is not None:
            raise ConfigError("give a JOB (direct mode) or --queue, not both")
        if args.workers is not None:
            raise ConfigError("--workers applies to direct mode: each launch unit says how many workers it runs")
        return _agent_queue(args)
    if args.burst:
        raise ConfigError("--burst applies to --queue mode only")
    if args.heartbeat is not None:
        raise ConfigError("--heartbeat applies to --queue mode only")
    args.workers = 1 if args.workers is None else args.workers
    if args.workers == "gpu":  # torchrun's --nproc-per-node gpu: one worker per visible GPU
        from shoal.worker.placement import visible_gpus

        args.workers = len(visible_gpus())
        if not args.workers:
            raise ConfigError("--workers gpu: no GPU is visible on this node "
                              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(not set)')})")
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    for flag in ("backoff", "backoff_max", "backoff_reset"):
        value = getattr(args, flag)
        if not 0 <= value < float("inf"):
            raise ConfigError(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value}")
    _job_keys(args.job)
    with redis_client(start_embedded=False, ride_out=RIDE_OUT_S) as client:
        raw = client.get(job_keys(args.job).spec)
        if raw is None:
            raise ConfigError(f"job {args.job!r} does not exist")
        spec = JobSpec.from_stored(raw)
        url = url_from_env() or _embedded_url(client)
        run_dir = Path(args.run_dir or default_run_dir().parent / "agent" / args.job)
        agent = NodeAgent(client, url, args.job, args.workers, run_dir=run_dir,
                          max_restarts=spec.max_restarts if args.max_restarts is None else args.max_restarts,
                          backoff=args.backoff, backoff_max=args.backoff_max, backoff_reset=args.backoff_reset,
                          node=args.node, spec=spec, extra_env={envvars.IFACE: args.iface} if args.iface else None)
        signal.signal(signal.SIGTERM, lambda *_: agent.stop.set())
        signal.signal(signal.SIGINT, lambda *_: agent.stop.set())
        return agent.run()


def _embedded_url(client) -> str:
    """The URL of the embedded server ``client`` talks to (no ``REDIS_URL``: always a plain
    loopback server)."""
    return f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"


def _agent_queue(args: argparse.Namespace) -> int:
    """The node agent as an RQ worker on the launch queue: each launch unit it takes runs
    ``shoal.launch.run_launch`` (a NodeAgent for that job) in this process (no work horse),
    and RQ's own Redis calls wait out outages for as long as they last
    (:func:`shoal.ops.launch.launch_worker` says why)."""
    import math

    from shoal.events.keys import AGENT_HEARTBEAT_S, LAUNCH_QUEUE
    from shoal.ops.launch import launch_worker

    with redis_client(start_embedded=False) as checked:  # unreachable at the start: one line, exit 3
        url = url_from_env() or _embedded_url(checked)
    with contextlib.closing(connect(url, ride_out=math.inf, check=False)) as client:
        os.environ["REDIS_URL"] = url  # run_launch connects with it
        if args.node:
            os.environ[envvars.NODE] = args.node
        if args.iface:
            os.environ[envvars.IFACE] = args.iface  # the units' workers inherit it
        if args.run_dir:
            os.environ[envvars.AGENT_DIR] = str(Path(args.run_dir).resolve())
        worker = launch_worker(client, name=args.name,
                               heartbeat=AGENT_HEARTBEAT_S if args.heartbeat is None else args.heartbeat)
        log.info("agent %s serving RQ queue %s at %s%s", worker.name, LAUNCH_QUEUE, redact_url(url),
                 " (burst: until the queue is empty)" if args.burst else "")
        worker.work(burst=args.burst, logging_level="DEBUG" if args.verbose else "INFO", with_scheduler=False)
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 and one line on stdout when healthy; else ``shoal: <cause>`` and exit 1
    (unhealthy) or 3 (Redis unreachable). See :mod:`shoal.ops.health`."""
    import socket

    from shoal.events.keys import AGENT_HEARTBEAT_S, AGENT_STALE_HEARTBEATS
    from shoal.ops.health import Unhealthy, check_agent, check_coordinator, check_redis

    if args.component != "agent" and args.name is not None:
        raise ConfigError("--name applies to `shoal health agent`")
    if args.component != "coordinator" and args.id is not None:
        raise ConfigError("--id applies to `shoal health coordinator`")
    try:
        with redis_client(start_embedded=False, timeout=args.timeout) as client:
            if args.component == "coordinator":
                verdict = check_coordinator(client, args.id or socket.gethostname(), args.lease_ttl)
            elif args.component == "agent":
                max_age = AGENT_STALE_HEARTBEATS * AGENT_HEARTBEAT_S if args.max_age is None else args.max_age
                verdict = check_agent(client, name=args.name, max_age_s=max_age)
            else:
                verdict = check_redis(client)
    except (ConnectionFailed, redis.ConnectionError, redis.TimeoutError) as exc:
        if not args.allow_redis_down:
            if isinstance(exc, ConnectionFailed):
                raise
            url = url_from_env()
            raise ConnectionFailed(f"cannot reach Redis at {redact_url(url) if url else 'the embedded server'}: {exc}") from exc
        print(f"{args.component}: Redis not usable, not judged (--allow-redis-down): "
              f"{escape_controls(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)}")
        return 0
    if not verdict.healthy:
        raise Unhealthy(verdict.reason)
    print(verdict.reason)
    return 0


def _job_keys(job_id: str):
    from shoal.events.keys import job_keys

    try:
        return job_keys(job_id)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _workers_arg(text: str) -> int | str:
    """``--workers`` of ``shoal agent``: a positive integer, or ``gpu`` (one per visible GPU)."""
    return "gpu" if text.strip().lower() == "gpu" else _positive_int(text)


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {x:g}")
    return x


def cmd_submit(args: argparse.Namespace) -> int:
    from shoal.events.keys import LAUNCH_QUEUE
    from shoal.ops.submit import submit

    from shoal.core.registry import JobExists

    spec = _checked_spec(args)  # refused here, before anything is written or queued
    with redis_client(start_embedded=True) as client:
        try:
            done = submit(client, spec, workers_per_unit=args.workers)
        except JobExists:
            if not args.if_absent:
                raise
            # compose's one-shot `submit` runs on every `up`: the job it registered the first
            # time (running, resumed, or finished) is left as it is, and that is a success
            print(spec.name)
            print(f"shoal: job {spec.name} already exists; not submitted again (--if-absent)", file=sys.stderr)
            return 0
    print(done.job_id)
    print(f"shoal: job {done.job_id} registered; {len(done.unit_ids)} launch unit(s) queued on {LAUNCH_QUEUE} "
          f"(workers per unit: {', '.join(map(str, done.sizes))}); run 'shoal agent --queue' on each node",
          file=sys.stderr)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from shoal.events.states import is_terminal
    from shoal.ops.jobs import job_state, keys_of, stop_job

    keys = keys_of(args.job)
    if args.wait is not None and args.wait <= 0:
        raise ConfigError("--wait must be > 0 seconds")
    with redis_client(start_embedded=False) as client:
        done = stop_job(client, args.job, args.reason)
        if not done.requested:
            print(f"job {args.job} is already {done.was}; nothing to stop")
            return 0
        print(f"stop requested for job {args.job} (was {done.was})"
              + (f"; dropped {done.dropped_units} queued launch unit(s)" if done.dropped_units else ""))
        if args.wait is None:
            return 0
        deadline = time.monotonic() + args.wait
        while time.monotonic() < deadline:
            state = job_state(client, keys)
            if is_terminal(state):
                print(f"job {args.job} is {state}")
                return 0
            time.sleep(0.2)
        raise ShoalError(f"job {args.job} is still {state} after {args.wait:g} s (is a coordinator running?)")


def cmd_purge(args: argparse.Namespace) -> int:
    from shoal.ops.jobs import parse_purge_states, purge_jobs

    wanted = parse_purge_states(args.state.split(","))
    with redis_client(start_embedded=False) as client:
        listed = purge_jobs(client, wanted, dry_run=True)
        if not listed.targets:
            print(f"no {'/'.join(wanted)} jobs")
            return 0
        for j, state in listed.targets.items():
            print(f"{j:<24} {state}")
        if not args.yes:
            print(f"dry run: pass --yes to delete these {len(listed.targets)} job(s) (their checkpoints are kept)")
            return 0
        done = purge_jobs(client, wanted, dry_run=False, among=list(listed.targets))  # waits for leases to lapse
    print(f"purged {len(done.targets)} job(s) ({done.deleted_keys} keys); checkpoints were not touched")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from shoal.events.streams import LogEntry
    from shoal.ops.jobs import keys_of, require_job
    from shoal.ops.streams import follow, format_log, last_id, read_range

    keys_of(args.job)
    if args.tail is not None and args.tail < 1:
        raise ConfigError("--tail must be >= 1")
    keep = (lambda line: line.worker == args.worker) if args.worker else None
    with redis_client(start_embedded=False) as client:
        keys = require_job(client, args.job, "logs")
        # what is there now (the stream is capped at ~10000 lines), then new lines with --follow
        last = last_id(client, keys.logs)
        for _sid, line in read_range(client, keys.logs, LogEntry, until=last, keep=keep, tail=args.tail):
            print(format_log(line))
        if not args.follow:
            return 0
        sys.stdout.flush()
        for entries in follow(client, keys, keys.logs, LogEntry, after=last, keep=keep, quiet_s=2.0):
            for _sid, line in entries:
                print(format_log(line), flush=True)
    return 0  # the job ended and its workers went quiet


def cmd_create(args: argparse.Namespace) -> int:
    from shoal.ops.submit import register

    spec = _checked_spec(args)  # refused here, before anything is written
    with redis_client(start_embedded=True) as client:
        register(client, spec)
    print(spec.name)
    return 0


def _checked_spec(args: argparse.Namespace):
    """The spec of ``create``/``submit`` (:func:`_spec_from_args`), checked as runnable
    unless ``--no-validate`` (and built when ``--dry-build``)."""
    from shoal.ops.submit import check_runnable

    if args.no_validate and args.dry_build:
        raise ConfigError("--dry-build and --no-validate contradict each other")
    spec = _spec_from_args(args)
    if not args.no_validate:
        check_runnable(spec, build=args.dry_build)
    return spec


def _spec_from_args(args: argparse.Namespace):
    """The job spec of ``create``/``submit``: the file (if given), then ``--name`` and every
    ``--set key=value`` over it, validated like the file (one line naming a bad field)."""
    spec = _spec_fields(args)
    if spec.working_dir and not Path(spec.working_dir).is_absolute():
        # relative to the spec file's directory, like a compose file's build context; a
        # --set working_dir=... is relative to the current directory
        from_file = args.spec and not any(item.startswith("working_dir=") for item in args.set or [])
        base = Path(args.spec).resolve().parent if from_file else Path.cwd()
        spec = spec.model_copy(update={"working_dir": str((base / spec.working_dir).resolve())})
    if spec.working_dir and not Path(spec.working_dir).is_dir():
        raise ConfigError(f"working_dir {spec.working_dir}: no such directory")
    return spec


def _spec_fields(args: argparse.Namespace):
    from shoal.core.jobspec import load_spec, parse_spec
    from shoal.core.yamlfile import parse_scalar, read_yaml

    name, sets = getattr(args, "name", None), args.set or []
    if args.spec and not name and not sets:
        return load_spec(args.spec)
    if not args.spec and not name:
        raise ConfigError("give a job spec file or --name")
    fields = read_yaml(args.spec, "job spec") if args.spec else {}
    if not isinstance(fields, dict):
        return load_spec(args.spec)  # says what is wrong with the file
    if name:
        fields["name"] = name
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        _set_field(fields, key, parse_scalar(value))
    return parse_spec(fields, f"{args.spec} with --set/--name" if args.spec else "--set options")


def _set_field(fields: dict, key: str, value) -> None:
    """``--set key=value``; a dotted key reaches into a mapping field (``params.lr=1e-3``
    sets ``lr`` of ``params``, keeping its other entries; the mapping is made when absent)."""
    *path, last = key.split(".")
    if not all(path) or not last:
        raise ConfigError(f"--set {key}: an empty name in the dotted key")
    where = fields
    for i, part in enumerate(path):
        inner = where.setdefault(part, {})
        if not isinstance(inner, dict):
            raise ConfigError(f"--set {key}: {'.'.join(path[:i + 1])} is not a mapping")
        where = inner
    where[last] = value


def cmd_status(args: argparse.Namespace) -> int:
    from shoal.events.states import is_terminal
    from shoal.ops.status import format_status, job_status

    with redis_client(start_embedded=False) as client:
        while True:
            s = job_status(client, args.job)
            if args.json:
                print(json.dumps(s, indent=2))
            else:
                if args.watch:
                    print("\033[2J\033[H", end="")
                print(format_status(s))
            if not args.watch or is_terminal(s["state"]):
                return 0
            time.sleep(args.interval)


def cmd_jobs(args: argparse.Namespace) -> int:
    from shoal.ops.status import jobs_overview

    with redis_client(start_embedded=False) as client:
        for job in jobs_overview(client):
            if "error" in job:
                print(f"{job['job_id']:<24} ? ({job['error']})")
            else:
                print(f"{job['job_id']:<24} {job['state']:<10} generation {job['generation']:<4} "
                      f"workers {job['world_size']}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    from shoal.ops.jobs import delete_job, keys_of

    keys_of(args.job)
    with redis_client(start_embedded=False) as client:
        n = delete_job(client, args.job)
    print(f"deleted job {args.job} ({n} keys)")
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    from shoal.events.streams import ControlEntry
    from shoal.ops.jobs import keys_of, require_job
    from shoal.ops.streams import follow, format_decision, last_id, read_range

    keys_of(args.job)
    with redis_client(start_embedded=False) as client:
        keys = require_job(client, args.job, "control")
        last = last_id(client, keys.control)
        for _sid, d in read_range(client, keys.control, ControlEntry, until=last):
            print(format_decision(d))
        if not args.follow:
            return 0
        sys.stdout.flush()
        for entries in follow(client, keys, keys.control, ControlEntry, after=last):
            for _sid, d in entries:
                print(format_decision(d), flush=True)  # --follow ends once the job ended and all is shown
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from shoal.ops.api.serve import serve

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be 0..65535, got {args.port}")
    return serve(host=args.host, port=args.port, token_file=args.token_file)


def cmd_report(args: argparse.Namespace) -> int:
    from shoal.ops.report import write_report

    _job_keys(args.job)
    with redis_client(start_embedded=False) as client:
        marks = write_report(client, args.job, args.output)
    failures = [m for m in marks if m.kind == "failure"]
    changes = [m for m in marks if m.kind != "end"]
    print(f"wrote {args.output}: {len(changes)} generation change(s), {len(failures)} failure(s)"
          + "".join(f"\n  {m.label}" + (f" (recovered in {m.recovery_s:.2f} s)" if m.recovery_s is not None else "")
                    for m in marks))
    return 0


def cmd_chaos(args: argparse.Namespace) -> int:
    from shoal.ops.chaos import ChaosConfig, run_chaos
    from shoal.ops.chaos.netns import NetUnavailable
    from shoal.ops.chaos.network import UNAVAILABLE

    holds = {k: v for k, v in (("min_hold", args.min_hold), ("max_hold", args.max_hold)) if v is not None}
    if args.ha and not args.network:
        raise ConfigError("--ha applies to --network (the local soak always runs Redis under Sentinel)")
    if holds and not args.network:
        raise ConfigError("--min-hold/--max-hold apply to --network only (local faults are not held)")
    cfg = ChaosConfig(duration=args.duration, seed=args.seed, workers=args.workers, steps=args.steps,
                      run_dir=Path(args.run_dir) if args.run_dir else None, network=args.network, ha=args.ha,
                      min_gap=args.min_gap, max_gap=args.max_gap, shard_size=args.shard_size, **holds)
    if cfg.gaps()[0] > cfg.gaps()[1] or cfg.min_hold > cfg.max_hold:
        raise ConfigError(f"a minimum above its maximum: gaps {cfg.gaps()}, holds ({cfg.min_hold:g}, {cfg.max_hold:g})")
    if args.shard_size > 1 and args.network:
        pass  # --workers counts nodes; each runs one replica group
    elif args.shard_size > 1 and args.workers % args.shard_size:
        raise ConfigError(f"--workers ({args.workers}) must be a multiple of --shard-size ({args.shard_size}): whole "
                          "replica groups")
    if args.shard_size > 1 and not args.network and args.workers < 2 * args.shard_size:
        raise ConfigError(f"--shard-size {args.shard_size} needs at least two replica groups: --workers "
                          f"{2 * args.shard_size} or more")
    if args.network and args.workers < 3:
        raise ConfigError(f"--network needs at least 3 worker nodes (--workers), got {args.workers}")
    try:
        verdict = run_chaos(cfg)
    except NetUnavailable as exc:
        print(escape_controls(UNAVAILABLE.format(reason=exc)), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # SIGINT or (with --network) SIGTERM: the soak cleaned up first
        print("shoal chaos: interrupted" + ("; every network namespace it made is removed" if args.network else ""),
              file=sys.stderr)
        return 130
    print(f"\nchaos soak {'PASSED' if verdict.ok else 'FAILED'}")
    return 0 if verdict.ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from shoal.ops.demo import run_demo

    return run_demo(duration=args.duration, epochs=args.epochs, report=args.report or None, ha=args.ha)


def cmd_cluster(args: argparse.Namespace) -> int:
    try:
        from shoal.ops import cluster
    except ImportError as exc:  # pragma: no cover
        raise ConfigError("cluster support is not installed") from exc
    return cluster.cli_validate(args.file) if args.action == "validate" else cluster.cli_show(args.file)


# ---- parser ---------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line (``shoal: ...``) with exit status 2, like every other error."""

    def error(self, message: str):
        self.exit(2, f"shoal: {message} (see '{self.prog} --help')\n")


def _complete_jobs(prefix: str = "", **_kw) -> list[str]:
    """Shell completion of a JOB argument: the registered job ids, from ``REDIS_URL`` or a
    running embedded server (never one started for this), within a second; none when no
    server answers (completion must not hang a shell or print errors)."""
    from shoal.core.registry import list_jobs

    url = url_from_env()
    if url is None:
        port = default_run_dir() / "port"
        if not port.exists():
            return []
        url = f"redis://127.0.0.1:{port.read_text().strip()}/0"
    try:
        client = connect(url, timeout=1.0)
        try:
            return [j for j in list_jobs(client) if j.startswith(prefix)]
        finally:
            client.close()
    except (ShoalError, redis.RedisError, OSError, ValueError):
        return []


def cmd_completion(args: argparse.Namespace) -> int:
    import argcomplete

    print(argcomplete.shellcode(["shoal"], shell=args.shell))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shoal")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The ``shoal`` parser: the root options, then each group of subcommands (the order of
    the groups is the order ``shoal --help`` lists the commands in)."""
    p = _Parser(prog="shoal", description="Elastic, fault-tolerant data-parallel training over Redis.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    p.add_argument("--version", action="version", version=f"shoal {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    _add_run_commands(sub)
    _add_job_commands(sub)
    _add_observe_commands(sub)
    _add_tool_commands(sub)
    _complete_job_arguments(sub)
    return p


_IFACE_HELP = (f"network interface whose address gloo advertises to the peers (default: env {envvars.IFACE}, "
               "else the interface this host reaches Redis through)")


def _add_job_argument(parser: argparse.ArgumentParser) -> None:
    """The positional JOB of a command about one job (completed by :func:`_complete_jobs`)."""
    parser.add_argument("job", help="the job id (its name)")


def _add_spec_options(parser: argparse.ArgumentParser, *, set_help: str) -> None:
    """``--set``, ``--no-validate`` and ``--dry-build``: how ``create`` and ``submit`` build and
    check a spec (:func:`_checked_spec` reads them)."""
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help=set_help)
    parser.add_argument("--no-validate", action="store_true",
                        help="do not import the entrypoint or check S3 settings here (they exist only on the workers)")
    parser.add_argument("--dry-build", action="store_true",
                        help="also call the entrypoint here and check the model, optimizer and dataset it returns")


def _add_run_commands(sub: argparse._SubParsersAction) -> None:
    """Running shoal: coordinator, worker, agent, demo, serve."""
    c = sub.add_parser("coordinator", help="run a coordinator replica (any number may run)")
    c.add_argument("--id", help="replica name (default: random)")
    c.add_argument("--lease-ttl", type=float, default=2.0, help="leadership lease TTL in seconds")
    c.add_argument("--tick", type=float, default=0.1, help="heartbeat scan interval in seconds")
    c.add_argument("--launcher", action=argparse.BooleanOptionalAction, default=True,
                   help="re-enqueue launch units of submitted jobs that lost their node agents (default: on)")
    c.add_argument("--launch-interval", type=float, default=5.0, help="seconds between launcher passes")
    c.add_argument("--launch-cooldown", type=float, default=30.0,
                   help="at most one re-enqueue per job per this many seconds (all replicas together)")
    c.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)")
    c.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics endpoint binds to")
    c.set_defaults(func=cmd_coordinator)

    w = sub.add_parser("worker", help="run one worker process of a job")
    _add_job_argument(w)
    w.add_argument("--node", help="node name reported to the coordinator")
    w.add_argument("--join-timeout", type=float, default=30.0, help="seconds to wait for the join reply (default 30)")
    w.add_argument("--iface", default=None, help=_IFACE_HELP)
    w.set_defaults(func=cmd_worker)

    ag = sub.add_parser("agent", help="run this node's workers of a job, or (--queue) serve the launch queue")
    ag.add_argument("job", nargs="?", help="direct mode: the job to run workers of (omit with --queue)")
    ag.add_argument("--queue", action="store_true",
                    help="run as an RQ worker on the launch queue (also the mode when no JOB is given)")
    ag.add_argument("--burst", action="store_true", help="--queue: exit once the queue is empty")
    ag.add_argument("--name", help="--queue: RQ worker name (default: random)")
    ag.add_argument("--heartbeat", type=_positive_float, default=None, metavar="SECONDS",
                    help="--queue: refresh this agent's registration at least this often "
                         "(default 30; `shoal health agent` reads it)")
    ag.add_argument("--workers", "-n", type=_workers_arg, default=None,
                    help="direct mode: worker processes (default 1), or 'gpu': one per visible GPU, each on its own")
    ag.add_argument("--max-restarts", type=int, default=None, help="default: the job spec's max_restarts")
    ag.add_argument("--backoff", type=float, default=0.5, help="first restart delay; doubles each time")
    ag.add_argument("--backoff-max", type=float, default=30.0, help="longest restart delay (default 30 s)")
    ag.add_argument("--backoff-reset", type=float, default=60.0,
                    help="a worker that ran this long before dying restarts after --backoff again (default 60 s)")
    ag.add_argument("--node", help="node name (default: host name)")
    ag.add_argument("--run-dir", help="where worker logs go (default: $SHOAL_HOME/agent/JOB, with --queue "
                                      "$SHOAL_HOME/agent/JOB/UNIT; SHOAL_HOME defaults to ~/.shoal)")
    ag.add_argument("--iface", default=None, help=f"the workers' --iface: {_IFACE_HELP}")
    ag.set_defaults(func=cmd_agent)

    dm = sub.add_parser("demo", help="embedded Redis + coordinator + 3 workers, with a kill and a join")
    dm.add_argument("--duration", type=float, default=None, help="give up after this many seconds (default 600)")
    dm.add_argument("--epochs", type=int, default=40, help="epochs of the demo job (default 40)")
    dm.add_argument("--report", metavar="PATH", default="report.png",
                    help="write the run's report (shoal report) here at the end ('' : none)")
    dm.add_argument("--ha", action="store_true",
                    help="Redis under Sentinel (a primary, 2 replicas, 3 sentinels) and 2 coordinators; "
                         "the primary is kill -9'd mid-training")
    dm.set_defaults(func=cmd_demo)

    sv = sub.add_parser("serve", help="the HTTP API and the live web dashboard",
                        description="Serve the HTTP API (docs/api.md; OpenAPI at /openapi.json) and the dashboard "
                                    "(at /). Calls that change anything need 'Authorization: Bearer <token>' with the "
                                    f"token from {envvars.API_TOKEN} or --token-file; without one the server is read-only.")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080; 0: any free port)")
    sv.add_argument("--token-file", metavar="PATH",
                    help=f"read the API token from this file's first line (instead of {envvars.API_TOKEN})")
    sv.set_defaults(func=cmd_serve)


def _add_job_commands(sub: argparse._SubParsersAction) -> None:
    """A job's life: create, submit, stop, delete, purge."""
    cr = sub.add_parser("create", help="register a job from a spec file or options (no queue)")
    cr.add_argument("spec", nargs="?", help="job spec YAML")
    cr.add_argument("--name", help="the job's name (overrides the file's)")
    _add_spec_options(cr, set_help="spec field, over the file's if one is given (repeatable; validated like the file; "
                                           "params.NAME=VALUE sets one keyword argument of the entrypoint)")
    cr.set_defaults(func=cmd_create)

    sb = sub.add_parser("submit", help="validate a job spec, register the job and queue its launch units")
    sb.add_argument("spec", help="job spec YAML")
    sb.add_argument("--workers", "-n", type=_positive_int, default=1,
                    help="worker processes per launch unit, i.e. per node agent (default 1)")
    sb.add_argument("--if-absent", action="store_true",
                    help="when a job of that name exists, leave it as it is and exit 0 (a one-shot "
                         "that runs on every start, like compose's submit service)")
    _add_spec_options(sb, set_help="override a spec field of the file (repeatable; validated like the file; "
                                           "params.NAME=VALUE sets one keyword argument of the entrypoint)")
    sb.set_defaults(func=cmd_submit)

    st = sub.add_parser("stop", help="stop a job gracefully (workers see 'stopped' and exit)")
    _add_job_argument(st)
    st.add_argument("--reason", default="stopped by operator", help="recorded as the job's reason")
    st.add_argument("--wait", type=float, metavar="SECONDS", help="wait up to this long for the job to be stopped")
    st.set_defaults(func=cmd_stop)

    d = sub.add_parser("delete", help="remove every key of a job")
    _add_job_argument(d)
    d.set_defaults(func=cmd_delete)

    pg = sub.add_parser("purge", help="delete the keys of finished jobs (checkpoints stay)")
    pg.add_argument("--state", required=True, help="comma-separated: completed, failed, stopped")
    pg.add_argument("--yes", action="store_true", help="really delete (default: list what would go)")
    pg.set_defaults(func=cmd_purge)


def _add_observe_commands(sub: argparse._SubParsersAction) -> None:
    """Watching jobs and services: jobs, status, events, logs, report, health."""
    j = sub.add_parser("jobs", help="list jobs")
    j.set_defaults(func=cmd_jobs)

    s = sub.add_parser("status", help="show a job's state, generation and workers")
    _add_job_argument(s)
    s.add_argument("--json", action="store_true", help="one JSON object (for scripts)")
    s.add_argument("--watch", action="store_true", help="redraw until interrupted")
    s.add_argument("--interval", type=float, default=1.0, help="seconds between redraws with --watch (default 1)")
    s.set_defaults(func=cmd_status)

    e = sub.add_parser("events", help="the coordinator's decisions with their reasons")
    _add_job_argument(e)
    e.add_argument("--follow", "-f", action="store_true", help="wait for new decisions (ends once the job ended)")
    e.set_defaults(func=cmd_events)

    lg = sub.add_parser("logs", help="workers' log lines of a job")
    _add_job_argument(lg)
    lg.add_argument("--worker", "-w", help="only this worker id (e.g. w3)")
    lg.add_argument("--follow", "-f", action="store_true", help="wait for new lines (ends once the job ended)")
    lg.add_argument("--tail", type=int, help="start with the last N lines")
    lg.set_defaults(func=cmd_logs)

    rp = sub.add_parser("report", help="a PNG of a job's loss and throughput with its membership changes")
    _add_job_argument(rp)
    rp.add_argument("-o", "--output", default="report.png", help="PNG file to write (default report.png)")
    rp.set_defaults(func=cmd_report)

    he = sub.add_parser("health", help="probe a coordinator, node agent or Redis: exit 0 when healthy",
                        description="Exit 0 with one line when healthy; otherwise one line naming the cause "
                                    "and exit 1 (unhealthy) or 3 (Redis unreachable). For container probes: "
                                    "see docs/deploy.md.")
    he.add_argument("component", choices=["coordinator", "agent", "redis"], help="what to check")
    he.add_argument("--id", default=None,
                    help="coordinator: the replica's --id (default: this host's name)")
    he.add_argument("--lease-ttl", type=_positive_float, default=2.0,
                    help="coordinator: the replica's --lease-ttl; stale after 3 of them (default 2)")
    he.add_argument("--name", default=None,
                    help="agent: the RQ worker name (default: every queue agent registered from this host)")
    he.add_argument("--max-age", type=_positive_float, default=None, metavar="SECONDS",
                    help="agent: stale when its last heartbeat is older (default 90: three 30 s heartbeats)")
    he.add_argument("--timeout", type=_positive_float, default=2.0, metavar="SECONDS",
                    help="Redis socket timeout (default 2)")
    he.add_argument("--allow-redis-down", action="store_true",
                    help="pass when Redis cannot be reached (liveness probes: a restart would not help)")
    he.set_defaults(func=cmd_health)


def _add_tool_commands(sub: argparse._SubParsersAction) -> None:
    """Data and tools: dataset, cluster, chaos, completion."""
    from shoal.ops.dataset import add_parser as add_dataset_parser

    add_dataset_parser(sub)  # shoal dataset pack|index|info (ops/dataset.py)

    cl = sub.add_parser("cluster", help="validate or show a cluster.yaml")
    cl.add_argument("action", choices=["validate", "show"], help="validate: check the file; show: print what it describes")
    cl.add_argument("file", help="cluster file (YAML), e.g. examples/cluster.yaml")
    cl.set_defaults(func=cmd_cluster)

    ch = sub.add_parser("chaos", help="a job under random faults for a while, then a check of its end state")
    ch.add_argument("--duration", type=_positive_float, default=60.0, help="seconds of fault injection (default 60)")
    ch.add_argument("--seed", type=int, default=1, help="seeds the faults and the job (default 1)")
    ch.add_argument("--workers", type=_positive_int, default=3,
                    help="workers under the node agent (default 3); with --network: worker nodes, one worker each")
    ch.add_argument("--steps", type=_positive_int, default=None, help="job length (default: outlasts --duration)")
    ch.add_argument("--run-dir", help="keep logs, ledgers and checkpoints here (default: a temporary directory)")
    ch.add_argument("--network", action="store_true",
                    help="Redis, coordinators and worker nodes in network namespaces of their own, with network "
                         "faults (partitions, blackholes, delay, loss, link down); needs root, ip and nft")
    ch.add_argument("--min-gap", type=_positive_float, default=None,
                    help="seconds between faults, at least (default 2; --network: 1)")
    ch.add_argument("--max-gap", type=_positive_float, default=None,
                    help="seconds between faults, at most (default 5; --network: 2)")
    ch.add_argument("--min-hold", type=_positive_float, default=None,
                    help="--network: seconds each fault is held before it is healed, at least (default 2)")
    ch.add_argument("--max-hold", type=_positive_float, default=None, help="--network: ... at most (default 5)")
    ch.add_argument("--shard-size", type=_positive_int, default=1,
                    help="elastic HSDP: replica groups of this many workers (default 1: data parallelism); "
                         "--workers must be a multiple of it and hold two groups at least (with --network: each "
                         "worker node runs one group)")
    ch.add_argument("--ha", action="store_true",
                    help="--network: Redis under Sentinel (a data node and a sentinel on each of 3 hosts), with one "
                         "more fault: redis_isolate (the primary, a coordinator and a worker node cut off together)")
    ch.set_defaults(func=cmd_chaos)

    co = sub.add_parser("completion", help="print the shell completion script (bash, zsh or fish)",
                        description="Enable with: eval \"$(shoal completion bash)\" (in ~/.bashrc), "
                                    "shoal completion zsh, or shoal completion fish | source. "
                                    "Completes commands, options and job ids.")
    co.add_argument("shell", choices=["bash", "zsh", "fish"], help="the shell to print the script for")
    co.set_defaults(func=cmd_completion)


def _complete_job_arguments(sub: argparse._SubParsersAction) -> None:
    """argcomplete: every JOB argument (``dest == "job"``, of every command) completes to the
    registered job ids. Call it after every command is added."""
    for action in (a for sp in sub.choices.values() for a in sp._actions if a.dest == "job"):
        action.completer = _complete_jobs


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions (``shoal completion``)
        import argcomplete

        argcomplete.autocomplete(parser)
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except ShoalError as exc:
        # one line whatever it quotes (a newline in a file name given on the command line)
        print(f"shoal: {escape_controls(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except redis.RedisError as exc:
        url = url_from_env()
        where = redact_url(url) if url else "the embedded server"
        print(f"shoal: {escape_controls(f'Redis error talking to {where}: {exc}')}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
