"""Health checks for process probes (``shoal health coordinator|agent|redis``).

Neither the coordinator nor the node agent serves HTTP, and both already publish a
registration in Redis that the other parts of shoal trust; a probe reads the same facts,
so "healthy" means exactly what the rest of the system assumes:

* **coordinator** (``shoal coordinator --id NAME``): every lease refresh (every third of the
  lease TTL, leader or standby alike) writes ``"<Redis ms>:<jobs led>"`` under the replica's
  token ``NAME:<uuid>`` in ``shoal:coordinators`` (``coordinator/balance.py``). The replica
  NAME is healthy when its newest entry is younger than ``STALE_LEASES`` lease TTLs of Redis
  server time, the rule by which the other replicas count it live. A standby (leading no
  job) is healthy. A hung, stopped or killed process stops refreshing and turns unhealthy
  after that age.
* **agent** (``shoal agent --queue``, an RQ worker on the launch queue): RQ keeps the
  worker's hash ``rq:worker:<name>`` with ``hostname``, ``pid`` and ``last_heartbeat``
  (refreshed every ``--heartbeat`` seconds, idle or busy; see ``ops/launch.py``). The
  agents registered from this host (``hostname`` equal to ours, or the one named with
  ``--name``) are looked at: an entry whose pid no longer runs here belongs to a dead
  process and is ignored; the agent is healthy when a live one heartbeated within
  ``--max-age`` seconds (by the agent's own clock: same host).
* **redis**: the server answers PING within the timeout and accepts our credentials.

Each check connects with a short socket timeout (``--timeout``), so a blackholed Redis
fails the probe within it. When Redis cannot be reached the check fails with exit status 3
(naming the redacted URL and the cause), unless ``allow_redis_down`` is given: then it
passes, saying it could not judge. That is for liveness probes: restarting a process
because Redis is down cures nothing (it rides the outage out and reloads from Redis), and
crash-loop backoff would delay its recovery once Redis is back.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
from dataclasses import dataclass

import redis

from shoal.coordinator.balance import STALE_LEASES, parse_registry
from shoal.core.errors import ShoalError
from shoal.events.keys import COORDINATORS, LAUNCH_QUEUE
from shoal.core.procs import pid_runs


class Unhealthy(ShoalError):
    """The process a probe looks at is not healthy; the message says why (exit status 1)."""

    exit_code = 1


@dataclass(frozen=True)
class Verdict:
    """A check's outcome: ``healthy`` and one line saying why."""

    healthy: bool
    reason: str


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def judge_coordinator(registry: dict, now_ms: int, instance_id: str, lease_ms: int) -> Verdict:
    """Pure: is replica ``instance_id`` live in a ``shoal:coordinators`` HGETALL read at Redis
    time ``now_ms``? Tokens are ``<instance id>:<uuid>``; the newest entry of the replica
    counts (a restarted process leaves its predecessor's entry behind until it goes stale)."""
    live, stale = parse_registry(registry, now_ms, lease_ms)
    mine = [rep for rep in live if rep.token.rpartition(":")[0] == instance_id]
    limit_s = STALE_LEASES * lease_ms / 1000
    if mine:
        rep = max(mine, key=lambda rep: rep.seen_ms)
        role = f"leader of {rep.leads} job{'s' if rep.leads != 1 else ''}" if rep.leads else "standby (leads no job)"
        return Verdict(True, f"coordinator {instance_id}: healthy, {role}; "
                             f"last lease refresh {max(0, now_ms - rep.seen_ms) / 1000:.1f} s ago")
    old = []
    for token in stale:
        if token.rpartition(":")[0] != instance_id:
            continue
        seen = _text(registry.get(token.encode(), registry.get(token, ""))).partition(":")[0]
        if seen.isdigit():
            old.append(int(seen))
    if old:
        return Verdict(False, f"coordinator {instance_id}: last lease refresh {(now_ms - max(old)) / 1000:.1f} s ago, "
                              f"over {STALE_LEASES} lease TTLs ({limit_s:g} s): the process is hung, stopped or "
                              "cut off from Redis")
    return Verdict(False, f"coordinator {instance_id}: no entry in {COORDINATORS} refreshed within {limit_s:g} s "
                          f"(not started yet, hung or exited - the other replicas remove stale entries - "
                          f"or not run with --id {instance_id})")




