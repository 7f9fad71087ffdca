"""A joiner whose catch-up source is killed (SIGKILL) mid-transfer still joins (issue 38).

Real Redis, real worker processes, real gloo. The source is killed at a deterministic point of
the transfer: ``SHOAL_FAULTS=*@usr1:transfer:kill`` arms, with one SIGUSR1 sent to the source
only, a kill at its next catch-up once the joiner has the state's header and none of its
tensors (``core/faults.py``, phase ``transfer``).
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from pathlib import Path

import pytest

from shoal.core.registry import create_job
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger
from tests.helpers import ControlWatcher, dump_logs, job_spec, wait_until

pytestmark = pytest.mark.slow

DIGITS = 5000
H = 6
BATCH = 48
KILL_SOURCE = "*@usr1:transfer:kill"


def _diloco(name: str, rounds: int, **fields):
    return job_spec(name, dict(entrypoint="tests.entrypoints:diloco_digits", global_batch_size=BATCH,
                               max_steps=rounds, sync="diloco", diloco={"inner_steps": H},
                               loader_workers=0, prefetch_steps=0), **fields)


def _entries(tmp_path: Path) -> list[dict]:
    return ledger.read(tmp_path / "ledger") if (tmp_path / "ledger").exists() else []


def test_diloco_joiner_whose_only_source_dies_mid_transfer_resumes_from_the_checkpoint(r, redis_url, tmp_path) -> None:
    rounds = 30
    ckpt = f"file://{tmp_path / 'ckpt'}"
    spec = _diloco("jl-" + tmp_path.name[-6:], rounds, min_workers=1, max_workers=2, epochs=3,
                   checkpoint_uri=ckpt, checkpoint_interval=3, checkpoint_keep=3)
    create_job(r, spec)
    watch = ControlWatcher(r, spec.name)
    env = {"SHOAL_TEST_STEP_DELAY": "0.05", "SHOAL_LEDGER_DIR": str(tmp_path / "ledger"), "SHOAL_FAULTS": KILL_SOURCE}
    t0 = time.monotonic()
    with LocalProcs(redis_url, tmp_path / "logs", extra_env=env) as procs:
        procs.coordinator("coord")
        source = procs.worker(spec.name, "src")
        try:
            watch.wait_for(lambda d: "LATEST -> checkpoint of step 3" in d.reason, 120)
            source.signal(signal.SIGUSR1)  # its handler is installed: it trained
            joiner = procs.worker(spec.name, "joiner")
            assert source.wait(120) == -signal.SIGKILL
            t_killed = time.time()
            done = watch.wait_for(lambda d: d.job_state == "completed", 180)
            code = joiner.wait(60)
        except BaseException:
            dump_logs(procs, tmp_path / "logs")
            raise
    print(f"took {time.monotonic() - t0:.1f} s")
    for d in watch.seen:
        print(d.generation, d.reason)
    print(joiner.log_path.read_text()[-4000:])
    assert code == 0
