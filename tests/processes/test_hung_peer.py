"""A hung peer (SIGSTOP) is evicted by its heartbeat TTL and the survivors abort their
all-reduce with it at once (issue 13), instead of sitting in it until the collective timeout.

Three workers under a node agent that may restart nobody; one is frozen mid-training. The
coordinator declares it failed after the TTL and publishes a table naming it ``evicted``;
each survivor's watcher thread aborts the group it shares with the frozen peer, the step in
flight is dropped (nothing applied), and the survivors go on in the new generation with the
same processes. The frozen worker, thawed, commits nothing of its old generation, finds
itself evicted and rejoins with its state as a new member. The job completes with every step
and sample exactly once and the replicas bit-identical.

How fast is measured by ``bench/elastic_bench.py`` (recovery after SIGSTOP vs 1.2 x TTL);
here the test asserts the mechanism: the survivors' step failed by an abort naming the
eviction, not by gloo's timeout, and their first step of the new generation came before the
collective timeout would have fired.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from shoal.core.jobspec import JobSpec
from shoal.worker import ledger
from shoal.worker.runner import collective_timeout
from tests.helpers import ControlWatcher, wait_until
from tests.processes.three_workers import pids_by_worker, run_three_workers, wait_three_committed_together

pytestmark = pytest.mark.slow
SPEC = dict(max_steps=200, epochs=3, heartbeat_ttl=1.0, step_timeout=20.0)


def test_survivors_abort_their_collective_with_a_frozen_peer_at_once(r, redis_url, tmp_path) -> None:
    seen: dict[str, float | int] = {}

    def freeze_w1(watch: ControlWatcher) -> None:
        wait_three_committed_together(tmp_path / "ledger", 30)
        pid = watch.workers()["w1"]["pid"]
        seen["stopped"] = time.time()
        os.kill(pid, signal.SIGSTOP)
        try:
            failed = watch.wait_for(lambda d: "w1" in d.failed, 30)
            assert "no heartbeat for" in failed.reason, failed.reason
            assert failed.world_size == 2 and failed.removed == ("w1",)
            gen = failed.generation

            def survivors_went_on():
                return min((e["t"] for e in ledger.read(tmp_path / "ledger") if e["generation"] >= gen), default=None)

            seen["first"] = wait_until(survivors_went_on, 30, "a committed step of the survivors' new generation")
            seen["generation"] = gen
        finally:
            os.kill(pid, signal.SIGCONT)

    entries = run_three_workers(r, redis_url, tmp_path, "hung-" + tmp_path.name[-6:], freeze_w1, steps=200,
                                step_delay=0.03, **{k: v for k, v in SPEC.items() if k != "max_steps"})
    spec = JobSpec(name="x", entrypoint="simulate", **SPEC)
    new_gen, recovered = seen["generation"], seen["first"] - seen["stopped"]
    print(f"\nSIGSTOP of w1 -> survivors' first committed step of generation {new_gen}: {recovered:.2f} s "
          f"(TTL {spec.heartbeat_ttl:g} s; collective timeout {collective_timeout(spec):g} s)")
    assert recovered < collective_timeout(spec)  # the abort, not the collective timeout, freed them
    logs = {f.name: f.read_text() for f in (tmp_path / "agent").glob("*.log")}
    survivors = [text for text in logs.values() if "joined job" in text and "as w1\n" not in text]
    assert len(survivors) == 2
    for text in survivors:
        assert re.search(rf"aborting generation \d+'s collectives: generation {new_gen} evicted w1", text), text[-2000:]
        assert re.search(rf"aborted in generation \d+: step aborted, nothing applied: all_reduce[^:]*: aborted "
                         rf"\(generation {new_gen} evicted w1\)", text), text[-2000:]
    pids = pids_by_worker(entries)
    assert len(pids["w0"]) == len(pids["w2"]) == 1
    rejoined = [w for w in pids if w not in ("w0", "w1", "w2")]
    assert rejoined and all(pids[w] == pids["w1"] for w in rejoined)  # thawed: same process, new id
