"""A multi-host network on one machine: Linux network namespaces joined by a bridge.

Every *host* is a network namespace with one interface, ``eth0``, holding a private address
``10.77.<subnet>.<n>/24``, whose other end is a port of a bridge in a namespace of its own
(the *switch*). The machine's own namespace is never touched: no address, route, interface
or firewall rule is added there, and no packet leaves the namespaces created here.
Every host's ``/etc/hosts`` maps the host name to 127.0.0.1 (a file in ``/etc/netns/<ns>``,
which ``ip netns exec`` mounts over ``/etc/hosts``), as on a badly configured cluster - and as
in namespaces that share the machine's ``/etc/hosts`` - so the host name's address is never
one a peer can reach.

Processes run in a host with ``ip netns exec``; :meth:`Host.shoal` starts ``python -m shoal``
there, in the network's working directory (``cwd``: where a job's entrypoint module is found,
as under ``python -m``), with a log file each.

Faults are nftables rules on the switch's bridge (this kernel has no ``netem``):
:meth:`Net.partition` (two-way or one-way, between two hosts: packets vanish, nothing is
refused), :meth:`Net.loss` (random loss on a host's link), :meth:`Net.link_down` (the switch
port goes down: the cable is pulled), and :meth:`Net.delay` (every frame to and from a host
held in a user-space delay line, :mod:`shoal.ops.chaos.delayfwd`); :meth:`Net.heal` undoes
them all.

A link you can set: :meth:`Net.set_link` gives a host's link a rate (a TBF qdisc on both ends
of its veth, so each way is paced) and, optionally, the delay line above; :meth:`Net.check_link`
measures the throughput through it (a TCP stream between two hosts,
:mod:`shoal.ops.chaos.linkcheck`) and raises :class:`LinkCheckFailed`, one line, when it does
not reach the rate (or far exceeds it: the rate is not applied) - the gate before a run that
needs that link. :meth:`Net.heal` takes rates away too.

Clean-up: :meth:`Net.close` kills every process left in the namespaces (``ip netns pids``)
and deletes them, which deletes their interfaces and the bridge with them. Namespace names
carry the creating process's pid (``shn<pid>-<host>``): :func:`sweep` deletes those whose
creator is dead (run at every :class:`Net` start, so a test run killed with SIGKILL is cleaned
by the next one) and, at interpreter exit, this process's own.

Used by ``shoal chaos --network`` (:mod:`shoal.ops.chaos.network`) and the multi-host tests.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from shoal.ops.embedded import DOWN_AFTER_MS, HA_NODE_OPTIONS, server_binary
from shoal.ops.localproc import LocalProcs, Proc
from shoal.core.procs import pid_runs
from shoal.core.connection import ReplicatedRedis

PREFIX = "shn"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[a-z0-9]+$")
#: every command of the harness is bounded by this (seconds)
CMD_TIMEOUT = 10.0
REDIS_PORT = 6379
SENTINEL_PORT = 26379
HA_SERVICE = "shoal"


class NetUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``, no netns support)."""


class LinkCheckFailed(RuntimeError):
    """A link set with :meth:`Net.set_link` does not carry the rate it was set to (measured
    through it): a run on it would measure something else. The message is one line."""


def _run(*argv: str, check: bool = True, timeout: float = CMD_TIMEOUT) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {(done.stderr or done.stdout).strip()}")
    return done


