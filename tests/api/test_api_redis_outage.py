"""``shoal serve`` through a Redis restart (a server of this test's own, killed and started
again on the same port): an open event stream says ``unavailable`` and closes (a browser
reconnects with Last-Event-ID), ``/health`` and every read are 503 with one line while Redis
is down, and everything answers again once it is back, without restarting the API."""

from __future__ import annotations

import threading

import httpx
import pytest
import redis

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.ops.embedded import start_server
from shoal.ops.localproc import LocalProcs
from tests.api.conftest import start_serve
from tests.helpers import wait_until

pytestmark = pytest.mark.slow


def test_a_redis_restart_is_503_then_served_again(tmp_path, job_id) -> None:
    server = start_server(tmp_path / "redis", appendonly=True, fsync="always")
    try:
        with redis.Redis.from_url(server.url, socket_timeout=5) as r:
            create_job(r, JobSpec(name=job_id, entrypoint="simulate"))
        with LocalProcs(server.url, tmp_path / "logs", extra_env={"SHOAL_HOME": str(tmp_path / "home")}) as procs:
            _proc, base = start_serve(procs, "serve")
            http = httpx.Client(base_url=base, timeout=30)
            assert http.get("/health").status_code == 200 and http.get(f"/jobs/{job_id}").status_code == 200
            got: list[str] = []
            opened = threading.Event()

            def follow() -> None:
                with httpx.stream("GET", f"{base}/jobs/{job_id}/logs/stream", timeout=60) as resp:
                    opened.set()
                    for line in resp.iter_lines():
                        got.append(line)

            reader = threading.Thread(target=follow, daemon=True)
            reader.start()
            assert opened.wait(30)
            wait_until(lambda: any(line.startswith("retry:") for line in got), 10, "the stream to start")
            server.kill()
            reader.join(30)
            assert not reader.is_alive(), got
            assert "event: unavailable" in got, got
            assert any(line.startswith("data:") and "Redis unavailable" in line for line in got)
            for path in ("/health", "/jobs", f"/jobs/{job_id}"):
                resp = http.get(path)
                assert resp.status_code == 503 and "\n" not in resp.json()["detail"], (path, resp.text)
            assert http.get("/health/live").status_code == 200
            server = start_server(tmp_path / "redis", port=server.port, appendonly=True, fsync="always")
            wait_until(lambda: http.get("/health").status_code == 200, 30, "/health to answer 200 again")
            assert http.get(f"/jobs/{job_id}").json()["job_id"] == job_id
            http.close()
    finally:
        server.stop()
