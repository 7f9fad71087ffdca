"""Joining a job whose model and optimizer state is over 1 GB (issue 17): real processes,
real gloo, real Redis.

The model is one parameter of 2^27 float32 (512 MiB) trained with SGD momentum, so a member's
state is 1 GiB. A first worker trains alone; a second one starts after its second step, joins,
and receives the whole state point to point (in pieces of ``CHUNK_BYTES``, with the transfer's
size-scaled timeout, not the collective one). Both must then hold the same parameters - and
the same momentum, or their next updates would differ. Memory: two workers, each holding
parameters, gradients, momentum and (the joiner) the received copy, well under CI's 24 GiB.

Also, cheaply: the pieces path of catch-up and broadcast with a tiny ``CHUNK_BYTES``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import run_ranks

pytestmark = pytest.mark.slow

N = 2**27  #: parameters: 512 MiB of float32; with SGD momentum the state is 1 GiB
STEPS = 6
GATE_ENV = "SHOAL_TEST_GATE"  #: a file the first worker's third step waits for
_forwards = 0


def _gate() -> None:
    """The third forward pass of the process waits for the gate file (the first worker's step
    3, so that the second one joins after step 2 and before the job is over)."""
    global _forwards
    _forwards += 1
    gate = os.environ.get(GATE_ENV)
    if gate and _forwards == 3:
        deadline = time.monotonic() + 600
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)


class OneBigParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _gate()
        # every element gets a gradient (and so momentum); the first 8 a data-dependent one
        return x @ self.w[:8] + 1e-6 * self.w.sum()


def build():
    from shoal.worker.userapi import TrainingSetup

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, generator=g)
    model = OneBigParameter()
    return TrainingSetup(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                         dataset=torch.utils.data.TensorDataset(x, y),
                         loss_fn=lambda out, target: ((out - target) ** 2).sum())


def _peak_rss(pid: int) -> int:
    """VmHWM of ``pid`` in bytes (0 once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    m = re.search(r"^VmHWM:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else 0


def test_a_joiner_receives_a_one_gigabyte_state_and_trains_on_identically(r, redis_url, tmp_path) -> None:
    from shoal.core.jobspec import JobSpec
    from shoal.core.registry import create_job
    from shoal.ops.localproc import LocalProcs
    from shoal.worker import ledger
    from tests.helpers import ControlWatcher, wait_until

    job = "big-" + tmp_path.name[-8:]
    create_job(r, JobSpec(name=job, entrypoint=f"{__name__}:build", global_batch_size=4, max_steps=STEPS,
                          min_workers=1, max_workers=2, heartbeat_interval=0.5, heartbeat_ttl=5.0, step_timeout=300))
    watch = ControlWatcher(r, job)
    gate = tmp_path / "gate"
    env = {"SHOAL_LEDGER_DIR": str(tmp_path / "ledger"), GATE_ENV: str(gate), "OMP_NUM_THREADS": "1"}
    peaks: dict[str, int] = {}
    done = threading.Event()

    def sample(procs) -> None:  # peak memory of each worker, until they end
        while not done.is_set():
            for p in list(procs.procs):
                if p.role == "worker":
                    peaks[p.name] = max(peaks.get(p.name, 0), _peak_rss(p.pid))
            done.wait(0.2)

    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        sampler = threading.Thread(target=sample, args=(procs,), daemon=True)
        sampler.start()
        try:
            procs.coordinator("coord")
            first = procs.worker(job, "first")
            wait_until(lambda: any(e["step"] >= 2 for e in ledger.read(tmp_path / "ledger")), 180,
                       "the first worker's step 2")
            joiner = procs.worker(job, "joiner")
            watch.wait_for(lambda d: d.world_size == 2, 180)
            gate.touch()  # the first worker finishes step 3 alone, then switches
            watch.wait_for(lambda d: d.job_state == "completed", 300)
            codes = {p.name: p.wait(120) for p in (first, joiner)}
        except BaseException:
            for p in procs.procs:
                print(f"===== {p.name}\n{p.log_tail(40)}")
            raise
        finally:
            done.set()
            sampler.join(5)
    assert codes == {"first": 0, "joiner": 0}
    logs = {p.name: p.log_path.read_text(errors="replace") for p in procs.procs}
    # the generation with the joiner started from one state: the first worker's after step 3
    starts = {name: re.findall(r"generation (\d+): rank (\d)/2, step (\d+), cursor \d+, digest (\w+) "
                               r"\(switch ([\d.]+)s; state from rank 0 to \[1\]\)", text)
              for name, text in logs.items() if name in codes}
    (gen, rank, step, digest, took), = starts["joiner"]
    # step 3, or 4 when the step after the gate had begun before the new table was seen
    assert rank == "1" and 3 <= int(step) < STEPS
    assert (gen, "0", step, digest) in [s[:4] for s in starts["first"]]
    # then steps together: bit-identical parameters, so the momentum came along too
    finals = {name: json.loads(re.findall(r"finished: (\{.*\})", logs[name])[-1]) for name in codes}
    assert finals["first"]["step"] == finals["joiner"]["step"] == STEPS
    assert finals["first"]["digest"] == finals["joiner"]["digest"]
    steps = sorted(e["step"] for e in ledger.read(tmp_path / "ledger") if e["worker"] == "w0")
    assert steps == list(range(1, STEPS + 1))
    # 1 GiB of state: parameters, gradients, momentum, the joiner's received copy (no third)
    assert all(0 < peak < 6 * 2**30 for peak in peaks.values()), peaks
    print(f"joiner's switch (rendezvous + 1 GiB transfer + load): {float(took):.2f} s; peak RSS "
          + ", ".join(f"{n} {v / 2**30:.2f} GiB" for n, v in sorted(peaks.items())))


# --- the pieces path of catch-up and broadcast, cheaply: CHUNK_BYTES of 64 ---------------------
def _pieces_child(rank: int, job: str) -> None:
    from shoal.core.connection import connect
    from shoal.worker import process_group as pg
    from shoal.worker import transfer
    from shoal.worker.digest import state_digest

    transfer.CHUNK_BYTES = 64  # every tensor over 16 float32 goes in pieces
    torch.manual_seed(rank)  # different weights on each rank
    model = nn.Sequential(nn.Linear(10, 30), nn.Linear(30, 2))
    model.register_buffer("mask", torch.rand(40) > 0.5)  # bool: sent as uint8
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if rank == 0:  # the source has momentum; the joiner none
        model(torch.ones(3, 10)).sum().backward()
        opt.step()
    rendezvous = pg.Rendezvous(connect(os.environ["REDIS_URL"], timeout=10), job)
    group = rendezvous.join(1, rank, 2, 60, collective_timeout=3)
    src, extra, behind = transfer.catch_up_state(model, opt, {"step": 4 if rank == 0 else -1}, 4 if rank == 0 else -1,
                                                 group=group)
    momentum = [opt.state[p]["momentum_buffer"].tolist() for p in model.parameters()]
    out = {"src": src, "behind": behind, "extra": extra, "digest": state_digest(model), "momentum": momentum,
           "mask": model.mask.tolist(), "timeout": group.timeout,
           "bound": transfer.transfer_timeout(transfer.state_bytes(model, opt))}
    with torch.no_grad():  # rank 1 moves away; a broadcast from rank 0 brings it back
        if rank == 1:
            for p in model.parameters():
                p.add_(1.0)
    got = transfer.broadcast_state(model, opt, {"again": 1}, 0, group=group)
    out.update(after_broadcast=state_digest(model), broadcast_extra=got)
    rendezvous.close_joined()
    print("RESULT " + json.dumps(out), flush=True)


def test_large_tensors_move_in_pieces_and_the_receiver_waits_with_the_transfer_timeout(job_id, subprocess_env) -> None:
    results = run_ranks(__name__, "pieces", 2, job_id, subprocess_env)
    source, joiner = results
    assert source["behind"] == joiner["behind"] == [1] and joiner["extra"] == {"step": 4}
    for key in ("digest", "momentum", "mask", "after_broadcast"):
        assert joiner[key] == source[key], key
    assert joiner["broadcast_extra"] == {"again": 1}
    # the joiner's group waited with the transfer's timeout (30 s + size), not its 3 s one
    assert joiner["timeout"] >= source["bound"] > 3


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "pieces":
        _pieces_child(int(sys.argv[2]), sys.argv[3])
    else:
        sys.exit("usage: test_large_join.py pieces RANK JOB_ID")
