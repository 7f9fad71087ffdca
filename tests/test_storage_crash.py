"""Crash consistency: a real writer process is SIGKILLed again and again while checkpointing.

The writer (this file run as a script) resumes from ``load_latest`` and saves checkpoints
of growing steps into a local store until it is killed. Most runs are killed from outside
with SIGKILL after a random number of saves plus a random sub-save delay; a few runs kill
themselves with SIGKILL at chosen points that random timing might miss (half-way through
a state file, just before LATEST, half-way through retention's deletions). After every
kill the test checks that LATEST names a complete, verifying checkpoint, that it never
moved backwards, that the loader returns exactly that checkpoint with the right content,
that every manifest present verifies (manifest written last), and that garbage stays
bounded. The restarted writer must resume at exactly LATEST.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KEEP = 3


def state_for(step: int):
    """~130 KB of state whose every value encodes ``step`` (so content can be checked)."""
    import torch

    from storage.train_state import TrainState

    return TrainState(
        step=step,
        model={"w": torch.full((16384,), float(step)), "b": torch.full((16,), step, dtype=torch.int64)},
        optimizer={"state": {0: {"m": torch.full((16384,), step / 2)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        data_cursor={"sample": step * 64},
        generation=1,
        world_size=2,
    )


# ---------------------------------------------------------------------------------------------
# writer process
# ---------------------------------------------------------------------------------------------
def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _killing_store(inner, crash_point: str, armed: threading.Event):
    """Wrap ``inner`` so that, once ``armed`` is set, the process SIGKILLs itself at
    ``crash_point``: ``mid-model`` (after the first chunk of model.pt), ``before-latest``,
    ``mid-retention`` (after deleting an old manifest, before its files)."""
    from storage.backend import ObjectStore

    class _HalfWriter:
        def __init__(self, f) -> None:
            self.f = f

        def write(self, data) -> int:
            n = self.f.write(data)
            self.f.flush()
            os.fsync(self.f.fileno())
            _die()
            return n

        def flush(self) -> None:
            self.f.flush()

    class KillingStore(ObjectStore):
        uri = inner.uri

        @contextmanager
        def open_write(self, key: str) -> Iterator[BinaryIO]:
            if armed.is_set() and crash_point == "before-latest" and key == "LATEST":
                _die()
            with inner.open_write(key) as f:
                if armed.is_set() and crash_point == "mid-model" and key.endswith("/model.pt"):
                    yield _HalfWriter(f)  # type: ignore[misc]
                else:
                    yield f

        def delete(self, key: str) -> None:
            inner.delete(key)
            if armed.is_set() and crash_point == "mid-retention" and key.endswith("/manifest.json") and inner.list(key.split("/")[0] + "/"):
                _die()

        def get_bytes(self, key: str) -> bytes:
            return inner.get_bytes(key)

        def exists(self, key: str) -> bool:
            return inner.exists(key)

        def list(self, prefix: str = "") -> list[str]:
            return inner.list(prefix)

        def size(self, key: str) -> int:
            return inner.size(key)

    return KillingStore()


def writer_main(root: str, crash_point: str) -> None:
    from storage.checkpoint import load_latest, save_checkpoint
    from storage.errors import NoCheckpoint
    from storage.local import LocalStore

    armed = threading.Event()
    store = _killing_store(LocalStore(root), crash_point, armed) if crash_point else LocalStore(root)
    try:
        state, _ = load_latest(store, on_warning=lambda m: print(f"warning {m}", file=sys.stderr, flush=True))
        start = state.step
    except NoCheckpoint:
        start = 0
    print(f"resumed {start}", flush=True)
    step = start
    while True:
        step += 1
        if crash_point and step == start + 4:
            armed.set()
        save_checkpoint(store, state_for(step), keep_last=KEEP)
        print(f"saved {step}", flush=True)


# ---------------------------------------------------------------------------------------------
# the test
# ---------------------------------------------------------------------------------------------
def _check_store(root: Path, previous_latest: int) -> int:
    import torch

    from storage.checkpoint import load_latest
    from storage.errors import CheckpointCorrupt
    from storage.latest_object import read_latest_step
    from storage.local import LocalStore
    from storage.verify import list_checkpoint_steps, read_manifest, verify_checkpoint

    store = LocalStore(root)
    latest = read_latest_step(store)
    assert latest is not None, "LATEST missing or corrupt after a kill"
    assert latest >= previous_latest, f"LATEST moved backwards: {previous_latest} -> {latest}"
    verify_checkpoint(store, latest, hmac_key=None)

    warnings: list[str] = []
    state, manifest = load_latest(store, hmac_key=None, on_warning=warnings.append)
    assert warnings == []
    assert state.step == manifest.step == latest
    assert torch.equal(state.model["w"], torch.full((16384,), float(latest)))
    assert torch.equal(state.optimizer["state"][0]["m"], torch.full((16384,), latest / 2))
    assert state.data_cursor == {"sample": latest * 64}

    steps = list_checkpoint_steps(store)
    for step in steps:
        try:
            read_manifest(store, step, hmac_key=None)
        except CheckpointCorrupt:
            continue  # partial: no manifest, never loaded
        verify_checkpoint(store, step, hmac_key=None)  # a manifest implies complete files
    # KEEP complete + one partial being written + one half-deleted at most
    assert len(steps) <= KEEP + 2, f"garbage accumulates: {steps}"
    return latest


def _start_writer(root: Path, crash_point: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, __file__, "--writer", str(root), crash_point],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def _read_line(proc: subprocess.Popen, deadline: float) -> str:
    """Next stdout line; the writer is killed (EOF, test fails) if the deadline passes."""
    timer = threading.Timer(max(0.0, deadline - time.monotonic()), proc.kill)
    timer.start()
    try:
        return proc.stdout.readline()  # type: ignore[union-attr]
    finally:
        timer.cancel()


@pytest.mark.slow
def test_sigkill_during_checkpointing_never_exposes_a_partial_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("SHOAL_CRASH_SEED", "20261121")))
    root = tmp_path / "ck"
    deadline = time.monotonic() + 120
    # external random kills, with the three self-kill points mixed in
    plan = ["", "mid-model", "", "before-latest", "mid-retention", ""]
    latest, total_saves, runs = 0, 0, 0
    while runs < len(plan) or total_saves < 100:
        crash_point = plan[runs] if runs < len(plan) else ""
        runs += 1
        proc = _start_writer(root, crash_point)
        try:
            first = _read_line(proc, deadline).split()
            assert first == ["resumed", str(latest)], f"writer resumed at {first}, LATEST was {latest}"
            saves = 0
            target = rng.randint(25, 40)
            while crash_point or saves < target:
                line = _read_line(proc, deadline)
                if not line:
                    break  # the writer killed itself (crash_point) or died
                assert line.startswith("saved "), line
                saves += 1
            if not crash_point:
                time.sleep(rng.uniform(0.0, 0.02))  # a random point inside the next save (~15 ms)
                proc.kill()
            rc = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        stderr = proc.stderr.read() if proc.stderr else ""  # type: ignore[union-attr]
        assert rc == -signal.SIGKILL, f"writer exited {rc}, not by SIGKILL: {stderr[-2000:]}"
        assert "Traceback" not in stderr, stderr[-2000:]
        if crash_point:
            assert saves == 3, f"self-kill at {crash_point} should hit the 4th save, got {saves} saves"
        total_saves += saves
        latest = _check_store(root, latest)
    assert total_saves >= 100, f"only {total_saves} saves"


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--writer":
    writer_main(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
