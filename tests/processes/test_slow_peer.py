"""A slow peer is waited for; a stuck one is evicted by the step timeout (issue 13).

One of three workers sleeps mid-step while its heartbeats go on
(``SHOAL_FAULTS=w1@usr1:mid_step:sleep=S``, armed by SIGUSR1 once all three have committed a
step together). Liveness (the heartbeat TTL), progress (the job's
``step_timeout``) and collectives are separate: a collective is never the failure detector.

* Sleeping 4 s - longer than the heartbeat TTL, far shorter than the step timeout - the peers
  simply wait in their all-reduce, as DDP does: no failed step, no new generation, nobody
  declared failed, no process exits. (Before issue 13 the peers' 3 s collective timeout fired,
  every worker exited, and the agents' replacements committed steps a second time.)
* Sleeping past a 3 s step timeout, the coordinator evicts the sleeper with a reason naming
  the step timeout; the survivors abort their all-reduce with it at once and go on in a new
  generation with the same processes; the sleeper, when it wakes, commits nothing, and
  rejoins with its state as a new member.

Both runs complete with every step and sample exactly once and the replicas bit-identical.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers import ControlWatcher
from tests.processes.three_workers import pids_by_worker, run_three_workers, slow_down

pytestmark = pytest.mark.slow


def test_a_peer_slower_than_the_heartbeat_ttl_is_waited_for_without_any_failure(r, redis_url, tmp_path) -> None:
    job = "slow-" + tmp_path.name[-6:]
    seen: list[ControlWatcher] = []

    def stall(watch: ControlWatcher) -> None:
        seen.append(watch)
        slow_down(watch, tmp_path / "ledger")

    # 120 steps: the stall comes once the three committed together, which a slow starter delays
    entries = run_three_workers(r, redis_url, tmp_path, job, stall, faults="w1@usr1:mid_step:sleep=4", steps=120,
                                epochs=2)
    reasons = [d.reason for d in seen[0].seen]
    three = next(i for i, x in enumerate(reasons) if "world size 3 (w0, w1, w2)" in x)
    # nobody failed, and the generation of three went on through the stall: no later plan
    assert not [x for x in reasons if " failed" in x], reasons
    assert not [x for x in reasons[three + 1:] if "generation " in x and "world size" in x], reasons
    assert {e["worker"] for e in entries} == {"w0", "w1", "w2"}
    assert len({e["pid"] for e in entries}) == 3  # one process each, all through the job
    agent_log = "".join(f.read_text() for f in (tmp_path / "agent").glob("*.log"))
    assert len(re.findall(r"fault injected: sleep=4 at w1@usr1:mid_step \(step \d+\)", agent_log)) == 1


def test_a_step_stuck_past_the_step_timeout_evicts_that_worker_and_the_others_go_on(r, redis_url, tmp_path) -> None:
    job = "stuck-" + tmp_path.name[-6:]

    tables = []

    def evicted(watch: ControlWatcher) -> None:
        slow_down(watch, tmp_path / "ledger")
        d = watch.wait_for(lambda d: "w1" in d.failed, 60)
        assert "w1 failed (rank 1): step timeout: its step has been busy for" in d.reason, d.reason
        assert "(step_timeout 3 s) while its heartbeat is alive" in d.reason
        assert d.world_size == 2
        tables.append(watch.table())

    # the sleeper wakes 2 s after its eviction, while the others still have ~100 steps to go
    entries = run_three_workers(r, redis_url, tmp_path, job, evicted, faults="w1@usr1:mid_step:sleep=5", steps=150,
                                epochs=2, step_timeout=3.0)
    assert tables[0].evicted == ["w1"]
    pids = pids_by_worker(entries)
    # the survivors kept their processes; the sleeper committed nothing after its stuck step
    # and rejoined with the same process under a new id
    assert len(pids["w0"]) == len(pids["w2"]) == 1
    worker_logs = "".join(f.read_text() for f in (tmp_path / "agent").glob("*.log"))
    stuck = int(re.search(r"fault injected: sleep=5 at w1@usr1:mid_step \(step (\d+)\)", worker_logs).group(1))
    assert max(e["step"] for e in entries if e["worker"] == "w1") <= stuck
    rejoined = [w for w in pids if w not in ("w0", "w1", "w2")]
    assert len(rejoined) == 1 and pids[rejoined[0]] == pids["w1"]
    assert "declared failed by the coordinator while alive" in worker_logs
    assert re.search(r"aborting generation \d+'s collectives: generation \d+ evicted w1", worker_logs)
