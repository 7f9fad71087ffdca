"""Starting shoal processes on this machine: used by ``shoal demo``, tests and benchmarks.

Each process is ``python -m shoal ...`` with the given ``REDIS_URL``, run in this process's
working directory (which ``-m`` puts first on ``sys.path``, so a job's entrypoint module is
importable from there, as under ``python -m``); output goes to
a log file per process so a failing test can show it. ``stop_all`` always reaps children.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    role: str = ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalProcs:
    """Children sharing one Redis. Use as a context manager so every child is reaped."""

    redis_url: str
    log_dir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        env["REDIS_URL"] = self.redis_url
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")  # several CPU workers share this machine
        return env

    def start(self, name: str, *args: str) -> Proc:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        out = open(log_path, "ab")
        popen = subprocess.Popen(
            [sys.executable, "-m", "shoal", *args], env=self.env(), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        out.close()
        proc = Proc(name, popen, log_path, role=args[0] if args else "")
        self.procs.append(proc)
        return proc

    def coordinator(self, name: str = "coordinator", *extra: str) -> Proc:
        return self.start(name, "coordinator", "--id", name, *extra)

    def worker(self, job: str, name: str, *extra: str) -> Proc:
        return self.start(name, "worker", job, *extra)

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM workers and agents first (they drain through a live coordinator), then
        coordinators; SIGKILL whatever is still running after ``timeout``."""
        workers = [p for p in self.procs if p.role != "coordinator"]
        coordinators = [p for p in self.procs if p.role == "coordinator"]
        for group in (workers, coordinators):
            for p in group:
                p.signal(signal.SIGCONT)
                p.signal(signal.SIGTERM)
            for p in group:
                try:
                    p.wait(timeout)
                except subprocess.TimeoutExpired:
                    p.signal(signal.SIGKILL)
                    p.wait(timeout)

    def __enter__(self) -> "LocalProcs":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
