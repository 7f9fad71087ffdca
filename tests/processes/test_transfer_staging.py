"""Point-to-point transfers staged through host memory (worker/process_group.py).

gloo's send and receive take host memory only (a CUDA tensor failed with ``writev ... Bad
address`` on the H100, crashing the join's state transfer); its collectives take CUDA
tensors. So with a gloo group and a model on a GPU, :func:`isend`, :func:`recv` and
:func:`recv_many` copy through host buffers. Here, on the CPU, two real processes in a real
gloo group stage *every* tensor (the predicate is forced, so the host-copy path runs), and a
joiner catches up from the other (model, optimizer, extras) bit-identically. The GPU check
(``scripts/gpu_check.py``) runs the real CUDA case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow


def _child(rank: int, job: str) -> None:
    from shoal.core.connection import connect
    from shoal.worker import process_group as pg
    from shoal.worker.digest import state_digest
    from shoal.worker.transfer import catch_up_state

    torch.set_num_threads(1)
    staged = []
    real = pg._host_copy

    def counting(tensor, *, fill=True):
        staged.append("send" if fill else "recv")
        return real(tensor, fill=fill)

    pg.Group._through_host = lambda self, tensor: True  # as for CUDA tensors in a gloo group
    pg._host_copy = counting
    torch.manual_seed(rank)  # different weights: the joiner's are replaced
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if rank == 0:  # the member ahead: some steps, so the optimizer holds state
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    client = connect(os.environ["REDIS_URL"], timeout=10)
    rendezvous = pg.Rendezvous(client, job, backend="gloo")
    group = rendezvous.join(1, rank, 2, 60, collective_timeout=60)
    try:
        _src, got, behind = catch_up_state(model, opt, {"step": 3 if rank == 0 else 0, "cursor": 7 * (rank == 0)},
                                           3 if rank == 0 else 0, group=group)
        group.all_reduce(torch.zeros(1))  # as the first step's: the sender's posted sends are reaped
    finally:
        rendezvous.close_joined()
    exp_avg = [float(s["exp_avg"].abs().sum()) for s in opt.state.values()]
    print("RESULT " + json.dumps({"digest": state_digest(model), "got": got, "behind": list(behind),
                                  "staged": staged, "exp_avg": exp_avg}), flush=True)


def test_a_catch_up_staged_through_host_memory_is_bit_identical(job_id, subprocess_env) -> None:
    env = dict(subprocess_env, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", __name__, str(r), job_id], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1][7:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    ahead, joiner = results
    assert joiner["behind"] == [1] and joiner["got"]["step"] == 3 and joiner["got"]["cursor"] == 7
    assert joiner["digest"] == ahead["digest"]
    assert joiner["exp_avg"] == ahead["exp_avg"] and all(v > 0 for v in joiner["exp_avg"])
    # every point-to-point transfer went through a host buffer: sends on one side, receives on the other
    assert ahead["staged"] and set(ahead["staged"]) == {"send"}
    assert joiner["staged"] and set(joiner["staged"]) == {"recv"}


if __name__ == "__main__":
    _child(int(sys.argv[1]), sys.argv[2])
