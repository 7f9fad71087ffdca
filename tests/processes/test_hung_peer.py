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
import torch

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger
from shoal.worker.runner import collective_timeout
from tests.helpers import ControlWatcher, dump_logs, wait_until

pytestmark = pytest.mark.slow
DIGITS = 5000


def test_survivors_abort_their_collective_with_a_frozen_peer_at_once(r, redis_url, tmp_path) -> None:
    job = "hung-" + tmp_path.name[-6:]
    spec = JobSpec(name=job, entrypoint="tests.entrypoints:slow_digits", global_batch_size=64, max_steps=200,
                   epochs=3, min_workers=2, max_workers=3, heartbeat_interval=0.2, heartbeat_ttl=1.0, step_timeout=20.0)
    create_job(r, spec)
    watch = ControlWatcher(r, job)
    env = {"SHOAL_TEST_STEP_DELAY": "0.03", "SHOAL_LEDGER_DIR": str(tmp_path / "ledger"),
           "SHOAL_EXPORT_DIR": str(tmp_path / "final")}
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        agent = procs.start("agent", "agent", job, "--workers", "3", "--max-restarts", "0",
                            "--run-dir", str(tmp_path / "agent"))
        try:
            watch.wait_for(lambda d: "world size 3 (w0, w1, w2)" in d["reason"], 60)
            wait_until(lambda: len(ledger.read(tmp_path / "ledger")) >= 30, 60, "30 committed steps")
            pid = watch.workers()["w1"]["pid"]
            stopped = time.time()
            os.kill(pid, signal.SIGSTOP)
            try:
                failed = watch.wait_for(lambda d: "w1 failed" in d["reason"], 30)
                assert "no heartbeat for" in failed["reason"], failed["reason"]
                new_gen = int(re.search(r"generation (\d+): world size 2 \(w0, w2\)", failed["reason"]).group(1))

                def survivors_went_on():
                    after = [e for e in ledger.read(tmp_path / "ledger") if e["generation"] >= new_gen]
                    return min((e["t"] for e in after), default=None)

                first = wait_until(survivors_went_on, 30, "a committed step of the survivors' new generation")
            finally:
                os.kill(pid, signal.SIGCONT)
            watch.wait_for(lambda d: d["job_state"] == "completed", 180)
            assert agent.wait(60) == 0
        except BaseException:
            dump_logs(procs, tmp_path / "agent")
            raise
    recovered = first - stopped
    print(f"\nSIGSTOP of w1 -> survivors' first committed step of generation {new_gen}: {recovered:.2f} s "
          f"(TTL {spec.heartbeat_ttl:g} s; collective timeout {collective_timeout(spec):g} s)")
    assert recovered < collective_timeout(spec)  # the abort, not the collective timeout, freed them
    logs = {f.name: f.read_text() for f in (tmp_path / "agent").glob("*.log")}
    survivors = [text for text in logs.values() if "joined job" in text and "as w1\n" not in text]
    assert len(survivors) == 2
    for text in survivors:
        assert re.search(rf"aborting generation \d+'s collectives: generation {new_gen} evicted w1", text), text[-2000:]
        assert re.search(rf"aborted in generation \d+: step aborted, nothing applied: all_reduce: aborted "
                         rf"\(generation {new_gen} evicted w1\)", text), text[-2000:]
    assert "died with" not in (tmp_path / "logs" / "agent.log").read_text()  # nobody exited early
    entries = ledger.read(tmp_path / "ledger")
    verdict = ledger.verify(entries, DIGITS)
    assert verdict.ok, verdict.problem
    pids: dict[str, set[int]] = {}
    for e in entries:
        pids.setdefault(e["worker"], set()).add(e["pid"])
    assert len(pids["w0"]) == len(pids["w2"]) == 1
    rejoined = [w for w in pids if w not in ("w0", "w1", "w2")]
    assert rejoined and all(pids[w] == pids["w1"] for w in rejoined)  # thawed: same process, new id
    finals = [torch.load(p, weights_only=True) for p in sorted((tmp_path / "final").glob("final-*.pt"))]
    assert len(finals) == 3 and all(torch.equal(finals[0][k], f[k]) for f in finals[1:] for k in finals[0])
