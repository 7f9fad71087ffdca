"""Redis under Sentinel (issue 29, first part): a real HA set of the embedded binary (a primary,
2 replicas, 3 sentinels), ``redis+sentinel://`` URLs, and the writes that must survive a
fail-over confirmed by a replica (``shoal.core.durable``).

- a client from a ``redis+sentinel://`` URL writes, rides out a ``kill -9`` of the primary and
  writes again to the promoted replica; the URL's passwords are redacted;
- a durable write returns once a replica holds it, and fails (NotReplicated, an outage to its
  writer) when no replica confirms it: the replicas frozen, as behind a partition;
- a fenced coordinator write on a primary whose replicas do not answer fails even though the
  primary applied it; on a demoted old primary it is refused (READONLY): a fenced writer never
  gets through either way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import redis

from shoal.coordinator.fenced import FencedBatch, FencedWriter
from shoal.core.connection import connect, redact_url, replicas_to_wait, without_retries
from shoal.core.durable import NotReplicated, confirm
from shoal.core.errors import ConnectionFailed
from shoal.events.keys import job_keys
from shoal.ops.embedded import start_ha

pytestmark = pytest.mark.slow


@pytest.fixture()
def ha(tmp_path):
    with start_ha(tmp_path / "ha", down_after_ms=500) as ha_set:
        yield ha_set


def test_a_sentinel_client_rides_out_the_primarys_death(ha) -> None:
    client = connect(ha.url, ride_out=20)
    assert replicas_to_wait(client) == 1 and replicas_to_wait(without_retries(client)) == 1
    client.set("before", "1")
    confirm(client, "a test write")
    old = ha.kill_primary()
    killed = time.monotonic()
    client.set("after", "2")  # retried until the sentinels promoted a replica
    took = time.monotonic() - killed
    new = ha.primary()
    assert new is not old
    direct = redis.Redis(host="127.0.0.1", port=new.port)
    assert direct.get("before") == b"1" and direct.get("after") == b"2"  # the confirmed write survived
    print(f"kill -9 of the primary -> the next write acknowledged after {took:.2f} s")
    assert took < 10


def test_a_durable_write_fails_when_no_replica_confirms_it(ha) -> None:
    client = connect(ha.url)
    primary = ha.primary()
    replicas = [n for n in ha.nodes if n is not primary]
    with ha.frozen(replicas):
        client.set("k", "v")  # the primary acknowledges it...
        started = time.monotonic()
        with pytest.raises(NotReplicated, match="0 of 1 replica"):
            confirm(client, "the test's write", timeout_ms=300)  # ...but nothing confirms it
        assert 0.25 <= time.monotonic() - started < 3
    confirm(client, "the test's write")  # replicas back: confirmed


def test_a_fenced_write_never_gets_through_a_cut_off_or_demoted_primary(ha) -> None:
    client = connect(ha.url)
    keys = job_keys("fence")
    client.set(keys.lease, "me")
    client.set(keys.epoch, "1")
    confirm(client, "setup")
    writer = FencedWriter(client, keys, "me", 1)
    writer.commit(FencedBatch(keys).add("SET", keys.base + ":x", "1"))  # replicated: fine
    old = ha.primary()
    with ha.frozen([n for n in ha.nodes if n is not old]):
        with pytest.raises(NotReplicated):
            writer.commit(FencedBatch(keys).add("SET", keys.base + ":x", "2"))
    # the old primary dies, a replica is promoted, the old one comes back as a replica
    old.kill()
    new = ha.wait_failover(old)
    assert new is not old
    from shoal.ops.embedded import start_server

    back = start_server(old.run_dir, port=old.port, appendonly=False,
                        extra=["--replicaof", "127.0.0.1", str(new.port)])
    try:
        demoted = redis.Redis(host="127.0.0.1", port=back.port)
        deadline = time.monotonic() + 30
        while demoted.info("replication").get("master_link_status") != "up":  # synced: the lease reads "me"
            assert time.monotonic() < deadline, f"the old primary never synced: {demoted.info('replication')}"
            time.sleep(0.05)
        assert demoted.get(keys.lease) == b"me"
        stale = FencedWriter(demoted, keys, "me", 1)
        with pytest.raises(redis.ReadOnlyError):
            stale.commit(FencedBatch(keys).add("SET", keys.base + ":x", "3"))
        assert redis.Redis(host="127.0.0.1", port=new.port).get(keys.base + ":x") != b"3"
    finally:
        back.stop()


def test_sentinel_urls_are_checked_and_redacted() -> None:
    url = "redis+sentinel://user:s3cret@h1:26379,h2:26380/shoal/0?sentinel_password=other"
    shown = redact_url(url)
    assert "s3cret" not in shown and "other" not in shown and "h1:26379,h2:26380/shoal/0" in shown
    for bad, why in (("redis+sentinel://h1/shoal", "not host:port"), ("redis+sentinel://h1:1/", "/<service>"),
                     ("redis+sentinel://h1:1/shoal/x", "/<service>"),
                     ("redis+sentinel://h1:1/shoal?ssl=1", "unknown parameter")):
        with pytest.raises(ConnectionFailed, match=why):
            connect(bad)
    with pytest.raises(ConnectionFailed, match="cannot reach Redis"):
        connect("redis+sentinel://127.0.0.1:1/shoal", timeout=0.5)


def _health(url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal", "health", "redis"], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, REDIS_URL=url))


def test_shoal_health_redis_reports_the_sentinel_view(ha) -> None:
    ok = _health(ha.url)
    primary = ha.primary()
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert (f"healthy under Sentinel: primary 127.0.0.1:{primary.port} (AOF off), 2 replica(s) in sync, "
            f"3 of 3 sentinel(s) answer, quorum 2") in ok.stdout
    for node in ha.replicas():
        node.kill()
    bad = _health(ha.url)
    assert bad.returncode != 0 and "0 replica(s) in sync" in bad.stdout + bad.stderr
    assert "no replica in sync, durable writes would fail" in bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr
