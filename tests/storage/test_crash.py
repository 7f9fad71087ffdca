"""Crash consistency: a real writer process is SIGKILLed again and again while checkpointing.

The writer resumes from ``load_latest`` and saves checkpoints of growing steps into a local
store until it is killed. Writers are forked by a supervisor process (this file run as a
script) that has imported torch once, so restarts are cheap and the test can afford many
kills. Most writers are killed from the test with SIGKILL after a random number of saves
plus a random sub-save delay; a few kill themselves with SIGKILL at points random timing
might miss (half-way through a state file, just before the manifest, just before and
during the LATEST write, half-way through retention's deletions). After every
kill the test checks that LATEST names a complete, verifying checkpoint, that it never
moved backwards, that the loader returns exactly that checkpoint with the right content,
that every manifest present verifies (manifest written last), and that garbage stays
bounded. The restarted writer must resume at exactly LATEST.
"""

from __future__ import annotations

import contextlib
import importlib
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

KEEP = 3


def state_for(step: int):
    """~130 KB of state whose every value encodes ``step`` (so content can be checked)."""
    import torch

    from shoal.storage.train_state import TrainState

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


_KILL_BEFORE = {("before-manifest", "manifest.json"), ("before-latest", "LATEST")}


def _killing_store(inner, crash_point: str, armed: threading.Event):
    """Wrap ``inner`` so that, once ``armed`` is set, the process SIGKILLs itself at
    ``crash_point``: ``mid-model`` (after the first chunk of model.pt reached the kernel),
    ``before-manifest`` (all state files written), ``before-latest`` (manifest written),
    ``mid-latest`` (LATEST opened for writing, nothing written: a store that overwrote in
    place would leave it empty), ``mid-retention`` (an old manifest deleted, its files not
    yet)."""
    from shoal.storage.backend import ObjectStore

    class _DyingWriter:
        """Dies on the first write: after it reached the disk, or before writing anything."""

        def __init__(self, f, write_first: bool) -> None:
            self.f = f
            self.write_first = write_first

        def write(self, data) -> int:
            if self.write_first:
                self.f.write(data)
                self.f.flush()  # in the kernel now: a SIGKILL does not lose it
            _die()
            return 0

        def flush(self) -> None:
            self.f.flush()

    class KillingStore(ObjectStore):
        uri = inner.uri

        @contextmanager
        def open_write(self, key: str) -> Iterator[BinaryIO]:
            if armed.is_set() and (crash_point, key.rsplit("/", 1)[-1]) in _KILL_BEFORE:
                _die()
            with inner.open_write(key) as f:
                if armed.is_set() and crash_point == "mid-model" and key.endswith("/model.pt"):
                    yield _DyingWriter(f, write_first=True)  # type: ignore[misc]
                elif armed.is_set() and crash_point == "mid-latest" and key == "LATEST":
                    yield _DyingWriter(f, write_first=False)  # type: ignore[misc]
                else:
                    yield f

        def delete(self, key: str) -> None:
            inner.delete(key)
            old_files_left = key.endswith("/manifest.json") and inner.list(key.split("/")[0] + "/")
            if armed.is_set() and crash_point == "mid-retention" and old_files_left:
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


def _say(line: str) -> None:
    """One line to the test in one write: ``print`` writes the text and its newline apart, so a
    SIGKILL between the two left ``saved 7`` without its newline and the supervisor's ``exit -9``
    was read as part of it (``saved 7exit -9``): the test counted a save and waited for a line
    that never came (a flake of 2-10 % under load)."""
    os.write(1, f"{line}\n".encode())


def writer_main(root: str, crash_point: str) -> None:
    """Resume from the store, then save steps start+1, start+2, ... until killed."""
    from shoal.storage.checkpoint import load_latest, save_checkpoint
    from shoal.storage.errors import NoCheckpoint
    from shoal.storage.local import LocalStore

    armed = threading.Event()
    store = _killing_store(LocalStore(root), crash_point, armed) if crash_point else LocalStore(root)
    try:
        state, _ = load_latest(store, on_warning=lambda m: print(f"warning {m}", file=sys.stderr, flush=True))
        start = state.step
    except NoCheckpoint:
        start = 0
    _say(f"resumed {start}")
    step = start
    while True:
        step += 1
        if crash_point and step == start + 4:
            armed.set()
        save_checkpoint(store, state_for(step), keep_last=KEEP)
        _say(f"saved {step}")


def supervisor_main(root: str) -> None:
    """Fork a fresh writer per ``run <crash_point>`` line on stdin (it says ``child PID``
    first); once it is dead, report ``exit STATUS`` (negative signal number when killed). Importing torch
    once here and forking keeps each restart cheap, so the test can afford many kills; every
    writer still starts from what is on disk only."""
    importlib.import_module("shoal.storage.checkpoint")  # pay the imports once, before forking

    for line in sys.stdin:
        crash_point = line.split()[1] if len(line.split()) > 1 else ""
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _say(f"child {os.getpid()}")  # before anything else the child says
                writer_main(root, crash_point)
            except BaseException:
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        _say(f"exit {code}")


