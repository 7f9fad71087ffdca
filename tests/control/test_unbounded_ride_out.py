"""The queue agent's RQ client (``connect(url, ride_out=math.inf)``, issue 35) waits out a
Redis that refuses connections, a primary's name that does not resolve and a server that
comes back, for as long as it takes, where a bounded ride-out would raise: real sockets, a
real name lookup and the embedded server."""

from __future__ import annotations

import math
import threading

import pytest
import redis

from shoal.core.connection import connect
from shoal.ops.embedded import free_port, start_server
from tests.helpers import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def retries(monkeypatch) -> list[int]:
    """Every backoff a redis-py retry computes in this test (each is one retry)."""
    from redis.backoff import ExponentialBackoff

    seen: list[int] = []
    compute = ExponentialBackoff.compute
    monkeypatch.setattr(ExponentialBackoff, "compute", lambda self, failures: (seen.append(failures),
                                                                                compute(self, failures))[1])
    return seen


def _call(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_refused_connection_is_waited_out_until_the_server_is_up(tmp_path, retries) -> None:
    port = free_port()
    client = connect(f"redis://127.0.0.1:{port}/0", ride_out=math.inf, check=False, timeout=1.0)
    thread, out = _call(lambda: client.set("k", "v"))
    # more retries than a bounded ride-out of 1 s would make (1 / 1 s cap + 5), none raised
    wait_until(lambda: len(retries) >= 7 or out, 30, "seven retries of a refused connection")
    assert not out and thread.is_alive()
    server = start_server(tmp_path / "redis", port=port, appendonly=False)
    try:
        thread.join(30)
        assert out == {"value": True}
        assert redis.Redis(port=port).get("k") == b"v"
    finally:
        server.kill()


def test_a_name_that_does_not_resolve_is_retried_not_raised(retries) -> None:
    client = connect("redis://shoal-no-such-primary.invalid:6379/0", ride_out=math.inf, check=False, timeout=1.0)
    thread, out = _call(client.ping)
    wait_until(lambda: len(retries) >= 3 or out, 60, "three retries of a failed name lookup")
    assert not out and thread.is_alive()
    for conn in list(client.connection_pool._in_use_connections):  # end it: the next failure is raised
        conn.retry.update_retries(0)
    thread.join(30)
    assert isinstance(out.get("error"), redis.ConnectionError), out
