"""The pure verdicts behind ``shoal health``: a coordinator replica judged from the
``shoal:coordinators`` registry with Redis time passed in, a queue node agent from its RQ
worker hashes with the clock and the pid check passed in."""

from __future__ import annotations

import datetime as dt

from shoal.ops.health import judge_agent, judge_coordinator

LEASE_MS = 2000


def test_coordinator_fresh_leader_and_standby_are_healthy():
    reg = {b"coord-a:u1": b"10000:2", b"coord-b:u2": b"10500:0"}
    leader = judge_coordinator(reg, 11000, "coord-a", LEASE_MS)
    standby = judge_coordinator(reg, 11000, "coord-b", LEASE_MS)
    assert leader.healthy and "leader of 2 jobs" in leader.reason and "1.0 s ago" in leader.reason
    assert standby.healthy and "standby" in standby.reason


def test_coordinator_stale_entry_names_its_age():
    v = judge_coordinator({b"coord-a:u1": b"1000:1"}, 1000 + 3 * LEASE_MS + 1, "coord-a", LEASE_MS)
    assert not v.healthy
    assert "6.0 s ago" in v.reason and "hung, stopped or cut off" in v.reason


def test_coordinator_newest_entry_of_a_restarted_replica_counts():
    # the killed predecessor's entry is stale, the restarted process's is fresh
    reg = {b"coord-a:old": b"1000:1", b"coord-a:new": b"9000:0"}
    assert judge_coordinator(reg, 9500, "coord-a", LEASE_MS).healthy


def test_coordinator_missing_or_other_replica_only():
    v = judge_coordinator({b"coord-ab:u": b"1000:0", b"x:coord-a": b"1000:0"}, 1000, "coord-a", LEASE_MS)
    assert not v.healthy and "no entry" in v.reason and "--id coord-a" in v.reason and "hung or exited" in v.reason
    assert not judge_coordinator({}, 0, "c", LEASE_MS).healthy


NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def _beat(seconds_ago: float) -> str:
    return (NOW - dt.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _worker(host: str, pid: int, ago: float, **extra) -> dict:
    return {"hostname": host, "pid": str(pid), "last_heartbeat": _beat(ago), "state": "idle", **extra}


def test_agent_of_this_host_fresh_is_healthy_others_ignored():
    workers = {"a1": _worker("node-1", 10, 5), "b1": _worker("node-2", 11, 500)}
    v = judge_agent(workers, NOW, host="node-1", name=None, max_age_s=90, pid_runs=lambda pid: True)
    assert v.healthy and "a1 idle" in v.reason and "5.0 s ago" in v.reason
    v = judge_agent(workers, NOW, host="node-2", name=None, max_age_s=90, pid_runs=lambda pid: True)
    assert not v.healthy and "500.0 s ago" in v.reason and "hung or stopped" in v.reason


def test_agent_dead_pid_leftover_is_ignored_for_a_live_successor():
    workers = {"old": _worker("pod", 7, 1), "new": _worker("pod", 8, 2)}
    v = judge_agent(workers, NOW, host="pod", name=None, max_age_s=90, pid_runs=lambda pid: pid == 8)
    assert v.healthy and "new" in v.reason
    v = judge_agent({"old": workers["old"]}, NOW, host="pod", name=None, max_age_s=90, pid_runs=lambda pid: False)
    assert not v.healthy and "pid 7, which no longer runs" in v.reason


def test_agent_by_name_and_none_registered():
    workers = {"a1": _worker("elsewhere", 10, 1)}
    assert judge_agent(workers, NOW, host="pod", name="a1", max_age_s=90, pid_runs=lambda pid: True).healthy
    v = judge_agent(workers, NOW, host="pod", name=None, max_age_s=90, pid_runs=lambda pid: True)
    assert not v.healthy and "no worker registered" in v.reason


def test_agent_registered_death_or_unreadable_heartbeat():
    dead = judge_agent({"a": _worker("h", 1, 1, death="x")}, NOW, host="h", name=None, max_age_s=90,
                       pid_runs=lambda pid: True)
    assert not dead.healthy and "no longer runs" in dead.reason
    bad = judge_agent({"a": {"hostname": "h", "pid": "1", "last_heartbeat": "garbage"}}, NOW, host="h", name=None,
                      max_age_s=90, pid_runs=lambda pid: True)
    assert not bad.healthy and "never (unreadable)" in bad.reason