# ---------------------------------------------------------------------------------------------
# the test
# ---------------------------------------------------------------------------------------------
def _check_store(root: Path, previous_latest: int) -> int:
    import torch

    from shoal.storage.checkpoint import load_latest
    from shoal.storage.errors import CheckpointCorrupt
    from shoal.storage.latest_object import read_latest_step
    from shoal.storage.local import LocalStore
    from shoal.storage.verify import list_checkpoint_steps, read_manifest, verify_checkpoint

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


class Supervisor:
    """The supervisor process, with line reads bounded by a deadline."""

    def __init__(self, root: Path, deadline: float) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, "--supervisor", str(root)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        self.deadline = deadline
        self.child: int | None = None  # pid of a writer not yet reported dead
        self.seen: list[str] = []  # every line read, for a failure's message

    def _abort(self) -> None:
        self.kill_child()
        self.proc.kill()

    def kill_child(self) -> None:
        if self.child is not None:
            self.seen.append(f"{time.monotonic():.3f} kill {self.child}")
            with contextlib.suppress(ProcessLookupError):  # already dead, not yet reported
                os.kill(self.child, signal.SIGKILL)

    def line(self) -> list[str]:
        """Next stdout line, split; everything is killed (EOF -> []) past the deadline."""
        timer = threading.Timer(max(0.0, self.deadline - time.monotonic()), self._abort)
        timer.start()
        try:
            raw = self.proc.stdout.readline()  # type: ignore[union-attr]
        finally:
            timer.cancel()
        self.seen.append(f"{time.monotonic():.3f} {raw!r}")
        words = raw.split()
        if words and (len(words) != 2 or words[0] not in ("child", "resumed", "saved", "exit")
                      or not words[1].lstrip("-").isdigit()):
            self._abort()
            pytest.fail(f"a malformed line from the supervisor: {raw!r} (last lines: {self.seen[-8:]})")
        if words[:1] == ["child"]:
            self.child = int(words[1])
        elif words[:1] == ["exit"]:
            self.child = None
        return words

    def start_writer(self, crash_point: str) -> None:
        self.proc.stdin.write(f"run {crash_point}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        assert self.line()[:1] == ["child"]

    def close(self) -> str:
        self.kill_child()
        self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.stderr.read()  # type: ignore[union-attr]


SELF_KILLS = ["mid-model", "before-manifest", "before-latest", "mid-latest", "mid-retention"]


def _campaign(root: Path, plan: list[str], min_saves: int, seed: int, budget_s: float) -> tuple[int, int]:
    """Run writers per ``plan`` ("" = killed from outside at a random point, else a
    self-kill point), then more random kills until ``min_saves`` saves happened; check the
    store after every kill. Returns (saves, runs)."""
    rng = random.Random(seed)
    sup = Supervisor(root, deadline=time.monotonic() + budget_s)
    latest, total_saves, runs = 0, 0, 0
    try:
        while runs < len(plan) or total_saves < min_saves:
            crash_point = plan[runs] if runs < len(plan) else ""
            runs += 1
            sup.start_writer(crash_point)
            first = sup.line()
            assert first == ["resumed", str(latest)], f"writer resumed at {first}, LATEST was {latest}"
            saves, target = 0, rng.randint(3, 12)
            while crash_point or saves < target:
                words = sup.line()
                if words[:1] != ["saved"]:
                    break  # the writer killed itself ("exit ...") or the deadline passed ([])
                saves += 1
            else:
                time.sleep(rng.uniform(0.0, 0.02))  # a random point inside the next save (~15 ms)
                sup.kill_child()
                words = sup.line()
                while words[:1] == ["saved"]:  # finished during the delay, already in the pipe
                    saves += 1
                    words = sup.line()
            if words != ["exit", str(-signal.SIGKILL)]:
                pytest.fail(f"writer ended with {words}; last lines: {sup.seen[-12:]}; "
                            f"supervisor stderr:\n{sup.close()[-3000:]}")
            if crash_point:
                assert saves == 3, f"self-kill at {crash_point} should hit the 4th save, got {saves} saves"
            total_saves += saves
            latest = _check_store(root, latest)
    finally:
        stderr = sup.close()
    assert "Traceback" not in stderr, stderr[-3000:]
    return total_saves, runs


def _seed() -> int:
    return int(os.environ.get("SHOAL_CRASH_SEED", "20261121"))


@pytest.mark.slow
def test_sigkill_during_checkpointing_never_exposes_a_partial_checkpoint(tmp_path: Path) -> None:
    # 3 random external kills before each self-kill point, 2 more at the end: 22 kills
    plan = [k for point in SELF_KILLS for k in ("", "", "", point)] + ["", ""]
    saves, runs = _campaign(tmp_path / "ck", plan, min_saves=100, seed=_seed(), budget_s=120)
    assert saves >= 100 and runs >= 22, f"only {saves} saves in {runs} runs"


@pytest.mark.soak
def test_sigkill_soak(tmp_path: Path) -> None:
    plan = [k for _ in range(20) for point in SELF_KILLS for k in ("", "", "", point)]
    saves, runs = _campaign(tmp_path / "ck", plan, min_saves=1000, seed=_seed() + 1, budget_s=1800)
    assert saves >= 1000 and runs >= 400


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--supervisor":
    supervisor_main(sys.argv[2])
