"""``shoal health`` as a container probe runs it: a separate process against a real Redis,
looking at a real coordinator replica and a real queue node agent. Healthy -> exit 0 (a
standby replica too); a stopped (SIGSTOP) or killed process -> exit 1 naming the cause;
Redis gone -> exit 3 naming it, or 0 with ``--allow-redis-down`` (liveness probes)."""

from __future__ import annotations

import signal

import pytest
import redis

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.ops.embedded import start_server
from shoal.ops.localproc import LocalProcs
from tests.helpers import run_cli, wait_until

pytestmark = pytest.mark.slow

LEASE = "0.5"  # lease TTL of the replicas and of the check: stale after 1.5 s


def _health(env, *args):
    return run_cli(env, "health", *args, "--timeout", "1", timeout=30)


def _until(env, args, rc, what, timeout=20.0):
    """Run the check until it exits ``rc``; that run's result."""
    return wait_until(lambda: (p := _health(env, *args)).returncode == rc and p, timeout, what, interval=0.2)


def test_coordinators_and_agent_probed_through_their_redis_registration(tmp_path):
    password = "probe-secret-0123456789"
    server = start_server(tmp_path / "redis", appendonly=False, password=password)
    try:
        url = f"redis://default:{password}@127.0.0.1:{server.port}/0"
        with LocalProcs(url, tmp_path / "logs", extra_env={"SHOAL_HOME": str(tmp_path / "home")}) as procs:
            env = procs.env()
            a = procs.coordinator("coord-a", "--lease-ttl", LEASE, "--no-launcher")
            b = procs.coordinator("coord-b", "--lease-ttl", LEASE, "--no-launcher")
            agent = procs.start("agent", "agent", "--queue", "--heartbeat", "1", "--name", "probe-agent")
            create_job(redis.Redis.from_url(url, socket_timeout=10), JobSpec(name="probed", entrypoint="simulate", min_workers=1, max_workers=1))

            # healthy: one replica leads the job, the other is a standby; both pass
            coord_a = ["coordinator", "--id", "coord-a", "--lease-ttl", LEASE]
            coord_b = ["coordinator", "--id", "coord-b", "--lease-ttl", LEASE]
            first = _until(env, coord_a, 0, "coord-a healthy")
            second = _until(env, coord_b, 0, "coord-b healthy")
            roles = first.stdout + second.stdout
            assert "leader of 1 job" in roles and "standby (leads no job)" in roles, roles
            ok = _until(env, ["agent", "--max-age", "3"], 0, "the agent healthy")
            assert "probe-agent idle" in ok.stdout
            assert _health(env, "redis").returncode == 0

            # a hung replica (SIGSTOP) stops refreshing its registration: unhealthy, exit 1
            a.signal(signal.SIGSTOP)
            bad = _until(env, coord_a, 1, "coord-a unhealthy while stopped")
            # (stale, or already removed from the registry by the other replica)
            assert "coordinator coord-a:" in bad.stderr and ("hung, stopped" in bad.stderr or "hung or exited" in bad.stderr)
            assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
            assert _health(env, *coord_b).returncode == 0  # the other replica is unaffected
            a.signal(signal.SIGCONT)
            _until(env, coord_a, 0, "coord-a healthy again after SIGCONT")

            # a hung agent stops heartbeating; a killed one leaves a registration whose pid is gone
            agent.signal(signal.SIGSTOP)
            bad = _until(env, ["agent", "--max-age", "3"], 1, "the agent unhealthy while stopped")
            assert "probe-agent last heartbeat" in bad.stderr and "hung or stopped" in bad.stderr
            agent.signal(signal.SIGKILL)
            agent.wait(10)
            bad = _health(env, "agent", "--name", "probe-agent", "--max-age", "60")
            assert bad.returncode == 1 and "no longer runs" in bad.stderr, bad.stderr

            # a killed replica: unhealthy within three lease TTLs
            b.signal(signal.SIGKILL)
            b.wait(10)
            bad = _until(env, coord_b, 1, "coord-b unhealthy once killed")
            assert "coord-b" in bad.stderr

            # Redis gone: exit 3 naming it (password redacted); liveness mode passes
            server.stop()
            for component in (coord_a, ["agent"], ["redis"]):
                down = _health(env, *component)
                assert down.returncode == 3, down.stderr
                assert "cannot reach Redis" in down.stderr and password not in down.stderr + down.stdout
                assert down.stderr.count("\n") == 1 and "Traceback" not in down.stderr
            live = _health(env, *coord_a, "--allow-redis-down")
            assert live.returncode == 0 and "not judged" in live.stdout and password not in live.stdout
    finally:
        server.stop()
