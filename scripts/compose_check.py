#!/usr/bin/env python3
"""The real compose stack, checked: ``compose.yaml`` (and ``compose.yaml`` + ``compose.ha.yaml``)
on a real Docker daemon, unmodified, with a PASS/FAIL verdict per scenario.

    sudo python3 scripts/compose_check.py            # (root; docker.io, docker-compose, debootstrap)

What it does:

1. Starts its own ``dockerd`` inside a network namespace of its own (``shoal-compose-check``):
   its bridge, its containers and their addresses never exist in the machine's own namespace
   and no container has a route out. ``ip netns exec`` remounts ``/sys`` (hiding the cgroup
   mounts dockerd needs), so dockerd starts through a wrapper that mounts them again, as the
   host has them. A tiny DNS responder answers NXDOMAIN to every query as dockerd's upstream
   DNS: without one, Docker's embedded DNS never answers a lookup of a stopped service (20 s
   in glibc) and the sentinels never fail over.
2. Builds every image compose names without a container registry: a ``debootstrap
   --variant=minbase bookworm`` base (the Debian mirror read from apt's own sources),
   ``chroot`` + apt/pip with the host's network, ``docker import`` under the names compose
   expects: ``redis:7`` (Debian's redis), ``python:3.11-slim`` (Debian's python3.11 with the CPU
   build of torch and shoal's dependencies preinstalled, offline pip), ``minio/minio`` and
   ``minio/mc`` (moto's S3 behind ``minio``/``mc`` stand-ins that keep objects in the volume).
   Images are cached in the daemon's data root, ``/var/lib/shoal-compose-check``: a rerun
   skips all of it. Then ``docker build --network none -t shoal:local .`` of the Dockerfile.
3. Runs the scenarios, each with a verdict and its figures as ``name=value`` lines:
   ``up`` (the stack comes up, the example job completes exactly once), ``api`` (``GET
   /health`` on the published loopback port), ``agent-crash`` (``kill -9`` of an agent
   container's PID 1: restarted, its worker rejoins, exactly once), ``down-up`` (``docker
   compose down`` then ``up`` with the volumes: the job resumes from its checkpoint, exactly
   once), ``ha-primary-kill`` (with ``compose.ha.yaml``: the Redis primary killed mid-job, every
   worker process keeps its PID, no committed step lost or repeated, the job completes).

"Exactly once" is the test suite's proof (``shoal.worker.ledger``): with ``SHOAL_LEDGER_DIR``
set, every worker appends each step it commits; the only thing this check layers over the
compose files is that variable and the folder it names (a generated override file), and the
ledger is verified inside the stack's own image. Job state comes from ``shoal status --json``
run in a coordinator container.

Tears everything down on exit, also on failure or a signal: the stack, dockerd, the network
namespace, the DNS responder, chroot mounts. Secrets (the generated ``.env``) are never
printed. Exit status: 0 every scenario passed; 1 one failed; 2 the check could not run (one
line says why).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATE = Path(os.environ.get("SHOAL_CHECK_STATE", "/var/lib/shoal-compose-check"))
WORK = Path(os.environ.get("SHOAL_CHECK_WORK", "/var/tmp/shoal-compose-check"))
RUN = Path("/run/shoal-compose-check")
NETNS = "shoal-compose-check"
SOCK = RUN / "docker.sock"
BRIDGE_IP = "172.17.0.1"  # docker0 inside the namespace: the DNS responder listens there
PROJECT = "shoalcheck"
JOB = "digits"
NUM_SAMPLES = 5000  # shoal.examples.digits: DigitGlyphs(train=True)
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SECRET_VARS = ("REDIS_PASSWORD", "S3_ACCESS_KEY", "S3_SECRET_KEY", "SHOAL_API_TOKEN")

T0 = time.monotonic()
SECRETS: list[str] = []


class CheckFailed(Exception):
    """A scenario's verdict: FAIL, with one line saying why."""


class CannotRun(Exception):
    """The check cannot run here (exit 2, one line)."""


def redact(text: str) -> str:
    for s in SECRETS:
        if s:
            text = text.replace(s, "***")
    return text


def log(msg: str) -> None:
    print(f"[compose-check +{time.monotonic() - T0:5.0f}s] {redact(msg)}", flush=True)


def figure(scenario: str, name: str, value) -> None:
    if isinstance(value, float):
        value = f"{value:.1f}"
    print(f"  {scenario}.{name}={value}", flush=True)


def sh(cmd, *, check=True, timeout=600, input=None, env=None, cwd=None, quiet=False, logfile: Path | None = None
       ) -> subprocess.CompletedProcess:
    """Run a command; its output captured (and appended to ``logfile``). CheckFailed naming
    the command (redacted) and the last line of its output when it fails and ``check``."""
    try:
        res = subprocess.run(cmd, shell=isinstance(cmd, str), input=input, capture_output=True, timeout=timeout,
                             env=env, cwd=cwd, text=not isinstance(input, bytes))
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"timed out after {timeout} s: {redact(str(cmd))[:200]}") from None
    out = res.stdout if isinstance(res.stdout, str) else res.stdout.decode(errors="replace")
    err = res.stderr if isinstance(res.stderr, str) else res.stderr.decode(errors="replace")
    if logfile is not None:
        with open(logfile, "a") as fh:
            fh.write(redact(f"$ {cmd}\n{out}{err}\n"))
    if check and res.returncode != 0:
        last = (err.strip() or out.strip()).splitlines()[-1:] or ["(no output)"]
        raise CheckFailed(f"`{redact(str(cmd))[:160]}` exited {res.returncode}: {redact(last[0])[:300]}")
    res.stdout, res.stderr = out, err
    return res


