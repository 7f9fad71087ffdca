"""The demo's output: a progress line redrawn in place on a terminal, and on a pipe or a log
file plain lines with no control characters, throttled by an injected clock (no sleeps)."""

from __future__ import annotations

import io

from shoal.ops.demo import Console, recovery_after_kill


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_pipe_gets_plain_lines_with_progress_throttled() -> None:
    now = [0.0]
    out = io.StringIO()
    console = Console(out, every=2.0, clock=lambda: now[0])
    assert not console.tty
    for i in range(10):  # ten redraws within 1.8 s: only the first is printed
        console.progress(f"step {i}")
        now[0] += 0.2
    console.line("gen 2 running   w1 failed")
    now[0] = 2.5
    console.progress("step 99")
    console.end()
    text = out.getvalue()
    assert "\r" not in text and "\033" not in text
    assert text.splitlines() == ["step 0", "gen 2 running   w1 failed", "step 99"]


def test_a_terminal_redraws_progress_and_keeps_lines_above_it() -> None:
    out = FakeTerminal()
    console = Console(out, clock=lambda: 0.0)
    console.progress("step 1")
    console.progress("step 2")  # a terminal redraws every time, whatever the clock says
    console.line("--- kill -9 w1")
    console.progress("step 3")
    console.end()
    assert out.getvalue() == "\rstep 1\033[K\rstep 2\033[K\r\033[K--- kill -9 w1\n\rstep 3\033[K\n"


def _entry(t: float, worker: str, pid: int, generation: int) -> dict:
    return {"t": t, "worker": worker, "pid": pid, "generation": generation, "step": 0}


def test_recovery_is_read_from_the_ledgers_not_from_stale_heartbeats() -> None:
    entries = [
        _entry(99.0, "w0", 10, 1), _entry(99.0, "w1", 11, 1), _entry(99.0, "w2", 12, 1),
        _entry(100.1, "w0", 10, 1),  # committed in the old generation just after the kill: not a recovery
        _entry(100.7, "w2", 12, 2), _entry(100.8, "w0", 10, 2),  # the survivors, same processes
        _entry(104.0, "w3", 13, 3),  # the replacement, a process that was not there before
    ]
    seconds, kept = recovery_after_kill(entries, killed_at=100.0, generation=1)
    assert abs(seconds - 0.7) < 1e-9
    assert kept == ["w0", "w2"]


def test_a_survivor_restarted_under_the_same_id_did_not_keep_its_process() -> None:
    entries = [_entry(99.0, "w0", 10, 1), _entry(101.0, "w0", 20, 2)]
    assert recovery_after_kill(entries, killed_at=100.0, generation=1) == (1.0, [])
    assert recovery_after_kill(entries[:1], killed_at=100.0, generation=1) is None