def unavailable_reason(*, faults: bool = False) -> str:
    """Why namespaces cannot be made on this machine ("" when they can): tried for real.
    With ``faults``, also why faults cannot be injected (no ``nft``, no ``/dev/net/tun`` for
    the delay line). The reason names the cause only, e.g. "running as uid 1000, not root"."""
    if os.geteuid() != 0:
        return f"running as uid {os.geteuid()}, not root"
    if shutil.which("ip") is None:
        return "no 'ip' on PATH (Debian package iproute2)"
    if faults and shutil.which("nft") is None:
        return "no 'nft' on PATH (Debian package nftables)"
    if faults and not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun (the delay line needs TAP devices)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        done = _run("ip", "netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"'ip netns add' failed: {exc}"
    if done.returncode != 0:
        return f"'ip netns add' failed: {done.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return ""


def _wait_until(pred, timeout: float, what: str, interval: float = 0.05):
    """``pred()`` until truthy (returned); RuntimeError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() >= deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
    return got


def namespaces() -> list[str]:
    """Names of this harness's namespaces on the machine (any creator)."""
    out = _run("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if _NAME.match(n)]




#: ``ip netns exec NAME`` bind-mounts the files of ``/etc/netns/NAME`` over ``/etc``
ETC_NETNS = Path("/etc/netns")


def delete_namespace(name: str) -> None:
    """Kill every process in ``name`` (SIGKILL: they are leftovers), then delete it and its
    ``/etc/netns`` files."""
    for _ in range(50):
        pids = [int(p) for p in _run("ip", "netns", "pids", name, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)  # SIGKILLed processes leave the namespace as the kernel reaps them
    _run("ip", "netns", "del", name, check=False)
    shutil.rmtree(ETC_NETNS / name, ignore_errors=True)


def sweep(*, own: bool = False) -> list[str]:
    """Delete this harness's namespaces whose creating process is dead (and, with ``own``,
    this process's). Returns the names deleted."""
    gone = []
    for name in namespaces():
        pid = int(_NAME.match(name).group(1))
        if (own and pid == os.getpid()) or (pid != os.getpid() and not pid_runs(pid)):
            delete_namespace(name)
            gone.append(name)
    return gone


_atexit_registered = False
_SEQ = itertools.count()


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(sweep, own=True)
        _atexit_registered = True


@dataclass
class Host:
    """One host: a namespace ``ns`` with ``eth0`` at ``ip``; ``port`` is its switch port."""

    net: "Net"
    name: str
    ns: str
    ip: str
    port: str
    procs: list[Proc] = field(default_factory=list)

    def exec(self, *argv: str, check: bool = True, timeout: float = CMD_TIMEOUT) -> subprocess.CompletedProcess:
        """Run a command in this host and wait for it (bounded by ``timeout``)."""
        return _run("ip", "netns", "exec", self.ns, *argv, check=check, timeout=timeout)

    def popen(self, name: str, argv: list[str], env: dict[str, str] | None = None, role: str = "") -> Proc:
        """Start ``argv`` in this host, output to ``<log_dir>/<name>.log``; reaped by ``Net.close``."""
        log_path = self.net.log_dir / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            popen = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], env=env, cwd=self.net.cwd, stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        proc = Proc(name, popen, log_path, role=role)
        self.procs.append(proc)
        return proc

    def shoal(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        """``python -m shoal ARGS`` in this host, with the network's Redis URL and ``env``."""
        full = dict(os.environ)
        full.update(self.net.env)
        full.update(env or {})
        full.update({"PYTHONUNBUFFERED": "1"})
        full.setdefault("OMP_NUM_THREADS", "1")
        return self.popen(name, [sys.executable, "-m", "shoal", *args], full, role=args[0] if args else "")

    def can_connect(self, ip: str, port: int, timeout: float = 1.0) -> bool:
        """Whether a TCP connection from this host to ``ip:port`` is accepted within ``timeout``."""
        code = (f"import socket,sys\ntry:\n socket.create_connection(({ip!r},{port}),timeout={timeout})\n"
                f"except OSError:\n sys.exit(1)")
        return self.exec(sys.executable, "-c", code, check=False, timeout=timeout + CMD_TIMEOUT).returncode == 0


class Net:
    """Hosts on one bridge. Use as a context manager (or call :meth:`close`): every process
    and namespace it made is gone afterwards, also when the body raised."""

    def __init__(self, log_dir: Path, *, subnet: int | None = None, cwd: Path | None = None):
        reason = unavailable_reason()
        if reason:
            raise NetUnavailable(reason)
        _register_atexit()
        sweep()
        #: where every process's log goes (``<name>.log``)
        self.log_dir = log_dir
        #: the working directory of every process started in a host (default: this one's)
        self.cwd = Path(cwd) if cwd is not None else Path.cwd()
        self.subnet = subnet if subnet is not None else os.getpid() % 250
        self.tag = f"{PREFIX}{os.getpid()}"
        self._seq = next(_SEQ)
        self.hosts: dict[str, Host] = {}
        #: environment every shoal process of this network gets (REDIS_URL once Redis runs)
        self.env: dict[str, str] = {}
        self.redis: Proc | None = None
        self.redis_socket: Path | None = None
        self._made: list[str] = []
        self._faults = False
        #: host name -> its delay line's process
        self._delays: dict[str, Proc] = {}
        #: host name -> the rate (Mbit/s) its link was set to
        self.rates: dict[str, float] = {}
        #: a short directory for the Redis unix socket (a socket path holds at most 107 bytes)
        self._sock_dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        try:
            self.switch = self._add_ns("sw")
            self._sw("ip", "link", "add", "br0", "type", "bridge")
            self._sw("ip", "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    # ---- topology ----------------------------------------------------------------------------

    def _add_ns(self, short: str) -> str:
        name = f"{self.tag}-{short}{self._seq}"
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def _sw(self, *argv: str) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", self.switch, *argv)

    def add_host(self, name: str) -> Host:
        """A new host ``name`` (letters and digits, at most 8) on the bridge."""
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", name) or name in self.hosts:
            raise ValueError(f"bad or duplicate host name {name!r}")
        ns = self._add_ns(name)
        # the bug of a badly configured cluster, made certain: the host name means loopback
        etc = ETC_NETNS / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost {socket.gethostname()}\n")
        ip = f"10.77.{self.subnet}.{len(self.hosts) + 2}"
        port = f"p{name}"
        self._sw("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._sw("ip", "link", "set", port, "master", "br0")
        self._sw("ip", "link", "set", port, "up")
        _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        host = Host(self, name, ns, ip, port)
        self.hosts[name] = host
        return host

    def start_redis(self, host: Host) -> str:
        """The embedded server's binary in ``host``, bound to its address only, plus a unix
        socket for the test itself (:meth:`client`: unix sockets are not namespaced, so the
        test observes through no network path a fault could cut); returns the URL (also put in
        :attr:`env` as ``REDIS_URL``) once it answers from that host."""
        run_dir = self.log_dir / "redis"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.redis_socket = self._sock_dir / "redis.sock"
        argv = [str(server_binary()), "--bind", host.ip, "--port", str(REDIS_PORT), "--dir", str(run_dir),
                "--unixsocket", str(self.redis_socket), "--unixsocketperm", "700",
                "--appendonly", "no", "--save", "", "--protected-mode", "no", "--daemonize", "no"]
        self.redis = host.popen("redis", argv, dict(os.environ), role="redis")
        _wait_until(lambda: self.redis.popen.poll() is not None or host.can_connect(host.ip, REDIS_PORT), 15,
                    "Redis to listen")
        if self.redis.popen.poll() is not None:
            raise RuntimeError(f"Redis exited: {self.redis.log_tail(5)}")
        url = f"redis://{host.ip}:{REDIS_PORT}/0"
        self.env["REDIS_URL"] = url
        return url

    def start_ha(self, primary: Host, replicas: list[Host], sentinels: list[Host], *,
                 down_after_ms: int = DOWN_AFTER_MS, timeout: float = 30.0) -> str:
        """A Sentinel HA set of the embedded binary: a primary on ``primary``, one replica on
        each of ``replicas``, one sentinel on each of ``sentinels`` (quorum: a majority), each
        bound to its host's address, each with a unix socket for the test itself
        (:meth:`ha_client`); returns the ``redis+sentinel://`` URL (also put in :attr:`env` as
        ``REDIS_URL``) once the replicas are in sync and every sentinel sees all of them."""
        binary = str(server_binary())
        self.data_sockets: dict[str, Path] = {}
        self.sentinel_sockets: list[Path] = []
        for host in [primary, *replicas]:
            run_dir = self.log_dir / f"redis-{host.name}"
            run_dir.mkdir(parents=True, exist_ok=True)
            sock = self.data_sockets[host.name] = self._sock_dir / f"{host.name}.sock"
            argv = [binary, "--bind", host.ip, "--port", str(REDIS_PORT), "--dir", str(run_dir),
                    "--unixsocket", str(sock), "--unixsocketperm", "700", "--appendonly", "no", "--save", "",
                    "--protected-mode", "no", "--daemonize", "no", *HA_NODE_OPTIONS]
            if host is not primary:
                argv += ["--replicaof", primary.ip, str(REDIS_PORT)]
            host.popen(f"redis-{host.name}", argv, dict(os.environ), role="redis")
        quorum = len(sentinels) // 2 + 1
        for host in sentinels:
            run_dir = self.log_dir / f"sentinel-{host.name}"
            run_dir.mkdir(parents=True, exist_ok=True)
            sock = self._sock_dir / f"s-{host.name}.sock"
            self.sentinel_sockets.append(sock)
            conf = run_dir / "sentinel.conf"  # rewritten by the sentinel: writable
            conf.write_text(f"port {SENTINEL_PORT}\nbind {host.ip}\nunixsocket {sock}\nunixsocketperm 700\n"
                            f"dir {run_dir}\nprotected-mode no\n"
                            f"sentinel monitor {HA_SERVICE} {primary.ip} {REDIS_PORT} {quorum}\n"
                            f"sentinel down-after-milliseconds {HA_SERVICE} {down_after_ms}\n"
                            f"sentinel failover-timeout {HA_SERVICE} {max(3000, 3 * down_after_ms)}\n")
            host.popen(f"sentinel-{host.name}", [binary, str(conf), "--sentinel"], dict(os.environ), role="redis")

        def ready() -> bool:
            try:
                info = self._unix(self.data_sockets[primary.name]).info("replication")
                ok = info.get("connected_slaves", 0) == len(replicas) and all(
                    info.get(f"slave{i}", {}).get("state") == "online" for i in range(len(replicas)))
                for sock in self.sentinel_sockets:
                    m = self._unix(sock).sentinel_master(HA_SERVICE)
                    ok = ok and int(m["num-slaves"]) == len(replicas) and int(m["num-other-sentinels"]) == len(sentinels) - 1
                return ok
            except (redis.RedisError, OSError, KeyError, ValueError):
                return False

        _wait_until(ready, timeout, "the HA set (replicas in sync, sentinels seeing each other)")
        hosts = ",".join(f"{h.ip}:{SENTINEL_PORT}" for h in sentinels)
        url = f"redis+sentinel://{hosts}/{HA_SERVICE}/0"
        self.env["REDIS_URL"] = url
        return url

    @staticmethod
    def _unix(sock: Path) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(sock), socket_timeout=5, socket_connect_timeout=2)

    def ha_primary(self) -> str | None:
        """The host whose data node the sentinels name as the primary now (a majority of them
        agreeing), asked over their unix sockets; None when they do not agree."""
        names: list[str] = []
        for sock in self.sentinel_sockets:
            try:
                addr = self._unix(sock).sentinel_get_master_addr_by_name(HA_SERVICE)
            except (redis.RedisError, OSError):
                continue
            ip = addr[0].decode() if addr and isinstance(addr[0], bytes) else (addr[0] if addr else None)
            names += [h.name for h in self.hosts.values() if h.ip == ip]
        best = max(set(names), key=names.count, default=None)
        return best if best is not None and names.count(best) > len(self.sentinel_sockets) // 2 else None

    def ha_client(self, host: str | None = None) -> redis.Redis:
        """A client of the HA set's data node on ``host`` (default: the primary the sentinels
        name) for the test process, over its unix socket; it confirms durable reads and
        writes like a ``redis+sentinel://`` client (``shoal.core.durable``)."""
        name = host or self.ha_primary()
        if name is None:
            raise redis.ConnectionError("the sentinels name no primary")
        return ReplicatedRedis(unix_socket_path=str(self.data_sockets[name]), socket_timeout=5,
                               socket_connect_timeout=2, replicas=1)

    def isolate(self, group: list[Host]) -> None:
        """Partition ``group`` from every other host, both ways (inside it, all is well)."""
        for a in group:
            for b in self.hosts.values():
                if b not in group:
                    self.partition(a, b)

    def client(self) -> redis.Redis:
        """A client of the network's Redis for the test process, over its unix socket."""
        if self.redis_socket is None:
            raise RuntimeError("start_redis first")
        return redis.Redis(unix_socket_path=str(self.redis_socket), socket_timeout=10, socket_connect_timeout=5)

    # ---- faults (nftables on the bridge) -----------------------------------------------------

    def _nft(self, *rule: str) -> None:
        if shutil.which("nft") is None:
            raise NetUnavailable("faults need nftables ('nft'; Debian package nftables)")
        if not self._faults:
            self._sw("nft", "add", "table", "bridge", "shoal")
            self._sw("nft", "add", "chain", "bridge", "shoal", "faults",
                     "{ type filter hook forward priority 0; policy accept; }")
            self._faults = True
        self._sw("nft", "add", "rule", "bridge", "shoal", "faults", *rule)

    def partition(self, a: Host, b: Host, *, oneway: bool = False) -> None:
        """Drop every frame from ``a`` to ``b`` (and, unless ``oneway``, from ``b`` to ``a``)."""
        self._nft("iifname", a.port, "oifname", b.port, "drop")
        if not oneway:
            self._nft("iifname", b.port, "oifname", a.port, "drop")

    def loss(self, host: Host, percent: int) -> None:
        """Drop ``percent`` % of the frames to and from ``host``, at random."""
        if not 0 < percent <= 100:
            raise ValueError(f"percent must be 1..100, got {percent}")
        chance = ("numgen", "random", "mod", "100", "<", str(percent)) if percent < 100 else ()
        for way in ("iifname", "oifname"):
            self._nft(way, host.port, *chance, "drop")

    def delay(self, host: Host, ms: float) -> None:
        """Hold every frame to and from ``host`` for ``ms`` milliseconds (so a round trip to it
        takes ``2 * ms`` more), established connections included: its switch port is moved
        onto a bridge of its own, joined to the main one through a user-space delay line
        (:mod:`shoal.ops.chaos.delayfwd`). Frames then enter the main bridge on the delay
        line's port, not the host's: a :meth:`partition` of a delayed host does not match."""
        if host.name in self._delays:
            raise ValueError(f"{host.name} is already delayed")
        near, far, side = f"dn{host.name}", f"df{host.name}", f"bd{host.name}"
        line = Proc(f"delay-{host.name}", subprocess.Popen(
            ["ip", "netns", "exec", self.switch, sys.executable, "-m", "shoal.ops.chaos.delayfwd", near, far, str(ms)],
            cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL), Path(os.devnull),
            role="delay")
        self._delays[host.name] = line
        readable, _, _ = select.select([line.popen.stdout], [], [], CMD_TIMEOUT)
        first = line.popen.stdout.readline().decode().strip() if readable else "no word in time"
        if first != "ready":  # it says so once both devices exist
            raise RuntimeError(f"the delay line did not start: {first}")
        self._sw("ip", "link", "add", side, "type", "bridge")
        self._sw("ip", "link", "set", host.port, "nomaster")
        for port, bridge in ((host.port, side), (near, side), (far, "br0")):
            self._sw("ip", "link", "set", port, "master", bridge)
            self._sw("ip", "link", "set", port, "up")
        self._sw("ip", "link", "set", side, "up")

    def _undelay(self, name: str) -> None:
        line = self._delays.pop(name)
        line.signal(signal.SIGKILL)  # its devices go with it
        line.wait(CMD_TIMEOUT)
        line.popen.stdout.close()
        self._sw("ip", "link", "del", f"bd{name}")
        self._sw("ip", "link", "set", self.hosts[name].port, "master", "br0")

    def set_link(self, host: Host, mbit: float, delay_ms: float = 0.0) -> None:
        """Give ``host``'s link ``mbit`` Mbit/s each way (a TBF qdisc on both ends of its veth:
        the switch port, paced toward the host, and the host's ``eth0``, paced from it) and,
        with ``delay_ms``, the delay line of :meth:`delay` (frames held ``delay_ms`` each
        way). Setting it again replaces the rate. Check it with :meth:`check_link` before a
        run: a TBF on a loaded machine, or behind a user-space delay line, may not reach it."""
        if not 0 < mbit <= 100_000:
            raise ValueError(f"mbit must be in (0, 100000], got {mbit}")
        # the bucket holds 4 ms at the rate (the timer's granularity at HZ=250) and at least
        # one full frame; the queue holds 50 ms more, like a switch port's buffer
        burst = max(16_000, int(mbit * 1e6 / 8 * 0.004))
        for ns, dev in ((self.switch, host.port), (host.ns, "eth0")):
            _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                 "burst", str(burst), "latency", "50ms")
        self.rates[host.name] = mbit
        if delay_ms > 0:
            self.delay(host, delay_ms)

    def _unrate(self, name: str) -> None:
        host = self.hosts[name]
        for ns, dev in ((self.switch, host.port), (host.ns, "eth0")):
            _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
        self.rates.pop(name, None)

    def check_link(self, src: Host, dst: Host, mbit: float | None = None, *, seconds: float = 3.0,
                   warm: float = 1.0, low: float = 0.8, high: float = 1.25, port: int = 5201) -> float:
        """Measure the throughput of one TCP stream from ``src`` to ``dst`` for ``seconds``
        (counted from ``warm`` s after its first byte) and return it, Mbit/s. ``mbit``: the
        rate it must carry (default: the rate set on ``dst``'s link, else ``src``'s).
        LinkCheckFailed, one line, when the measured rate is below ``low`` x ``mbit`` (the
        link, the delay line or the machine cannot carry it) or above ``high`` x ``mbit``
        (the rate is not applied)."""
        want = mbit if mbit is not None else self.rates.get(dst.name, self.rates.get(src.name))
        if want is None:
            raise ValueError(f"no rate set on {src.name}'s or {dst.name}'s link: pass mbit")
        bound = seconds + 30
        # the file itself, not ``-m shoal...``: the package's imports cost seconds on a loaded box
        argv = [sys.executable, str(Path(__file__).with_name("linkcheck.py"))]
        recv = subprocess.Popen(["ip", "netns", "exec", dst.ns, *argv, "recv", dst.ip, str(port), str(warm), str(bound)],
                                cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True)
        try:
            readable, _, _ = select.select([recv.stdout], [], [], bound)
            said = recv.stdout.readline().strip() if readable else "no word in time"
            if said != "listening":
                raise LinkCheckFailed(f"link check {src.name} -> {dst.name}: the receiver did not start: {said}")
            src.exec(*argv, "send", dst.ip, str(port), str(seconds + warm), timeout=bound)
            out, _ = recv.communicate(timeout=bound)
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait(CMD_TIMEOUT)
            recv.stdout.close()
        try:
            nbytes, secs = (float(x) for x in out.split()[-2:])
        except ValueError:
            raise LinkCheckFailed(f"link check {src.name} -> {dst.name}: unreadable result {out.strip()!r}") from None
        got = nbytes * 8 / secs / 1e6 if secs > 0 else 0.0
        if got < low * want:
            raise LinkCheckFailed(f"link {src.name} -> {dst.name} carries {got:.1f} Mbit/s, below {low:.0%} of the "
                                  f"{want:g} Mbit/s set: refusing to run on it (a loaded machine, or the delay line "
                                  f"cannot forward that fast)")
        if got > high * want:
            raise LinkCheckFailed(f"link {src.name} -> {dst.name} carries {got:.1f} Mbit/s, above {high:.0%} of the "
                                  f"{want:g} Mbit/s set: the rate is not applied")
        return got

    def link_down(self, host: Host) -> None:
        """Pull ``host``'s cable: its switch port goes down."""
        self._sw("ip", "link", "set", host.port, "down")

    def link_up(self, host: Host) -> None:
        self._sw("ip", "link", "set", host.port, "up")

    def heal(self) -> None:
        """Undo every fault: rules flushed, delay lines and rates removed, every link up."""
        if self._faults:
            self._sw("nft", "flush", "chain", "bridge", "shoal", "faults")
        for name in list(self._delays):
            self._undelay(name)
        for name in list(self.rates):
            self._unrate(name)
        for host in self.hosts.values():
            self.link_up(host)

    # ---- the end -----------------------------------------------------------------------------

    def procs(self) -> list[Proc]:
        return [p for h in self.hosts.values() for p in h.procs]

    def stop_procs(self, timeout: float = 10.0) -> None:
        """SIGTERM workers and agents (they drain), then coordinators, then Redis; SIGKILL
        whatever is still running after ``timeout``. Every child is reaped."""
        # LocalProcs.stop_all stops workers and agents, then coordinators; Redis goes last
        for group in ([p for p in self.procs() if p.role != "redis"], [p for p in self.procs() if p.role == "redis"]):
            LocalProcs(self.env.get("REDIS_URL", ""), self.log_dir, procs=group).stop_all(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every process (SIGKILL after ``timeout`` s a group), delete every namespace
        made here. Never raises for a namespace already gone; safe to call twice."""
        if self._made:
            try:
                self.heal()  # so that draining processes can still talk
            except Exception:  # noqa: BLE001 - best effort: the namespaces go anyway
                pass
        try:
            self.stop_procs(timeout)
        finally:
            for name in reversed(self._made):
                delete_namespace(name)
            self._made.clear()
            shutil.rmtree(self._sock_dir, ignore_errors=True)

    def dump(self, lines: int = 30) -> str:
        """The tail of every process's log (for a failing test)."""
        return "\n".join(f"===== {p.name} ({p.role})\n{p.log_tail(lines)}" for p in self.procs())

    def __enter__(self) -> "Net":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
