"""A node agent waits out a Redis outage longer than its client's ride-out (real server, real
worker processes): its workers keep their processes, and the job completes once Redis is back.
Before, the agent's loop raised the Redis error and the agent exited after 60 s of outage."""

from __future__ import annotations

import threading

import pytest
import redis

from shoal.core.connection import connect
from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.ops.embedded import start_server
from shoal.ops.localproc import LocalProcs
from shoal.worker.agent import NodeAgent
from tests.helpers import ControlWatcher, dump_logs, wait_until

pytestmark = pytest.mark.slow


def test_an_agent_waits_out_a_redis_outage_and_its_worker_is_kept(tmp_path) -> None:
    server = start_server(tmp_path / "redis", appendonly=True, fsync="always")
    job = "outage-" + tmp_path.name[-6:]
    client = redis.Redis.from_url(server.url, socket_timeout=10)
    spec = JobSpec(name=job, entrypoint="simulate", simulate_step_time=0.02, max_steps=400,
                   min_workers=1, max_workers=1, heartbeat_interval=0.2, heartbeat_ttl=5.0)
    create_job(client, spec)
    watch = ControlWatcher(client, job)
    result: dict = {}
    try:
        with LocalProcs(server.url, tmp_path / "logs") as procs:
            procs.coordinator("coord")
            # the agent's own client rides out only 0.3 s: the outage below outlasts it
            agent = NodeAgent(connect(server.url, ride_out=0.3, timeout=1.0), server.url, job, 1,
                              run_dir=tmp_path / "agent", max_restarts=0, backoff=0.2, spec=spec)
            runner = threading.Thread(target=lambda: result.setdefault("rc", agent.run()), daemon=True)
            runner.start()
            try:
                watch.wait_for(lambda d: "active in generation" in d.reason, 60)
                pid = agent.slots[0].proc.pid
                server.kill()
                wait_until(lambda: agent.redis_outages >= 1 or not runner.is_alive(), 30,
                           "the agent to notice the outage past its ride-out")
                assert runner.is_alive(), "the agent's loop ended during the outage"
                assert agent.slots[0].proc is not None and agent.slots[0].proc.pid == pid
                server = start_server(server.run_dir, port=server.port, appendonly=True, fsync="always")
                client = redis.Redis.from_url(server.url, socket_timeout=10)
                ControlWatcher(client, job).wait_for(lambda d: d.job_state == "completed", 120)
                runner.join(60)
            except BaseException:
                dump_logs(procs, tmp_path / "agent")
                agent.stop.set()
                raise
    finally:
        server.kill()
    assert result.get("rc") == 0
    slot = agent.slots[0]
    assert slot.restarts == 0 and len(slot.spawns) == 1, "the worker process was not kept"
    assert agent.redis_outages == 1