def _heartbeat_time(raw: str) -> _dt.datetime | None:
    """RQ's ``utcformat`` (``%Y-%m-%dT%H:%M:%S.%fZ``) as an aware datetime; None if unreadable."""
    try:
        return _dt.datetime.strptime(raw.rstrip("Z"), "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=_dt.timezone.utc)
    except ValueError:
        try:
            return _dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
        except ValueError:
            return None


def judge_agent(workers: dict[str, dict], now: _dt.datetime, *, host: str, name: str | None, max_age_s: float,
                pid_runs=pid_runs) -> Verdict:
    """Pure but for ``pid_runs``: is an agent of this host (or the one named ``name``) live?

    ``workers`` maps RQ worker names to their hashes (decoded ``str`` fields). Entries of
    another host are ignored (unless named); an entry whose ``pid`` does not run here is a
    dead process's leftover; a live one must have heartbeated within ``max_age_s``."""
    if name is not None:
        mine = {n: w for n, w in workers.items() if n == name}
        who = f"agent {name}"
    else:
        mine = {n: w for n, w in workers.items() if w.get("hostname") == host}
        who = f"agent on host {host}"
    if not mine:
        return Verdict(False, f"{who}: no worker registered on RQ queue {LAUNCH_QUEUE} "
                              "(not started yet, exited, or its registration expired)")
    dead, stale, fresh = [], [], []
    for n, w in sorted(mine.items()):
        pid = int(w["pid"]) if str(w.get("pid", "")).isdigit() else None
        if "death" in w or (pid is not None and not pid_runs(pid)):
            dead.append((n, pid))
            continue
        beat = _heartbeat_time(w.get("last_heartbeat", ""))
        age = (now - beat).total_seconds() if beat is not None else float("inf")
        (fresh if age <= max_age_s else stale).append((n, age, w.get("state", "?")))
    if fresh:
        n, age, state = min(fresh, key=lambda item: item[1])
        return Verdict(True, f"{who}: healthy, RQ worker {n} {state}; last heartbeat {max(0.0, age):.1f} s ago")
    if stale:
        n, age, _state = min(stale, key=lambda item: item[1])
        ago = f"{age:.1f} s ago" if age != float("inf") else "never (unreadable)"
        return Verdict(False, f"{who}: RQ worker {n} last heartbeat {ago}, over {max_age_s:g} s: "
                              "the process is hung or stopped")
    n, pid = dead[0]
    return Verdict(False, f"{who}: RQ worker {n} was registered by pid {pid}, which no longer runs")


def check_coordinator(client: redis.Redis, instance_id: str, lease_ttl: float) -> Verdict:
    """:func:`judge_coordinator` on the live registry and Redis server time."""
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.hgetall(COORDINATORS)
    (sec, usec), registry = pipe.execute()
    return judge_coordinator(registry, int(sec) * 1000 + int(usec) // 1000, instance_id, int(lease_ttl * 1000))


def check_agent(client: redis.Redis, *, name: str | None, max_age_s: float, host: str | None = None) -> Verdict:
    """:func:`judge_agent` on the RQ workers registered on the launch queue."""
    from rq.worker import Worker
    from rq.worker_registration import get_keys  # RQ owns its key names

    from shoal.coordinator.launcher import launch_queue

    keys = sorted(_text(k) for k in get_keys(launch_queue(client)))
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hgetall(key)
    workers = {}
    for key, raw in zip(keys, pipe.execute() if keys else []):
        if raw:
            workers[key.removeprefix(Worker.redis_worker_namespace_prefix)] = {_text(k): _text(v) for k, v in raw.items()}
    return judge_agent(workers, _dt.datetime.now(_dt.timezone.utc), host=host or socket.gethostname(), name=name,
                       max_age_s=max_age_s)


def check_redis(client: redis.Redis) -> Verdict:
    """PING, then the server's role and whether AOF is on (informational). Under Sentinel
    (a ``redis+sentinel://`` URL) the sentinels' view too: the primary, its replicas in sync,
    the sentinels and the quorum; unhealthy when no replica is in sync (durable writes, which
    wait for one, would all fail) or the sentinels cannot reach a quorum."""
    client.ping()
    info = client.info("persistence")
    aof = "AOF on" if str(info.get("aof_enabled", "0")) == "1" else "AOF off"
    replication = client.info("replication")
    role = replication.get("role", "?")
    pool = client.connection_pool
    if not hasattr(pool, "sentinel_manager"):
        return Verdict(True, f"redis: healthy ({role}, {aof})")
    return _sentinel_verdict(pool.sentinel_manager, pool.service_name, replication, aof)


def _sentinel_verdict(manager, service: str, replication: dict, aof: str) -> Verdict:
    host, port = manager.discover_master(service)
    in_sync = sum(1 for k, v in replication.items() if k.startswith("slave") and isinstance(v, dict)
                  and v.get("state") == "online")
    views = []
    for sentinel in manager.sentinels:
        try:
            views.append(sentinel.sentinel_master(service))
        except redis.RedisError:
            continue
    if not views:
        return Verdict(False, f"redis: no sentinel of service {service} answers")
    quorum = int(views[0].get("quorum", 0))
    ok_quorum = len(views) >= quorum
    text = (f"primary {host}:{port} ({aof}), {in_sync} replica(s) in sync, {len(views)} of "
            f"{int(views[0].get('num-other-sentinels', 0)) + 1} sentinel(s) answer, quorum {quorum}")
    if in_sync == 0:
        return Verdict(False, f"redis: {text}: no replica in sync, durable writes would fail")
    if not ok_quorum:
        return Verdict(False, f"redis: {text}: fewer sentinels than the quorum, no fail-over possible")
    return Verdict(True, f"redis: healthy under Sentinel: {text}")
