"""Deterministic fault injection keyed by (who, number, phase), for tests and chaos runs.

Rules are comma-separated ``WHO@N:PHASE:ACTION``. Workers read ``SHOAL_FAULTS``:

- WHO: a worker id (``w1``) or ``*``; N: the committed-step count (for the checkpoint
  phases: the step being checkpointed);
- PHASE, in the order a step meets them:

  ``before_step``          at the step boundary, before the batch is computed;
  ``mid_step``             local gradients computed, peers already waiting in the collective;
  ``after_commit``         optimizer stepped, the step is committed;
  ``ckpt_write``           a checkpoint state file fully written but not yet published
                           (still under its temporary name);
  ``ckpt_before_latest``   every file and the manifest written, the store's LATEST not moved;
  ``ckpt_before_event``    the store's LATEST moved, the ``checkpoint`` event not yet sent,
                           so the Redis LATEST pointer has not moved either;
  ``rendezvous``           a generation switch: every member met at the Redis barrier, this
                           one has not yet published its address for the process group;
  ``transfer``             a generation switch's catch-up, on the member that sends its state
                           to the members behind (a joiner; data parallelism and DiLoCo, not
                           HSDP's cross-replica catch-up): the state's header is posted to
                           them, none of its tensors yet - a ``kill`` here is a source that
                           dies mid-transfer, with the receivers waiting for its tensors;
  ``finish``               the job's last step committed here (N: that step), before the final
                           evaluation, checkpoint and report of the completion.

Coordinators read ``SHOAL_COORD_FAULTS``: WHO is an event kind (``checkpoint``, ``join``...)
or ``*``, N counts the events of that kind this process has applied (1 = the first), and
PHASE is ``before_apply`` (the entry was delivered to this replica and is pending, nothing
applied) or ``after_apply`` (applied and acknowledged in one fenced call). A coordinator has
no window between moving LATEST and acknowledging the event: both are one Lua call.

ACTION: ``kill`` (SIGKILL self), ``segv`` (SIGSEGV self: a native crash), ``exit=N``
(``os._exit(N)``), ``raise`` (an exception from that point: a crash with a traceback in the
training thread, a failed save in the checkpoint thread), ``stop=S`` (SIGSTOP self for S
seconds; a helper process sends SIGCONT), ``sleep=S`` (the calling thread sleeps S seconds:
a member that is slow, not hung - its heartbeats go on), ``abort`` (workers, ``mid_step``
only: this member gives the step up itself, every time it meets that step - a member whose
step can never commit, as a broken group made it at 5e93599; the progress watchdog's case).

A rule fires at most once per process, except a rule armed by a signal: N given as ``usr1``
(``*@usr1:mid_step:sleep=4``) fires at its phase once after each SIGUSR1 the process receives,
so a harness picks the moment from outside (the chaos soak's ``worker_slow``). Unset or empty:
no faults, and the cost of a call is one attribute test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

from shoal.events import envvars
from shoal.core.errors import ConfigError

WORKER_PHASES = ("before_step", "mid_step", "after_commit", "ckpt_write", "ckpt_before_latest", "ckpt_before_event",
                 "rendezvous", "transfer", "finish")
COORDINATOR_PHASES = ("before_apply", "after_apply")
WORKER_ENV = envvars.FAULTS
COORDINATOR_ENV = envvars.COORD_FAULTS


class InjectedFault(RuntimeError):
    """The ``raise`` action."""


class InjectedAbort(RuntimeError):
    """The ``abort`` action: the worker gives its step up (nothing applied) and reports it."""


class BadFaultRule(ConfigError):
    """A rule in ``SHOAL_FAULTS`` / ``SHOAL_COORD_FAULTS`` that does not parse."""


#: ``Rule.n`` of a rule armed by SIGUSR1 (written ``WHO@usr1:...``)
ON_USR1 = -1


@dataclass(frozen=True)
class Rule:
    who: str
    n: int  #: the count it fires at, or ON_USR1
    phase: str
    action: str


def parse(text: str, phases: tuple[str, ...] = WORKER_PHASES) -> list[Rule]:
    """Parse rules; raises BadFaultRule naming the variable's bad rule."""
    rules = []
    for raw in filter(None, (p.strip() for p in text.split(","))):
        try:
            who_n, phase, action = raw.split(":", 2)
            who, n = who_n.split("@")
            rule = Rule(who, ON_USR1 if n == "usr1" else int(n), phase, action)
        except ValueError as exc:
            raise BadFaultRule(f"bad fault rule {raw!r}: expected WHO@N:PHASE:ACTION (N a number or usr1)") from exc
        if phase not in phases:
            raise BadFaultRule(f"bad fault rule {raw!r}: phase must be one of {', '.join(phases)}")
        kind, _, arg = action.partition("=")
        if not ((action in ("kill", "segv", "raise", "abort")) or (kind in ("exit", "stop", "sleep") and _is_number(arg))):
            raise BadFaultRule(f"bad fault rule {raw!r}: action must be kill, segv, raise, abort, exit=N, stop=S or "
                               "sleep=S")
        if action == "abort" and phase != "mid_step":
            raise BadFaultRule(f"bad fault rule {raw!r}: abort is a mid_step action")
        rules.append(rule)
    return rules


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class FaultPlan:
    """The rules of one process. :meth:`at` is called at each injection point."""

    def __init__(self, rules: list[Rule]):
        self._rules: dict[tuple[str, int], list[Rule]] = defaultdict(list)
        for r in rules:
            self._rules[(r.phase, r.n)].append(r)
        self._fired: set[Rule] = set()
        self._counts: dict[str, int] = defaultdict(int)
        #: SIGUSR1s received and not yet spent by a signal-armed rule
        self._armed = 0
        if any(r.n == ON_USR1 for r in rules):
            # handlers can only be set from the main thread, which is where workers build plans
            signal.signal(signal.SIGUSR1, self._arm)

    def _arm(self, _signum, _frame) -> None:
        self._armed += 1

    @classmethod
    def from_env(cls, var: str = WORKER_ENV, phases: tuple[str, ...] = WORKER_PHASES) -> "FaultPlan":
        return cls(parse(os.environ.get(var, ""), phases))

    @classmethod
    def for_coordinator(cls) -> "FaultPlan":
        return cls.from_env(COORDINATOR_ENV, COORDINATOR_PHASES)

    def __bool__(self) -> bool:
        return bool(self._rules)

    def at(self, who: str | None, n: int, phase: str) -> None:
        """Fire the rule for (who, n, phase), if there is one that has not fired yet."""
        if not self._rules:
            return
        for rule in self._rules.get((phase, n), ()):
            if rule not in self._fired and rule.who in ("*", who):
                if rule.action != "abort":  # an abort fires every time its step is met
                    self._fired.add(rule)
                _fire(rule, f"{who}@{n}:{phase}")
        if self._armed:
            for rule in self._rules.get((phase, ON_USR1), ()):
                if rule.who in ("*", who):
                    self._armed -= 1
                    _fire(rule, f"{who}@usr1:{phase} (step {n})")
                    break

    def count(self, who: str, phase: str) -> None:
        """For counted points (coordinator events): the Nth call for ``who`` fires the rules
        ``who@N``; the Nth call for anyone fires ``*@N``."""
        if not self._rules:
            return
        for key in (who, "*"):
            self._counts[f"{key}\0{phase}"] += 1
            n = self._counts[f"{key}\0{phase}"]
            for rule in self._rules.get((phase, n), ()):
                if rule.who == key and rule not in self._fired:
                    self._fired.add(rule)
                    _fire(rule, f"{who} event #{n}:{phase}")


def _fire(rule: Rule, where: str) -> None:
    sys.stderr.write(f"fault injected: {rule.action} at {where}\n")
    sys.stderr.flush()
    pid = os.getpid()
    if rule.action == "kill":
        os.kill(pid, signal.SIGKILL)
    if rule.action == "segv":
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGSEGV, signal.SIG_DFL)  # a crash by signal even if faulthandler is on
        os.kill(pid, signal.SIGSEGV)
    if rule.action == "raise":
        raise InjectedFault(f"injected fault at {where}")
    if rule.action == "abort":
        raise InjectedAbort(f"injected abort at {where}")
    kind, _, arg = rule.action.partition("=")
    if kind == "exit":
        os._exit(int(float(arg)))
    if kind == "sleep":
        time.sleep(float(arg))
    if kind == "stop":
        subprocess.Popen([sys.executable, "-c", f"import os,time,signal;time.sleep({float(arg)});os.kill({pid},signal.SIGCONT)"],
                         start_new_session=True)
        os.kill(pid, signal.SIGSTOP)
