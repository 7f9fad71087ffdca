"""Processes of this host, by pid."""

from __future__ import annotations

import os


def pid_runs(pid: int) -> bool:
    """Whether ``pid`` is a process of this host (pid namespace) that has not exited; a
    zombie (exited, not yet reaped) counts as exited. A process of another user counts as
    running."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
