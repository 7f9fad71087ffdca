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

from shoal.connection import connect, redact_url, url_from_env
from shoal.embedded import default_run_dir, ensure_server
from shoal.errors import ConfigError, ConnectionFailed, ShoalError

log = logging.getLogger("shoal.cli")


@contextlib.contextmanager
def redis_client(*, start_embedded: bool) -> Iterator[redis.Redis]:
    """A client for ``REDIS_URL``, or for the embedded server (started if allowed)."""
    url = url_from_env()
    server = None
    if url is None:
        run_dir = default_run_dir()
        if not start_embedded and not (run_dir / "port").exists():
            raise ConnectionFailed(f"REDIS_URL is not set and no embedded server runs in {run_dir}")
        server = ensure_server(run_dir)
        url = server.url
        if server.owned:
            log.info("started embedded Redis at %s (AOF in %s)", url, run_dir)
    client = connect(url)
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


def cmd_coordinator(args: argparse.Namespace) -> int:
    from coordinator.loop import Coordinator

    stop = threading.Event()
    _stop_on_signals(stop)
    with redis_client(start_embedded=True) as client:
        coord = Coordinator(client, instance_id=args.id, lease_ttl=args.lease_ttl, tick_interval=args.tick)
        log.info("coordinator %s serving (lease ttl %.1fs)", coord.instance_id, args.lease_ttl)
        coord.run(stop)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from shoal.jobspec import JobSpec
    from events.keys import job_keys
    from worker.membership import Membership, MembershipError
    from worker.simulated import SimulatedWorker

    with redis_client(start_embedded=False) as client:
        raw = client.get(job_keys(args.job).spec)
        if raw is None:
            raise MembershipError(f"job {args.job!r} does not exist")
        spec = JobSpec.from_stored(raw)
        membership = Membership(client, args.job, node=args.node or "")
        if spec.entrypoint != "simulate":
            from worker.training import TrainingWorker  # the elastic training runtime

            runner = TrainingWorker(membership, spec, join_timeout=args.join_timeout)
        else:
            runner = SimulatedWorker(membership, spec, join_timeout=args.join_timeout)
        signal.signal(signal.SIGTERM, lambda *_: runner.stop.set())
        signal.signal(signal.SIGINT, lambda *_: runner.stop.set())
        return runner.run()


def cmd_agent(args: argparse.Namespace) -> int:
    from events.keys import job_keys
    from shoal.jobspec import JobSpec
    from worker.agent import NodeAgent

    with redis_client(start_embedded=False) as client:
        raw = client.get(job_keys(args.job).spec)
        if raw is None:
            raise ConfigError(f"job {args.job!r} does not exist")
        spec = JobSpec.from_stored(raw)
        url = url_from_env() or f"redis://127.0.0.1:{client.connection_pool.connection_kwargs['port']}/0"
        run_dir = Path(args.run_dir or default_run_dir().parent / "agent" / args.job)
        agent = NodeAgent(client, url, args.job, args.workers, run_dir=run_dir,
                          max_restarts=spec.max_restarts if args.max_restarts is None else args.max_restarts,
                          backoff=args.backoff, node=args.node)
        signal.signal(signal.SIGTERM, lambda *_: agent.stop.set())
        signal.signal(signal.SIGINT, lambda *_: agent.stop.set())
        return agent.run()


def cmd_create(args: argparse.Namespace) -> int:
    from shoal.jobs import create_job
    from shoal.jobspec import load_spec, parse_spec

    if args.spec:
        spec = load_spec(args.spec)
        if args.name:
            spec = parse_spec({**spec.model_dump(mode="json"), "name": args.name}, args.spec)
    else:
        if not args.name:
            raise ConfigError("give a job spec file or --name")
        fields = {"name": args.name}
        for item in args.set or []:
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"--set expects key=value, got {item!r}")
            fields[key] = _yaml_scalar(value)
        spec = parse_spec(fields, "--set options")
    with redis_client(start_embedded=True) as client:
        create_job(client, spec)
    print(spec.name)
    return 0