def wait_until(what: str, fn, timeout: float, interval: float = 1.0):
    """fn()'s first truthy value; CheckFailed naming what was awaited after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise CheckFailed(f"waited {timeout:.0f} s for {what}")
        time.sleep(interval)


# ------------------------------------------------------------------------------------------
# the daemon, in its own network namespace


class Daemon:
    def __init__(self) -> None:
        self.docker = shutil.which("docker", path=str(Path(shutil.which("dockerd") or "/usr/bin/dockerd").parent)) \
            or shutil.which("docker")
        self.env = {**{k: v for k, v in os.environ.items()
                       if not k.startswith(("DOCKER_", "COMPOSE_")) and k not in SECRET_VARS},
                    "DOCKER_HOST": f"unix://{SOCK}", "COMPOSE_HTTP_TIMEOUT": "300"}
        self.proc: subprocess.Popen | None = None
        self.dns: subprocess.Popen | None = None
        self.netns = False

    def cgroup_wrapper(self) -> str:
        """A shell script that mounts the host's cgroup hierarchies again (``ip netns exec``
        remounted /sys) and execs dockerd."""
        lines = ["#!/bin/sh", "set -e"]
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _dev, point, fstype, opts, *_ = line.split()
            if point == "/sys/fs/cgroup" and fstype == "tmpfs":
                lines.append("mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup")
            elif point.startswith("/sys/fs/cgroup") and fstype in ("cgroup", "cgroup2"):
                keep = ",".join(o for o in opts.split(",") if o not in ("rw", "ro", "relatime", "nosuid", "nodev",
                                                                         "noexec", "seclabel"))
                lines.append(f"mkdir -p {point}; mount -t {fstype} {'-o ' + keep if keep else ''} {fstype} {point}")
        data = STATE / "docker"
        lines.append(f"exec nice -n 10 dockerd --storage-driver overlay2 --iptables=false --ip6tables=false "
                     f"--data-root {data} --exec-root {RUN}/exec --pidfile {RUN}/dockerd.pid "
                     f"--dns {BRIDGE_IP} -H unix://{SOCK}")
        return "\n".join(lines) + "\n"

    def start(self) -> None:
        RUN.mkdir(parents=True, exist_ok=True)
        if SOCK.exists() and sh([self.docker, "info"], check=False, env=self.env).returncode == 0:
            raise CannotRun(f"a daemon already answers on {SOCK} (another compose check running?)")
        if NETNS in sh(["ip", "netns", "list"]).stdout.split():
            sh(["ip", "netns", "delete", NETNS])  # left by a killed run: nothing can run in it any more
        sh(["ip", "netns", "add", NETNS])
        self.netns = True
        sh(["ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up"])
        wrapper = RUN / "start-dockerd.sh"
        wrapper.write_text(self.cgroup_wrapper())
        wrapper.chmod(0o755)
        self.proc = subprocess.Popen(["ip", "netns", "exec", NETNS, str(wrapper)], stdout=open(WORK / "dockerd.log", "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        wait_until("dockerd to answer (see dockerd.log)",
                   lambda: self.proc.poll() is not None or sh([self.docker, "info"], check=False, env=self.env)
                   .returncode == 0, 60)
        if self.proc.poll() is not None:
            tail = (WORK / "dockerd.log").read_text().strip().splitlines()[-1:]
            raise CannotRun(f"dockerd exited {self.proc.returncode}: {tail[0] if tail else ''}")
        self.dns = subprocess.Popen(["ip", "netns", "exec", NETNS, sys.executable, "-c", NXDOMAIN, BRIDGE_IP],
                                    stdout=open(WORK / "nxdns.log", "w"), stderr=subprocess.STDOUT,
                                    start_new_session=True)
        time.sleep(0.5)
        if self.dns.poll() is not None:
            raise CannotRun(f"the DNS responder could not listen on {BRIDGE_IP}:53 in {NETNS} (nxdns.log)")
        v = sh([self.docker, "version", "-f", "{{.Server.Version}}"], env=self.env).stdout.strip()
        log(f"dockerd {v} in network namespace {NETNS}, data root {STATE / 'docker'}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            ids = sh([self.docker, "ps", "-aq"], check=False, env=self.env, timeout=30).stdout.split()
            if ids:
                sh([self.docker, "rm", "-f", "-v", *ids], check=False, env=self.env, timeout=120)
            self.proc.terminate()  # ip netns exec execs the wrapper, which execs dockerd: the same pid
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.dns is not None and self.dns.poll() is None:
            self.dns.kill()
            self.dns.wait(10)
        if self.netns:
            sh(["ip", "netns", "delete", NETNS], check=False)
            self.netns = False
        for p in (SOCK, RUN / "dockerd.pid"):
            p.unlink(missing_ok=True)

    def docker_cmd(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return sh([self.docker, *args], env=self.env, **kw)

    def has_image(self, name: str) -> bool:
        return self.docker_cmd("image", "inspect", name, check=False).returncode == 0


NXDOMAIN = r'''
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 53))
while True:
    q, peer = s.recvfrom(4096)
    if len(q) >= 12:  # the question echoed; QR, opcode and RD kept, RA, rcode 3 (NXDOMAIN)
        flags = 0x8000 | (q[2] & 0x79) << 8 | 0x0080 | 3
        s.sendto(q[:2] + flags.to_bytes(2, "big") + q[4:6] + b"\0" * 6 + q[12:], peer)
'''


# ------------------------------------------------------------------------------------------
# images, built offline from Debian and PyPI packages


def debian_mirror() -> str:
    if os.environ.get("DEBIAN_MIRROR"):
        return os.environ["DEBIAN_MIRROR"].rstrip("/")
    for f in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for m in re.finditer(r"^URIs:\s*(\S+/debian)/?\s*$", f.read_text(), re.M):
            return m.group(1)
    for f in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*.list"))]:
        if f.exists():
            for m in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+/debian)/?\s", f.read_text(), re.M):
                return m.group(1)
    raise CannotRun("no Debian mirror in apt's sources (/etc/apt); set DEBIAN_MIRROR")


class Images:
    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.mounted: list[Path] = []
        self.mirror = debian_mirror()
        self.build_log = WORK / "images.log"

    def base(self) -> Path:
        base = STATE / "rootfs-base"
        if not (base / ".complete").exists():
            log(f"debootstrap --variant=minbase bookworm from {self.mirror}")
            shutil.rmtree(base, ignore_errors=True)
            sh(["nice", "-n", "10", "debootstrap", "--variant=minbase", "bookworm", str(base), self.mirror],
               timeout=900, logfile=self.build_log)
            (base / ".complete").touch()
        return base

    def rootfs(self, name: str) -> Path:
        d = WORK / f"rootfs-{name}"
        self.release(d)
        shutil.rmtree(d, ignore_errors=True)
        sh(["cp", "-a", str(self.base()), str(d)])
        (d / ".complete").unlink(missing_ok=True)
        shutil.copy("/etc/resolv.conf", d / "etc/resolv.conf")
        shutil.copy("/etc/ssl/certs/ca-certificates.crt", d / "tmp/host-ca.crt")  # the host's TLS trust, for pip
        policy = d / "usr/sbin/policy-rc.d"
        policy.write_text("#!/bin/sh\nexit 101\n")  # no service starts in the chroot
        policy.chmod(0o755)
        m = self.mirror
        (d / "etc/apt/sources.list").write_text(f"deb {m} bookworm main\ndeb {m} bookworm-updates main\n"
                                                f"deb {m.removesuffix('/debian')}/debian-security bookworm-security main\n")
        for what, args in (("proc", ["-t", "proc", "proc"]), ("dev", ["--rbind", "/dev"]), ("sys", ["--rbind", "/sys"])):
            sh(["mount", *args, str(d / what)])
            self.mounted.append(d / what)
        return d

    def release(self, d: Path) -> None:
        for what in ("sys", "dev", "proc"):
            p = d / what
            if p in self.mounted:
                sh(["umount", "-R", str(p)], check=False)
                self.mounted.remove(p)

    def finish(self, d: Path) -> None:
        self.release(d)
        for junk in ("var/lib/apt/lists", "var/cache/apt/archives", "root/.cache"):
            shutil.rmtree(d / junk, ignore_errors=True)
            (d / junk).mkdir(parents=True, exist_ok=True)
        for junk in ("tmp/host-ca.crt", "usr/sbin/policy-rc.d"):
            (d / junk).unlink(missing_ok=True)
        (d / "etc/resolv.conf").write_text("")

    def in_chroot(self, d: Path, script: str, timeout: int = 900) -> None:
        env = {"PATH": CLEAN_PATH, "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive", "PIP_CERT": "/tmp/host-ca.crt",
               "PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "LANG": "C.UTF-8"}
        sh(["nice", "-n", "10", "chroot", str(d), "/bin/bash", "-ec", script], env=env, timeout=timeout,
           logfile=self.build_log)

    def import_(self, d: Path, name: str, changes: list[str]) -> None:
        tar = subprocess.Popen(["tar", "-C", str(d), "--exclude=./.complete", "-c", "."], stdout=subprocess.PIPE)
        args = [self.d.docker, "import"] + [x for c in changes for x in ("--change", c)] + ["-", name]
        res = subprocess.run(args, stdin=tar.stdout, capture_output=True, text=True, env=self.d.env, timeout=600)
        tar.stdout.close()
        tar.wait()
        if res.returncode != 0 or tar.returncode != 0:
            raise CheckFailed(f"docker import {name} failed: {res.stderr.strip()[-300:]}")
        self.release(d)
        shutil.rmtree(d, ignore_errors=True)

    def torch_wheel(self) -> tuple[str, Path | None]:
        """(the torch requirement the Dockerfile pins, the CPU wheel of it for python3.11 when
        this machine's pip finds one, else from the Dockerfile's own TORCH_INDEX)."""
        text = (ROOT / "Dockerfile").read_text()
        req = re.search(r"\btorch==[\w.]+", text).group(0)
        index = re.search(r"^ARG TORCH_INDEX=(\S+)", text, re.M)
        dest = STATE / "wheels"
        dest.mkdir(parents=True, exist_ok=True)
        common = ["download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
                  "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d", str(dest), req]
        version = req.split("==")[1]
        found = lambda: sorted(dest.glob(f"torch-{version}+cpu-cp311-*.whl"))  # noqa: E731
        if not found():
            sh([sys.executable, "-m", "pip", *common], check=False, timeout=600, logfile=self.build_log)
        if not found() and index:
            sh([sys.executable, "-m", "pip", *common, "--index-url", index.group(1)], check=False, timeout=600,
               logfile=self.build_log)
        wheels = found()
        return req, (wheels[0] if wheels else None)

    def build_all(self) -> dict[str, float]:
        t = time.monotonic()
        built = []
        if not self.d.has_image("redis:7"):
            log("building redis:7 (Debian's redis-server)")
            d = self.rootfs("redis")
            self.in_chroot(d, """
                apt-get update -qq
                apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null
                mkdir -p /data /usr/local/etc/redis && chown redis:redis /data
                redis-server --version""")
            (d / "usr/local/bin/docker-entrypoint.sh").write_text(REDIS_ENTRYPOINT)
            (d / "usr/local/bin/docker-entrypoint.sh").chmod(0o755)
            self.finish(d)
            self.import_(d, "redis:7", ['WORKDIR /data', 'ENTRYPOINT ["docker-entrypoint.sh"]',
                                        'CMD ["redis-server"]', 'EXPOSE 6379'])
            built.append("redis:7")
        if not self.d.has_image("python:3.11-slim"):
            log("building python:3.11-slim (Debian's python3.11, CPU torch, shoal's dependencies, offline pip)")
            req, wheel = self.torch_wheel()
            if wheel is None:
                raise CannotRun(f"no CPU wheel of {req} for cp311 from this machine's pip or the Dockerfile's TORCH_INDEX")
            d = self.rootfs("python")
            deps = [x for x in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                    if not re.match(r"torch\b", x)]
            build_reqs = tomllib.loads((ROOT / "pyproject.toml").read_text()).get("build-system", {}).get(
                "requires", ["setuptools>=64", "wheel"])
            (d / "tmp/deps.txt").write_text("\n".join(deps) + "\n")
            (d / "tmp/build-reqs.txt").write_text("\n".join(build_reqs + ["wheel"]) + "\n")
            shutil.copy(wheel, d / "tmp" / wheel.name)
            self.in_chroot(d, f"""
                apt-get update -qq
                apt-get install -y -qq --no-install-recommends python3 python3-pip python3-venv python-is-python3 \
                    ca-certificates >/dev/null
                rm -f /usr/lib/python3.*/EXTERNALLY-MANAGED   # python:3.11-slim has no PEP 668 marker
                pip install -q /tmp/{wheel.name}
                pip install -q -r /tmp/deps.txt
                mkdir -p /opt/wheelhouse && pip download -q -d /opt/wheelhouse -r /tmp/build-reqs.txt
                rm -f /tmp/*.whl /tmp/*.txt
                python -c 'import torch; assert torch.__version__.endswith("+cpu"), torch.__version__'""")
            self.finish(d)
            self.import_(d, "python:3.11-slim", ["ENV LANG=C.UTF-8", "ENV PIP_NO_INDEX=1",
                                                 "ENV PIP_FIND_LINKS=/opt/wheelhouse", 'CMD ["python3"]'])
            built.append("python:3.11-slim")
        if not self.d.has_image("minio/minio:latest"):
            log("building minio/minio + minio/mc (moto's S3 behind minio and mc stand-ins)")
            d = self.rootfs("minio")
            for name, text in (("minio", MINIO_STANDIN), ("mc", MC_STANDIN)):
                (d / "usr/local/bin" / name).write_text(text)
                (d / "usr/local/bin" / name).chmod(0o755)
            self.in_chroot(d, """
                apt-get update -qq
                apt-get install -y -qq --no-install-recommends python3 python3-pip ca-certificates >/dev/null
                pip install -q --break-system-packages "moto[server]>=5.0" "waitress>=3.0" "minio>=7.2"
                python3 -c 'import moto, waitress, minio'""")
            self.finish(d)
            self.import_(d, "minio/minio:latest", ["WORKDIR /data", 'ENTRYPOINT ["minio"]', 'CMD ["server","/data"]',
                                                   "EXPOSE 9000"])
            self.d.docker_cmd("build", "-q", "-t", "minio/mc:latest", "-", input="FROM minio/minio:latest\n"
                              'ENTRYPOINT ["mc"]\nCMD ["--help"]\n')
            built.append("minio/minio+mc")
        return {"base_images_s": time.monotonic() - t, "built": ",".join(built) or "none (cached)"}

    def cleanup(self) -> None:
        for p in list(reversed(self.mounted)):
            sh(["umount", "-R", str(p)], check=False)
        self.mounted.clear()


REDIS_ENTRYPOINT = """#!/bin/sh
# like the official image: `redis-server` started as root drops to the user redis
set -e
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then set -- redis-server "$@"; fi
if [ "$1" = redis-server ] && [ "$(id -u)" = 0 ]; then
  find . \\! -user redis -exec chown redis "{}" +
  exec setpriv --reuid=redis --regid=redis --init-groups "$@"
fi
exec "$@"
"""

MINIO_STANDIN = r'''#!/usr/bin/env python3
"""Stand-in for `minio server DIR [--address HOST:PORT] [--console-address ...]` (built by
shoal's scripts/compose_check.py; MinIO has no Debian or PyPI package): moto's S3 in waitress
on :9000. Objects are kept in DIR/.standin-objects: restored at start, written there every
2 s when they changed and at SIGTERM, so a `docker compose down`/`up` keeps them, like MinIO.
Credentials are not checked."""
import hashlib, os, shutil, signal, sys, threading, time
from pathlib import Path
args = sys.argv[1:]
if not args or args[0] != "server":
    sys.exit("minio stand-in: only `minio server DIR` is supported")
data = Path(args[1] if len(args) > 1 else "/data") / ".standin-objects"
host, _, port = (args[args.index("--address") + 1] if "--address" in args else ":9000").rpartition(":")
from moto.moto_server.werkzeug_app import create_backend_app
from waitress import create_server
from minio import Minio
server = create_server(create_backend_app("s3"), host=host or "0.0.0.0", port=int(port), threads=16, ident="moto-s3")
threading.Thread(target=server.run, daemon=True).start()
client = Minio(f"127.0.0.1:{port}", access_key="standin", secret_key="standin", secure=False)
restored = 0
if data.is_dir():
    for bucket in sorted(p for p in data.iterdir() if p.is_dir()):
        client.make_bucket(bucket.name)
        for f in sorted(p for p in bucket.rglob("*") if p.is_file()):
            client.fput_object(bucket.name, f.relative_to(bucket).as_posix(), str(f))
            restored += 1
print(f"minio stand-in (moto S3) on {host or '0.0.0.0'}:{port}; {restored} object(s) restored from {data}", flush=True)
last = None
def dump():
    global last
    listing = [(b.name, [(o.object_name, o.etag) for o in client.list_objects(b.name, recursive=True)])
               for b in client.list_buckets()]
    if listing == last:
        return
    tmp = data.with_name(".standin-objects.new")
    shutil.rmtree(tmp, ignore_errors=True)
    for bucket, objects in listing:
        (tmp / bucket).mkdir(parents=True, exist_ok=True)
        for name, _etag in objects:
            client.fget_object(bucket, name, str(tmp / bucket / name))
    shutil.rmtree(data, ignore_errors=True)
    tmp.rename(data)
    last = listing
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
signal.signal(signal.SIGINT, lambda *_: stop.set())
while not stop.wait(2):
    try:
        dump()
    except Exception as exc:
        print(f"minio stand-in: snapshot failed: {exc}", flush=True)
dump()
print("minio stand-in: objects written, exiting", flush=True)
'''

MC_STANDIN = r'''#!/usr/bin/env python3
"""Stand-in for MinIO's `mc`, what compose.yaml uses: `mc ready ALIAS`, `mc alias set ALIAS URL
ACCESS SECRET`, `mc mb [--ignore-existing] ALIAS/BUCKET`."""
import json, os, sys, urllib.error, urllib.request
CFG = os.path.join(os.path.expanduser("~"), ".mc-standin.json")
def aliases():
    try:
        with open(CFG) as f:
            return json.load(f)
    except FileNotFoundError:
        return {"local": {"url": "http://127.0.0.1:9000", "access": "", "secret": ""}}
def main(argv):
    if argv[:1] == ["ready"]:
        url = aliases().get(argv[1] if len(argv) > 1 else "local", {}).get("url", "http://127.0.0.1:9000")
        try:
            urllib.request.urlopen(url + "/minio/health/ready", timeout=2)
        except urllib.error.HTTPError:
            pass  # any HTTP answer: up
        except OSError as e:
            print(f"mc stand-in: {url} not ready: {e}", file=sys.stderr)
            return 1
        return 0
    if argv[:2] == ["alias", "set"] and len(argv) >= 6:
        a = aliases()
        a[argv[2]] = {"url": argv[3].rstrip("/"), "access": argv[4], "secret": argv[5]}
        with open(os.open(CFG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(a, f)
        print(f"Added `{argv[2]}` successfully.")
        return 0
    if argv[:1] == ["mb"]:
        target = [x for x in argv[1:] if not x.startswith("-")][0]
        alias, _, bucket = target.partition("/")
        cfg = aliases()[alias]
        from urllib.parse import urlparse
        from minio import Minio
        u = urlparse(cfg["url"])
        client = Minio(u.netloc, access_key=cfg["access"], secret_key=cfg["secret"], secure=u.scheme == "https")
        if client.bucket_exists(bucket):
            if "--ignore-existing" in argv or "-p" in argv:
                print(f"Bucket `{target}` already exists.")
                return 0
            print(f"mc: Unable to make bucket `{target}`: it exists.", file=sys.stderr)
            return 1
        client.make_bucket(bucket)
        print(f"Bucket created successfully `{target}`.")
        return 0
    print(f"mc stand-in: unsupported: {' '.join(argv)}", file=sys.stderr)
    return 2
sys.exit(main(sys.argv[1:]))
'''


# ------------------------------------------------------------------------------------------
# the stack


VERDICT = r'''
import json, sys
from pathlib import Path
from shoal.worker import ledger
keep = json.loads(sys.argv[2])  # a step committed before keep["rolled_back_at"] and after keep["resumed_from"] was rolled back
entries = [e for e in ledger.read(Path("/ledger"))
           if keep.get("rolled_back_at") is None or e["t"] > keep["rolled_back_at"] or e["step"] <= keep["resumed_from"]]
v = ledger.verify(entries, int(sys.argv[1]))
print(json.dumps({"ok": v.ok, "steps": v.steps, "epochs": v.epochs_complete, "problem": v.problem,
                  "partial": v.partial_commits}))
'''


class Stack:
    def __init__(self, daemon: Daemon, *, ha: bool) -> None:
        self.d = daemon
        self.ha = ha
        self.files = ["compose.yaml"] + (["compose.ha.yaml"] if ha else []) + [str(WORK / "check.override.yaml")]
        self.log = WORK / ("stack-ha.log" if ha else "stack.log")

    def compose(self, *args: str, check=True, timeout=600, input=None, quiet=False) -> subprocess.CompletedProcess:
        cmd = ["nice", "-n", "10", "docker-compose", "--ansi", "never", "-p", PROJECT, "--env-file", str(WORK / "env")]
        for f in self.files:
            cmd += ["-f", f]
        return sh(cmd + list(args), check=check, timeout=timeout, env=self.d.env, cwd=ROOT, input=input,
                  logfile=None if quiet else self.log)

    def exec(self, service: str, *args: str, check=True, timeout=120, input=None, quiet=False
             ) -> subprocess.CompletedProcess:
        return self.compose("exec", "-T", service, *args, check=check, timeout=timeout, input=input, quiet=quiet)

    def ids(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).stdout.split()

    def inspect(self, cid: str, fmt: str) -> str:
        return self.d.docker_cmd("inspect", "-f", fmt, cid).stdout.strip()

    def up(self) -> float:
        t = time.monotonic()
        self.compose("up", "-d", timeout=600)
        return time.monotonic() - t

    def down(self, volumes: bool) -> float:
        t = time.monotonic()
        self.compose("down", *(["-v"] if volumes else []), "--remove-orphans", timeout=300)
        if volumes:
            reset_ledger()
        return time.monotonic() - t

    def status(self, job: str = JOB) -> dict | None:
        """``shoal status JOB --json`` in a coordinator container (None while it has no answer)."""
        for svc in ("coordinator-a", "coordinator-b"):
            res = self.exec(svc, "shoal", "status", job, "--json", check=False, timeout=60, quiet=True)
            if res.returncode == 0:
                try:
                    return json.loads(res.stdout)
                except json.JSONDecodeError:
                    pass
        return None

    def submit(self, job: str, epochs: int) -> None:
        """The example job under another name, its own checkpoints and more epochs, submitted
        through the stack's own ``submit`` service (as a user would: ``docker compose run``)."""
        reset_ledger()  # the ledger of one job at a time (its entries carry no job name)
        self.compose("run", "--rm", "--no-deps", "submit", "shoal", "submit", "examples/job-s3.yaml",
                     "--set", f"name={job}", "--set", f"epochs={epochs}",
                     "--set", f"checkpoint_uri=s3://shoal-checkpoints/{job}", timeout=180)

    def ledger(self) -> list[dict]:
        """The ledger's entries as the host sees the folder (read like ``ledger.read``)."""
        return read_ledger()

    def verify(self, keep: dict) -> dict:
        """``shoal.worker.ledger.verify`` of the ledger, run in the stack's own image."""
        return json.loads(self.exec("coordinator-a", "python", "-c", VERDICT, str(NUM_SAMPLES), json.dumps(keep),
                                    timeout=120).stdout)

    def wait_committed(self, step: int, timeout: float, world: int | None = None) -> list[dict]:
        def enough():
            es = self.ledger()
            if not es or max(e["step"] for e in es) < step:
                return None
            if world is not None and not any(e["step"] >= step and e["world"] == world for e in es):
                return None
            return es
        return wait_until(f"step {step} committed" + (f" by {world} workers" if world else ""), enough, timeout, 1)

    def wait_done(self, timeout: float, job: str = JOB, want: str = "completed") -> dict:
        def done():
            s = self.status(job)
            return s if s and s.get("state") in ("completed", "failed", "stopped") else None
        s = wait_until(f"job {job} to end", done, timeout, 2)
        if s["state"] != want:
            raise CheckFailed(f"job {job} ended {s['state']}: {str(s.get('reason') or '')[:200]}")
        return s

    def failure_notes(self) -> str:
        """The last lines of the shoal services' logs (redacted), for a failed verdict."""
        res = self.compose("logs", "--no-color", "--tail", "15", "coordinator-a", "coordinator-b", "agent",
                           check=False, timeout=60)
        return redact(res.stdout)


def reset_ledger() -> None:
    """An empty ledger folder (emptied, not replaced: running containers have it bind-mounted)."""
    d = WORK / "ledger"
    d.mkdir(parents=True, exist_ok=True)
    for f in d.iterdir():
        f.unlink()
    os.chown(d, 10001, 10001)  # the image's user shoal


def write_env_and_override() -> None:
    values = {"REDIS_PASSWORD": secrets.token_hex(32), "S3_ACCESS_KEY": "shoalcheck",
              "S3_SECRET_KEY": secrets.token_hex(32)}
    SECRETS.extend(values[k] for k in ("REDIS_PASSWORD", "S3_SECRET_KEY"))
    env = WORK / "env"
    env.touch(mode=0o600)
    env.chmod(0o600)
    env.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    # the only layer over the compose files: the suite's exactly-once ledger (SHOAL_LEDGER_DIR)
    ledger = WORK / "ledger"
    (WORK / "check.override.yaml").write_text(f"""# generated by scripts/compose_check.py: the workers' ledger of committed steps
services:
  agent:
    environment:
      SHOAL_LEDGER_DIR: /ledger
    volumes:
      - {ledger}:/ledger
  coordinator-a:
    volumes:
      - {ledger}:/ledger:ro
""")
    reset_ledger()


def read_ledger() -> list[dict]:
    """Every complete line of the workers' ledgers (the host side of the bind mount)."""
    out = []
    for f in sorted((WORK / "ledger").glob("ledger-*.jsonl")):
        *complete, _partial = f.read_text().split("\n")
        out += [json.loads(line) for line in complete if line]
    return out


def check_ledger(stack: Stack, total: int, scenario: str, keep: dict | None = None) -> dict:
    v = stack.verify(keep or {})
    if not v["ok"]:
        raise CheckFailed(f"ledger: {v['problem']}")
    if v["steps"] != total:
        raise CheckFailed(f"ledger: {v['steps']} steps committed, the job has {total}")
    figure(scenario, "steps_committed", v["steps"])
    figure(scenario, "epochs_complete", v["epochs"])
    figure(scenario, "steps_committed_twice", 0)
    figure(scenario, "partial_commits_resynced", v["partial"])
    return v


def progress(s: dict) -> tuple[int, int]:
    """(committed step, total steps) of ``shoal status --json``."""
    p = s.get("progress") or {}
    return int(p.get("step") or 0), int(p.get("total_steps") or 0)


def check_completed(s: dict, entries: list[dict], scenario: str) -> int:
    """The job's total steps; CheckFailed unless status and the ledger agree it trained them all."""
    step, total = progress(s)
    last = max(e["step"] for e in entries)
    figure(scenario, "status", f"{s['state']}@{step}/{total}")
    figure(scenario, "steps_redone_by_status", s.get("steps_redone") or 0)
    figure(scenario, "failures_declared", s.get("failures") or 0)
    if not total or step != total or last != total:
        raise CheckFailed(f"status says step {step}/{total}, the ledger's last committed step is {last}")
    return total


# ------------------------------------------------------------------------------------------
# scenarios


def scenario_up(stack: Stack) -> None:
    t, t_wall = time.monotonic(), time.time()
    figure("up", "up_s", stack.up())
    es = stack.wait_committed(1, 240)
    figure("up", "first_step_s", min(e["t"] for e in es) - t_wall)
    s = stack.wait_done(420)
    figure("up", "completed_s", time.monotonic() - t)
    entries = stack.ledger()
    measure_rate(entries)
    check_ledger(stack, check_completed(s, entries, "up"), "up")
    if s.get("failures"):
        raise CheckFailed(f"{s['failures']} worker failure(s) declared in a run without faults")
    figure("up", "workers", len({(e["worker"], e["pid"]) for e in entries}))
    figure("up", "generations", len({e["generation"] for e in entries}))


def scenario_api(stack: Stack) -> None:
    ids = stack.ids("api")
    if not ids:
        raise CheckFailed("compose.yaml has no `api` service")
    port = stack.compose("port", "api", "8080").stdout.strip()
    if not port.startswith("127.0.0.1:"):
        raise CheckFailed(f"the api service's port 8080 is published on {port or 'nothing'}, not loopback")
    url = f"http://{port}/health"
    probe = ("import sys, urllib.request\n"
             "try:\n r = urllib.request.urlopen(sys.argv[1], timeout=5); print(r.status, r.read().decode()[:300])\n"
             "except Exception as e:\n print(getattr(e, 'code', 0), str(e)[:200])\n")
    t = time.monotonic()

    def answer():
        res = sh(["ip", "netns", "exec", NETNS, sys.executable, "-c", probe, url], check=False, timeout=30)
        return res.stdout.strip() if res.stdout.startswith("200 ") else None
    body = wait_until(f"GET {url} to answer 200", answer, 120, 1)
    figure("api", "published", port)
    figure("api", "health_s", time.monotonic() - t)
    figure("api", "health", body.split(" ", 1)[1].replace(" ", "")[:160])


#: agent-crash, down-up and ha-primary-kill each submit the example job under another name with
#: more epochs, sized from the speed ``up`` measured on this machine: a fault must land mid-job
#: and the job must outlast the recovery (in CI, two workers trained the 3-epoch job in 9 s and
#: one survivor ended a 6-epoch job before the restarted agent's worker had started).
CRASH_JOB, RESUME_JOB, HA_JOB = "crash", "resume", "failover"
STEPS_PER_EPOCH = 79  # examples/job-s3.yaml: 5000 samples, global batch 64
#: steps per second of two workers (``up`` measures it; until then a fast machine's, so that a
#: job sized from it is long enough anywhere)
RATE = {"steps_per_s": 40.0}


def measure_rate(entries: list[dict]) -> None:
    """Two workers' steps per second in the ledger of a finished job (a figure of ``up``)."""
    two = sorted((e["t"], e["step"]) for e in entries if e["world"] == 2)
    if len(two) > 20 and two[-1][0] > two[0][0]:
        RATE["steps_per_s"] = (two[-1][1] - two[0][1]) / (two[-1][0] - two[0][0])
        figure("up", "steps_per_s", RATE["steps_per_s"])


def epochs_lasting(steps: int, seconds: float) -> int:
    """Epochs of a job that trains ``steps`` steps and then ``seconds`` more at two workers' speed."""
    return max(3, -(-int(steps + seconds * RATE["steps_per_s"]) // STEPS_PER_EPOCH))


def scenario_agent_crash(stack: Stack) -> None:
    t = time.monotonic()
    # a job far longer than the check: it is stopped once the restarted worker trains again
    stack.submit(CRASH_JOB, epochs_lasting(20, 900))
    before = stack.wait_committed(20, 300, world=2)
    victim = stack.ids("agent")[-1]
    name = stack.inspect(victim, "{{.Name}}").lstrip("/")
    restarts = int(stack.inspect(victim, "{{.RestartCount}}"))
    pid = int(stack.inspect(victim, "{{.State.Pid}}"))
    last = max(e["step"] for e in before)
    workers_before = {e["worker"] for e in before}
    t_kill = time.time()
    generation = max(e["generation"] for e in stack.ledger())
    os.kill(pid, signal.SIGKILL)
    log(f"kill -9 {pid} (PID 1 of {name}, host PID) at step {last} of job {CRASH_JOB}")

    def restarted():
        return int(stack.inspect(victim, "{{.RestartCount}}")) > restarts and \
            stack.inspect(victim, "{{.State.Running}}") == "true"
    wait_until(f"{name} to be restarted", restarted, 60, 0.5)
    figure("agent-crash", "restart_s", time.time() - t_kill)

    def rejoined():
        es = stack.ledger()
        new = [e for e in es if e["t"] > t_kill and e["worker"] not in workers_before and e["world"] == 2]
        return es if len(new) >= 10 else None  # ten steps together, not a join that fails again
    es = wait_until("the restarted agent's worker to commit 10 steps with the other worker", rejoined, 300, 1)
    after = sorted((e for e in es if e["t"] > t_kill), key=lambda e: e["t"])
    # the cost of the crash: until the survivor commits in a new generation without the lost worker
    figure("agent-crash", "recovery_s", min(e["t"] for e in after if e["generation"] > generation) - t_kill)
    figure("agent-crash", "rejoin_s", min(e["t"] for e in after if e["worker"] not in workers_before) - t_kill)
    figure("agent-crash", "steps_by_one_worker", len({e["step"] for e in after if e["world"] == 1}))
    # the job is stopped as a user would (`shoal stop`): every committed step exactly once, the
    # last one the step status reports, both workers out cleanly (the agents take the next job)
    stack.exec("coordinator-a", "shoal", "stop", CRASH_JOB, timeout=60)
    s = stack.wait_done(120, CRASH_JOB, want="stopped")
    figure("agent-crash", "elapsed_s", time.monotonic() - t)
    v = stack.verify({})
    if not v["ok"]:
        raise CheckFailed(f"ledger: {v['problem']}")
    step, _total = progress(s)
    last = max(e["step"] for e in stack.ledger())
    figure("agent-crash", "status", f"{s['state']}@{step}")
    if step != last:
        raise CheckFailed(f"stopped at step {step} by status, the ledger's last committed step is {last}")
    figure("agent-crash", "steps_committed", v["steps"])
    figure("agent-crash", "steps_committed_twice", 0)
    figure("agent-crash", "partial_commits_resynced", v["partial"])


def scenario_down_up(stack: Stack) -> None:
    t = time.monotonic()
    # `down` past the first checkpoint (checkpoint_interval 50), and enough of the job after `up`
    stack.submit(RESUME_JOB, epochs_lasting(65, 40))
    job = RESUME_JOB
    stack.wait_committed(65, 300)
    # `down` is stop + remove: stopped first, so that how the agents ended can be read
    agents = stack.ids("agent")
    t0 = time.monotonic()
    stack.compose("stop", timeout=300)
    stop_s = time.monotonic() - t0
    exits = [stack.inspect(a, "{{.State.ExitCode}}") for a in agents]
    stack.compose("logs", "--no-color", "--tail", "25", "agent", "coordinator-a", "coordinator-b", check=False)
    down_s = stop_s + stack.down(volumes=False)
    t_down = time.time()
    figure("down-up", "agent_exit_codes", ",".join(exits))
    if any(x != "0" for x in exits):  # 137: killed at the stop timeout, its workers with it (not drained)
        raise CheckFailed(f"`docker-compose stop` did not drain the agents: exit codes {','.join(exits)}")
    reached = max(e["step"] for e in read_ledger())
    figure("down-up", "down_s", down_s)
    figure("down-up", "step_at_down", reached)
    figure("down-up", "up_again_s", stack.up())
    es = wait_until("a step committed after `up`", lambda: [e for e in stack.ledger() if e["t"] > t_down] or None,
                    300, 1)
    resumed = min(e["step"] for e in es) - 1
    figure("down-up", "first_commit_after_up_s", min(e["t"] for e in es) - t_down)
    figure("down-up", "resumed_from_step", resumed)
    figure("down-up", "steps_redone", reached - resumed)
    if resumed <= 0:
        raise CheckFailed(f"the job restarted from step 0 after down/up (it had reached step {reached})")
    if resumed != reached:  # the last worker to drain checkpoints the step it reached
        raise CheckFailed(f"the job resumed from step {resumed} after down/up, not from step {reached} where `down` "
                          f"drained it: {reached - resumed} step(s) redone")
    s = stack.wait_done(600, job)
    figure("down-up", "elapsed_s", time.monotonic() - t)
    entries = stack.ledger()
    # the steps committed after the checkpoint before `down` were rolled back with it: the
    # ledger without them must be exactly once
    check_ledger(stack, check_completed(s, entries, "down-up"), "down-up",
                 {"rolled_back_at": t_down, "resumed_from": resumed})
    submit = stack.compose("ps", "-a", "-q", "submit").stdout.split()
    if submit:
        figure("down-up", "submit_service_exit_after_up", stack.inspect(submit[0], "{{.State.ExitCode}}"))


def scenario_ha_primary_kill(stack: Stack) -> None:
    t = time.monotonic()
    figure("ha-primary-kill", "up_s", stack.up())
    # the stack's own job first (its `submit` service), then one long enough to outlast the fail-over
    stack.wait_done(420)
    stack.submit(HA_JOB, epochs_lasting(40, 40))
    before = stack.wait_committed(40, 300, world=2)
    agents = stack.ids("agent")
    agent_state = {a: (stack.inspect(a, "{{.State.Pid}}"), stack.inspect(a, "{{.RestartCount}}")) for a in agents}
    procs_before = {a: worker_pids(stack, a) for a in agents}
    last = max(e["step"] for e in before)
    members = {(e["worker"], e["pid"]) for e in before if e["step"] == last}
    def master() -> str | None:
        res = stack.exec("sentinel-0", "redis-cli", "-p", "26379", "sentinel", "get-master-addr-by-name", "shoal",
                         check=False, timeout=20, quiet=True)
        addr = res.stdout.split()
        return addr[0] if res.returncode == 0 and addr else None
    old = master()
    primary = stack.ids(old if old in ("redis", "redis-1", "redis-2") else "redis")[0]
    t_kill = time.time()
    stack.d.docker_cmd("kill", primary)
    log(f"docker kill of the Redis primary ({old}) at step {last}; "
        f"worker host PIDs {sorted(p for v in procs_before.values() for p in v)}")

    def promoted():
        addr = master()
        return addr if addr and addr != old else None
    new = wait_until("the sentinels to promote a replica", promoted, 60, 0.5)
    figure("ha-primary-kill", "failover_s", time.time() - t_kill)
    figure("ha-primary-kill", "new_primary", new)
    es = wait_until("a step committed after the fail-over",
                    lambda: [e for e in stack.ledger() if e["t"] > t_kill] or None, 120, 1)
    figure("ha-primary-kill", "first_commit_after_kill_s", min(e["t"] for e in es) - t_kill)
    procs_after = {a: worker_pids(stack, a) for a in agents}
    s = stack.wait_done(420, HA_JOB)
    figure("ha-primary-kill", "completed_s", time.monotonic() - t)
    entries = stack.ledger()
    after = [e for e in entries if e["t"] > t_kill]
    lost = sum(1 for p in procs_before for x in procs_before[p] if x not in procs_after.get(p, set()))
    figure("ha-primary-kill", "worker_processes_lost", lost)
    if lost:
        raise CheckFailed(f"worker processes changed across the fail-over: {procs_before} -> {procs_after}")
    changed = [a for a in agents if (stack.inspect(a, "{{.State.Pid}}"), stack.inspect(a, "{{.RestartCount}}"))
               != agent_state[a]]
    figure("ha-primary-kill", "agents_restarted", len(changed))
    if changed:
        raise CheckFailed(f"{len(changed)} agent container(s) restarted across the fail-over")
    newcomers = {(e["worker"], e["pid"]) for e in after} - members
    if newcomers:
        raise CheckFailed(f"steps after the kill were committed by other processes: {sorted(newcomers)[:4]}")
    final = check_completed(s, entries, "ha-primary-kill")
    if {(e["worker"], e["pid"]) for e in entries if e["step"] == final} != members:
        raise CheckFailed("not every worker that trained before the kill committed the last step")
    times = sorted(e["t"] for e in entries)
    figure("ha-primary-kill", "longest_gap_between_commits_s", max(b - a for a, b in zip(times, times[1:])))
    check_ledger(stack, final, "ha-primary-kill")
    figure("ha-primary-kill", "steps_lost", 0)


def worker_pids(stack: Stack, cid: str) -> set[int]:
    """Host PIDs of the training worker processes in an agent container (``docker top``)."""
    res = stack.d.docker_cmd("top", cid, "-eo", "pid,args", check=False)
    out = set()
    for line in res.stdout.splitlines()[1:]:
        pid, _, args = line.strip().partition(" ")
        if "worker" in args and "agent" not in args:
            out.add(int(pid))
    return out


# ------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated scenarios (default all): up,api,agent-crash,down-up,ha")
    ap.add_argument("--keep", action="store_true", help="leave the last stack and dockerd running (for a look)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise CannotRun("needs root (a network namespace, mounts, chroot, dockerd)")
    missing = [c for c in ("dockerd", "docker-compose", "debootstrap", "ip", "chroot") if not shutil.which(c)]
    if missing:
        raise CannotRun(f"missing {', '.join(missing)} (apt-get install docker.io docker-compose debootstrap iproute2)")
    WORK.mkdir(parents=True, exist_ok=True)
    STATE.mkdir(parents=True, exist_ok=True)
    for f in WORK.glob("*.log"):
        f.unlink()
    lock = open(STATE / "lock", "w")
    import fcntl
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise CannotRun(f"another compose check holds {STATE / 'lock'}") from None

    daemon = Daemon()
    images = Images(daemon)
    stacks: list[Stack] = []
    results: list[tuple[str, bool, str]] = []

    def teardown(*_sig) -> None:
        if args.keep and not _sig:
            log(f"kept running: DOCKER_HOST=unix://{SOCK}, ip netns exec {NETNS} ...")
            return
        for st in stacks:
            st.compose("down", "-v", "--remove-orphans", check=False, timeout=180)
        daemon.stop()
        images.cleanup()
        (WORK / "env").unlink(missing_ok=True)
        if _sig:
            log(f"stopped by signal {_sig[0]}; torn down")
            os._exit(1)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, teardown)
    try:
        daemon.start()
        figs = images.build_all()
        figure("images", "base_images_s", figs["base_images_s"])
        figure("images", "built", figs["built"])
        t = time.monotonic()
        daemon.docker_cmd("build", "-q", "--network", "none", "-t", "shoal:local", str(ROOT), timeout=900)
        figure("images", "shoal_build_s", time.monotonic() - t)
        size = int(daemon.docker_cmd("image", "inspect", "-f", "{{.Size}}", "shoal:local").stdout.strip())
        figure("images", "shoal_local_MB", size // 10**6)
        torch_v = daemon.docker_cmd("run", "--rm", "--network", "none", "shoal:local", "python", "-c",
                                    "import torch; print(torch.__version__)").stdout.strip()
        figure("images", "torch", torch_v)
        write_env_and_override()

        wanted = [x for x in args.only.split(",") if x] or ["up", "api", "agent-crash", "down-up", "ha"]
        plan = [("up", False, scenario_up), ("api", False, scenario_api), ("agent-crash", False, scenario_agent_crash),
                ("down-up", False, scenario_down_up), ("ha-primary-kill", True, scenario_ha_primary_kill)]
        single, ha = Stack(daemon, ha=False), Stack(daemon, ha=True)
        stacks.extend([single, ha])
        current: Stack | None = None
        for name, is_ha, fn in plan:
            if name not in wanted and name.split("-")[0] not in wanted:
                continue
            stack = ha if is_ha else single
            # one stack for up, api, agent-crash and down-up (in that order), another for ha
            if current is not None and current is not stack:
                current.down(volumes=True)
                current = None
            if current is None and name not in ("up", "ha-primary-kill"):  # those two time their own `up`
                stack.up()
            current = stack
            log(f"scenario {name}: {'compose.yaml + compose.ha.yaml' if is_ha else 'compose.yaml'}")
            try:
                fn(stack)
                results.append((name, True, ""))
                print(f"PASS {name}", flush=True)
            except CheckFailed as exc:
                results.append((name, False, str(exc)))
                print(f"FAIL {name}: {redact(str(exc))}", flush=True)
                print(stack.failure_notes(), flush=True)
        if current is not None and not args.keep:
            current.down(volumes=True)
    except CheckFailed as exc:
        results.append(("setup", False, str(exc)))
        print(f"FAIL setup: {redact(str(exc))}", flush=True)
    finally:
        teardown()
    figure("total", "elapsed_s", time.monotonic() - T0)
    failed = [n for n, ok, _ in results if not ok]
    print(f"compose check: {len(results) - len(failed)} passed, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else ""), flush=True)
    return 1 if failed or not results else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CannotRun as exc:
        print(f"compose check: cannot run: {exc}", file=sys.stderr)
        sys.exit(2)
