"""Ending a worker process for its node agent to start it again at once.

Two decisions end a live worker this way, because its state cannot go on in this process:
elastic HSDP's replica group losing a member (its shard group cannot be made again here:
torch resolves FSDP's groups by name) and the coordinator's progress watchdog restarting a
member that kept failing the same step (``coordinator/watchdog.py``). The exit code,
``WorkerExit.RESTART`` (``events/exits.py``), tells the agent to start it again without a back-off or a restart spent;
it rejoins as a new worker and catches up from the live members.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import NoReturn

from shoal.events.exits import WorkerExit

log = logging.getLogger("shoal.worker")

#: Set the moment a thread decided to end the process: from then on no step commits (the
#: training worker's commit fence reads :func:`ending`). The log lines and their flush to the
#: job's stream take milliseconds, in which the training thread could otherwise commit a step
#: that its replica group's peers, evicted with it, never commit: a step committed twice.
_ending = threading.Event()


def ending() -> bool:
    """Whether this process is ending for its node agent to start it again."""
    return _ending.is_set()


def exit_for_restart(why: str) -> NoReturn:
    """(Any thread.) Log ``why``, flush the log handlers (the job's log stream among them) and
    end the process with ``WorkerExit.RESTART``. Nothing of its state is lost to the job: the
    live members hold it."""
    _ending.set()  # first: no step commits once the decision is made
    log.warning("%s; exiting (code %d) for the node agent to start this worker again", why, WorkerExit.RESTART)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - best effort: the process ends next
            pass
    os._exit(WorkerExit.RESTART)