def _yaml_scalar(text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def cmd_status(args: argparse.Namespace) -> int:
    from shoal.status import format_status, job_status

    with redis_client(start_embedded=False) as client:
        while True:
            s = job_status(client, args.job)
            if args.json:
                print(json.dumps(s, indent=2))
            else:
                if args.watch:
                    print("\033[2J\033[H", end="")
                print(format_status(s))
            if not args.watch or s["state"] in ("completed", "failed", "stopped"):
                return 0
            time.sleep(args.interval)


def cmd_jobs(args: argparse.Namespace) -> int:
    from shoal.jobs import list_jobs
    from shoal.status import job_status

    with redis_client(start_embedded=False) as client:
        for jid in list_jobs(client):
            try:
                s = job_status(client, jid)
                print(f"{jid:<24} {s['state']:<10} generation {s['generation']:<4} workers {s['world_size']}")
            except ShoalError as exc:
                print(f"{jid:<24} ? ({exc})")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    from shoal.jobs import delete_job

    with redis_client(start_embedded=False) as client:
        n = delete_job(client, args.job)
    print(f"deleted job {args.job} ({n} keys)")
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    from events.keys import job_keys

    keys = job_keys(args.job)
    with redis_client(start_embedded=False) as client:
        last = "0-0"
        while True:
            resp = client.xread({keys.control: last}, count=500, block=1000 if args.follow else None)
            for _s, entries in resp or []:
                for sid, f in entries:
                    last = sid.decode()
                    d = {k.decode(): v.decode() for k, v in f.items()}
                    ts = time.strftime("%H:%M:%S", time.localtime(int(d.get("ts_ms", 0)) / 1000))
                    print(f"{ts} gen {d.get('generation', '?'):>3} {d.get('job_state', ''):<9} [{d.get('kind', '')}] {d.get('reason', '')}")
            if not args.follow and not resp:
                return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from shoal.demo import run_demo

    return run_demo(duration=args.duration, epochs=args.epochs)


def cmd_cluster(args: argparse.Namespace) -> int:
    try:
        from shoal import cluster
    except ImportError as exc:  # pragma: no cover
        raise ConfigError("cluster support is not installed") from exc
    return cluster.cli_validate(args.file) if args.action == "validate" else cluster.cli_show(args.file)


# ---- parser ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shoal", description="Elastic, fault-tolerant data-parallel training over Redis.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("coordinator", help="run a coordinator replica (any number may run)")
    c.add_argument("--id", help="replica name (default: random)")
    c.add_argument("--lease-ttl", type=float, default=2.0, help="leadership lease TTL in seconds")
    c.add_argument("--tick", type=float, default=0.1, help="heartbeat scan interval in seconds")
    c.set_defaults(func=cmd_coordinator)

    w = sub.add_parser("worker", help="run one worker process of a job")
    w.add_argument("job")
    w.add_argument("--node", help="node name reported to the coordinator")
    w.add_argument("--join-timeout", type=float, default=30.0)
    w.set_defaults(func=cmd_worker)

    ag = sub.add_parser("agent", help="run and supervise this node's worker processes of a job")
    ag.add_argument("job")
    ag.add_argument("--workers", "-n", type=int, default=1)
    ag.add_argument("--max-restarts", type=int, default=None, help="default: the job spec's max_restarts")
    ag.add_argument("--backoff", type=float, default=0.5, help="first restart delay; doubles each time")
    ag.add_argument("--node", help="node name (default: host name)")
    ag.add_argument("--run-dir", help="where worker logs go (default: ~/.shoal/agent/JOB)")
    ag.set_defaults(func=cmd_agent)

    cr = sub.add_parser("create", help="register a job from a spec file or options (no queue)")
    cr.add_argument("spec", nargs="?", help="job spec YAML")
    cr.add_argument("--name")
    cr.add_argument("--set", action="append", metavar="KEY=VALUE", help="spec field (repeatable)")
    cr.set_defaults(func=cmd_create)

    s = sub.add_parser("status", help="show a job's state, generation and workers")
    s.add_argument("job")
    s.add_argument("--json", action="store_true")
    s.add_argument("--watch", action="store_true")
    s.add_argument("--interval", type=float, default=1.0)
    s.set_defaults(func=cmd_status)

    j = sub.add_parser("jobs", help="list jobs")
    j.set_defaults(func=cmd_jobs)

    d = sub.add_parser("delete", help="remove every key of a job")
    d.add_argument("job")
    d.set_defaults(func=cmd_delete)

    e = sub.add_parser("events", help="the coordinator's decisions with their reasons")
    e.add_argument("job")
    e.add_argument("--follow", "-f", action="store_true")
    e.set_defaults(func=cmd_events)

    dm = sub.add_parser("demo", help="embedded Redis + coordinator + 3 workers, with a kill and a join")
    dm.add_argument("--duration", type=float, default=None, help="give up after this many seconds (default 600)")
    dm.add_argument("--epochs", type=int, default=8)
    dm.set_defaults(func=cmd_demo)

    cl = sub.add_parser("cluster", help="validate or show a cluster.yaml")
    cl.add_argument("action", choices=["validate", "show"])
    cl.add_argument("file")
    cl.set_defaults(func=cmd_cluster)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except ShoalError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return exc.exit_code
    except redis.RedisError as exc:
        url = url_from_env()
        where = redact_url(url) if url else "the embedded server"
        print(f"shoal: Redis error talking to {where}: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
