"""Deterministic fault injection keyed by (worker, step, phase), for tests and chaos runs.

``SHOAL_FAULTS`` holds comma-separated rules ``WORKER@STEP:PHASE:ACTION``:

- WORKER: a worker id (``w1``) or ``*``;
- STEP: the committed-step count at which the rule fires;
- PHASE: ``before_step`` (at the step boundary), ``mid_step`` (local gradients computed,
  peers already waiting in the step's collective), ``after_commit`` (optimizer stepped);
- ACTION: ``kill`` (SIGKILL self), ``exit=N`` (``os._exit(N)``), ``raise`` (an exception
  out of the training loop, i.e. a crash with a traceback), ``stop=S`` (SIGSTOP self for S
  seconds via a helper process that sends SIGCONT).

A rule fires at most once per process. Unset or empty: no faults, no cost beyond a dict
lookup per phase.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

PHASES = ("before_step", "mid_step", "after_commit")


class InjectedFault(RuntimeError):
    """The ``raise`` action."""


@dataclass(frozen=True)
class Rule:
    worker: str
    step: int
    phase: str
    action: str


def parse(text: str) -> list[Rule]:
    """Parse rules; raises ValueError naming the bad rule."""
    rules = []
    for raw in filter(None, (p.strip() for p in text.split(","))):
        try:
            who_step, phase, action = raw.split(":", 2)
            who, step = who_step.split("@")
            rule = Rule(who, int(step), phase, action)
        except ValueError as exc:
            raise ValueError(f"bad fault rule {raw!r}: expected WORKER@STEP:PHASE:ACTION") from exc
        if phase not in PHASES:
            raise ValueError(f"bad fault rule {raw!r}: phase must be one of {', '.join(PHASES)}")
        if not (action in ("kill", "raise") or action.startswith(("exit=", "stop="))):
            raise ValueError(f"bad fault rule {raw!r}: action must be kill, raise, exit=N or stop=S")
        rules.append(rule)
    return rules


class FaultPlan:
    def __init__(self, rules: list[Rule]):
        self._rules = {(r.phase, r.step): r for r in rules}
        self._fired: set[Rule] = set()

    @classmethod
    def from_env(cls) -> "FaultPlan":
        return cls(parse(os.environ.get("SHOAL_FAULTS", "")))

    def at(self, worker_id: str | None, step: int, phase: str) -> None:
        """Fire the rule for (worker, step, phase) if there is one."""
        if not self._rules:
            return
        rule = self._rules.get((phase, step))
        if rule is None or rule in self._fired or rule.worker not in ("*", worker_id):
            return
        self._fired.add(rule)
        sys.stderr.write(f"fault injected: {rule}\n")
        sys.stderr.flush()
        if rule.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if rule.action == "raise":
            raise InjectedFault(f"injected fault at step {step} ({phase})")
        kind, _, arg = rule.action.partition("=")
        if kind == "exit":
            os._exit(int(arg))
        if kind == "stop":
            pid = os.getpid()
            subprocess.Popen([sys.executable, "-c", f"import os,time,signal;time.sleep({float(arg)});os.kill({pid},signal.SIGCONT)"],
                             start_new_session=True)
            os.kill(pid, signal.SIGSTOP)
