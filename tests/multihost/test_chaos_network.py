"""``shoal chaos --network`` through the CLI, as an operator runs it.

- The 60-second soak: Redis, two coordinators and three worker nodes, each its own network
  namespace, under a seeded cycle of network faults (partitions two-way and one-way, a node
  cut off from Redis, Redis blackholed, 20 ms delay, 5 % loss, a link down, the leading
  coordinator cut off from Redis); it must pass its verdict (job completed, every sample once,
  replicas bit-identical and close to a failure-free run, every fault survived, no failure
  without a fault) with every kind injected, and leave no namespace behind. Judged on the
  summary it writes and on what it prints, never on timings.
- SIGTERM in the middle of the soak: it exits, and every namespace it made is gone.
- Where namespaces cannot be made (here: no ``ip`` on PATH) it says why in one line and exits
  non-zero, with no traceback (this one runs anywhere).

Then one test per network fault kind of the registry (ops/chaos/kinds.py): what the kind does
to real namespaces, through the network soak's injector, on a job's records in the session's
Redis. A new network kind adds its test here.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys

import pytest

from shoal.events.keys import job_keys
from shoal.events.records import WorkerRecord
from shoal.events.states import WorkerState
from shoal.ops.chaos.kinds import Soak
from shoal.ops.chaos.netns import ETC_NETNS, namespaces, unavailable_reason
from shoal.ops.chaos.network import NetInjector
from tests.helpers import ROOT, run_cli, wait_until

#: the first line names the namespaces it makes: ``(shn<pid>-*)``
TAG = re.compile(r"network namespace \((shn\d+)-\*\)")


def _needs_namespaces() -> None:
    reason = unavailable_reason(faults=True)
    if reason:
        pytest.skip(f"shoal chaos --network cannot run here: {reason}")


def _env(tmp_path) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", SHOAL_HOME=str(tmp_path / "home"))
    env.pop("REDIS_URL", None)  # the soak starts its own Redis, in a namespace
    return env


def _left(tag: str) -> list[str]:
    return [n for n in namespaces() if n.startswith(tag + "-")] + [p.name for p in ETC_NETNS.glob(tag + "-*")]


@pytest.mark.slow
def test_sixty_seconds_of_network_chaos_pass_with_every_fault_kind(tmp_path) -> None:
    _needs_namespaces()
    run_dir = tmp_path / "run"
    # held 2-3 s, 1-1.5 s apart: the nine kinds of the first shuffled cycle all fit in 60 s
    done = run_cli(_env(tmp_path), "chaos", "--network", "--duration", "60", "--seed", "7", "--run-dir", str(run_dir),
                   "--min-hold", "2", "--max-hold", "3", "--min-gap", "1", "--max-gap", "1.5", timeout=900)
    report = done.stdout + done.stderr
    print(report)
    tag = TAG.search(done.stdout)
    assert tag, report
    assert not _left(tag.group(1)), "namespaces left behind"
    summary = json.loads((run_dir / "summary.json").read_text())
    failed = [f"{c['name']}: {c['detail']}" for c in summary["checks"] if not c["ok"]]
    assert summary["ok"] and not failed, failed
    assert done.returncode == 0 and "chaos soak PASSED" in done.stdout, report
    assert set(summary["faults"]) == set(Soak.NETWORK.kinds)
    for kind, n in summary["faults"].items():
        assert n["injected"] >= 1 and n["survived"] == n["injected"], (kind, n)
        assert re.search(rf"^{kind} +{n['injected']} +{n['survived']}$", done.stdout, re.M), kind  # the table


@pytest.mark.slow
@pytest.mark.soak  # ~3 min; the default suite keeps under 15 min (tests/multihost/test_redis_partition.py is there)
def test_network_chaos_under_sentinel_isolates_the_primary_and_passes(tmp_path) -> None:
    _needs_namespaces()
    run_dir = tmp_path / "run"
    done = run_cli(_env(tmp_path), "chaos", "--network", "--ha", "--duration", "120", "--seed", "3", "--run-dir",
                   str(run_dir), "--min-hold", "3", "--max-hold", "6", timeout=1200)
    report = done.stdout + done.stderr
    print(report)
    summary = json.loads((run_dir / "summary.json").read_text())
    failed = [f"{c['name']}: {c['detail']}" for c in summary["checks"] if not c["ok"]]
    assert summary["ok"] and not failed, failed
    assert set(summary["faults"]) == set(Soak.HA.kinds)
    isolated = summary["faults"]["redis_isolate"]
    assert isolated["injected"] >= 1 and isolated["survived"] == isolated["injected"], isolated
    assert "Redis under Sentinel" in done.stdout and "chaos soak PASSED" in done.stdout, report


@pytest.mark.slow
@pytest.mark.soak  # ~25 s; the default suite keeps under 15 min (the fixtures' clean-up is covered there)
def test_sigterm_in_the_middle_of_the_soak_removes_every_namespace(tmp_path) -> None:
    _needs_namespaces()
    proc = subprocess.Popen([sys.executable, "-m", "shoal", "chaos", "--network", "--duration", "60", "--run-dir",
                             str(tmp_path / "run")], env=_env(tmp_path), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:  # until the first fault is injected (or the soak ends)
            lines.append(line)
            if re.match(r"^ +\d+\.\d s  [a-z_0-9]+ ", line):
                break
        tag = TAG.search("".join(lines))
        assert tag, "".join(lines)
        assert _left(tag.group(1)), "the soak made no namespaces"
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    report = "".join(lines) + rest
    assert proc.returncode != 0, report
    assert "Traceback" not in report, report
    assert not _left(tag.group(1)), report


def test_where_namespaces_cannot_be_made_it_says_why_in_one_line(tmp_path) -> None:
    env = dict(_env(tmp_path), PATH=str(tmp_path / "empty"))  # no 'ip' (nor 'nft') to be found
    done = run_cli(env, "chaos", "--network", "--duration", "60", timeout=60)
    assert done.returncode != 0
    assert done.stdout == ""
    line = done.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, done.stderr
    assert line.startswith("shoal chaos --network: needs root with ip and nft (network namespaces): ")
    assert "not root" in line or "'ip'" in line, line


# ---- one test per network fault kind -------------------------------------------------------

PORT = 7000
LISTEN = ("import socket,sys\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
          "s.bind((sys.argv[1],int(sys.argv[2])))\ns.listen()\nwhile True:\n c,_=s.accept()\n c.close()\n")


@pytest.mark.slow
def test_node_link_down_pulls_the_cable_of_a_node_another_active_worker_spares(net, r, job_id) -> None:
    nodes = [net.add_host("n1"), net.add_host("n2")]
    keys = job_keys(job_id)
    for i, node in enumerate(nodes):  # an Active worker on each node: either may be cut off
        record = WorkerRecord(worker_id=f"w{i}", state=WorkerState.ACTIVE, node=node.name)
        r.hset(keys.workers, f"w{i}", record.to_json())
        node.popen(f"listen-{node.name}", [sys.executable, "-c", LISTEN, node.ip, str(PORT)])
    wait_until(lambda: nodes[0].can_connect(nodes[1].ip, PORT) and nodes[1].can_connect(nodes[0].ip, PORT), 10,
               "both listeners to accept")
    injector = NetInjector(net, r, keys, nodes, None, {}, hold_range=(2.0, 3.0))
    assert injector.allowed("node_link_down")

    fault = injector.inject("node_link_down", random.Random(1))
    (cut,) = fault.nodes
    other = next(n for n in nodes if n.name != cut)
    assert fault.target == f"{cut} link down" and 2.0 <= fault.hold <= 3.0 and injector.current is fault
    assert not other.can_connect(net.hosts[cut].ip, PORT)
    injector.heal()
    assert injector.current is None and fault.healed >= fault.t
    wait_until(lambda: other.can_connect(net.hosts[cut].ip, PORT), 10, f"{cut}'s link to come back")
