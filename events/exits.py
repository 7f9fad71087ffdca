"""Every exit code a worker process ends with on purpose, what it means and whether its node
agent starts it again: the one definition that the worker (which exits with them), the node
agent (which restarts by them, ``worker/agent.py``) and the coordinator (which reads them
from the agent's ``WorkerExited`` report, ``coordinator/decide.py``) share.

====  ======================  ===============================================  =================
code  member                  meaning                                          the agent
====  ======================  ===============================================  =================
0     ``OK``                  finished, left, or the job ended                 done: not again
1     ``FAILED``              evicted by the coordinator (declared failed), or  again, after a
                              crashed (an uncaught error; Python's own 1)      back-off
2     ``ENTRYPOINT_ERROR``    the job's ``module:function`` could not be        again, after a
                              loaded or returned junk (``EntrypointError``;    back-off
                              the CLI's ``ConfigError`` too)
4     ``JOIN_REJECTED``       the coordinator refused its join (at              not again (when it
                              ``max_workers``, or the job already ended)       never joined)
5     ``JOIN_TIMEOUT``        no coordinator answered its join in time          again, after a
                                                                               back-off
75    ``RESTART``             start it again at once: its HSDP replica group    at once, no restart
                              went, or the progress watchdog restarted it      spent
                              (``worker/restart.py``)
76    ``ORPHANED``            its agent is gone and Redis was silent for the    (its agent is gone)
                              orphan bound (``worker/lifeline.py``)
77    ``STOPPED_IN_OUTAGE``   asked to stop (SIGTERM) while Redis was           not again; reported,
                              unreachable: it ended without leaving the job;   the coordinator
                              the coordinator counts it as left, not failed    counts a leave
====  ======================  ===============================================  =================

Any other code (or a signal) is a crash: started again after a back-off, until the slot's
``max_restarts`` are spent. The agent starts nothing again once the job ended or while it
drains.
"""

from __future__ import annotations

from enum import Enum, IntEnum


class Restart(str, Enum):
    """What a node agent does when a worker ends with an exit code."""

    #: Not started again: it ended on purpose (finished, refused, asked to stop).
    NEVER = "never"
    #: Started again at once, with no back-off and no restart spent: nothing failed.
    AT_ONCE = "at_once"
    #: A failure: started again after the back-off, one restart spent, until ``max_restarts``.
    BACKOFF = "backoff"


class WorkerExit(IntEnum):
    """A worker process's exit code (see the module docstring)."""

    OK = 0
    FAILED = 1
    ENTRYPOINT_ERROR = 2
    JOIN_REJECTED = 4
    JOIN_TIMEOUT = 5
    RESTART = 75
    ORPHANED = 76
    STOPPED_IN_OUTAGE = 77

    @property
    def restart(self) -> Restart:
        """What its node agent does (while the job runs and the agent is not draining)."""
        return _RESTART.get(self, Restart.BACKOFF)

    @classmethod
    def parse(cls, code: int | None) -> "WorkerExit | None":
        """The member for the exit code ``code``; None for a code no member names (a crash's
        own code, a fault's ``exit=N``) or None (a signal)."""
        try:
            return cls(code) if code is not None else None
        except ValueError:
            return None


_RESTART = {
    WorkerExit.OK: Restart.NEVER,
    WorkerExit.JOIN_REJECTED: Restart.NEVER,
    WorkerExit.STOPPED_IN_OUTAGE: Restart.NEVER,
    WorkerExit.RESTART: Restart.AT_ONCE,
}
