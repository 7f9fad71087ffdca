"""The cluster file (``cluster.yaml``): which nodes exist and what each can run.

A node is reached either in-process (``transport: local``) or over ``ssh``; it offers GPUs
(each with its VRAM and memory type) and/or CPU cores. The node agent asks
:func:`workers_for_node` how many workers to start and on which devices:

* a node with GPUs runs one worker per GPU, at most ``max_workers`` of them (its CPU
  cores then only feed those workers);
* a CPU-only node runs ``min(max_workers, cpu_cores)`` workers on ``cpu``.

Not all VRAM is usable by a worker: the driver, the CUDA context and (on unified memory)
the operating system take their share, so usable VRAM is ``vram_mb`` x a reserve factor
(:data:`RESERVE_FACTOR`: 0.85 for discrete, 0.60 for unified memory).

Every validation failure is a :class:`~shoal.core.errors.ConfigError` whose message is one line
naming the file, the node and the field. The file holds no credentials: ssh uses the
operator's keys/agent, Redis and S3 credentials come from the environment.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shoal.core.errors import ConfigError, ShoalError
from shoal.core.yamlfile import printable, read_yaml


class Transport(str, Enum):
    local = "local"
    ssh = "ssh"


class MemoryType(str, Enum):
    discrete = "discrete"
    unified = "unified"


#: Fraction of a GPU's VRAM a worker may plan to use, by memory type.
RESERVE_FACTOR: dict[MemoryType, float] = {MemoryType.discrete: 0.85, MemoryType.unified: 0.60}

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Host names, IPv4 and (bracketed or bare) IPv6 with an optional zone. Never starting with
# '-' so a host can never be read by ssh as an option (``-oProxyCommand=...``).
_HOST = re.compile(r"^[A-Za-z0-9_:\[][A-Za-z0-9_.:%\[\]-]{0,252}$")
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def is_loopback_host(host: str) -> bool:
    """True when ``host`` names this machine: localhost, 127.0.0.0/8, ::1, 0.0.0.0, ``::``."""
    h = host.strip().strip("[]").lower().rstrip(".")
    if h in _LOOPBACK_NAMES or h.endswith(".localhost"):
        return True
    try:
        addr = ipaddress.ip_address(h.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback or addr.is_unspecified


class Gpu(BaseModel):
    """One GPU. ``uuid`` is the driver's id (``nvidia-smi -L``); without it the index is used."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uuid: Annotated[str | None, Field(min_length=1, max_length=128)] = None
    type: Annotated[str, Field(min_length=1, max_length=64)] = "gpu"
    vram_mb: Annotated[int, Field(ge=0)]
    memory_type: MemoryType = MemoryType.discrete

    @field_validator("uuid")
    @classmethod
    def _uuid_form(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]*", v):
            raise ValueError("use letters, digits, '-', '_', '.', ':' only (e.g. GPU-8f3c...)")
        return v

    @field_validator("vram_mb")
    @classmethod
    def _has_vram(cls, v: int) -> int:
        if v == 0:
            raise ValueError("GPU has zero VRAM (vram_mb must be > 0)")
        return v

    @property
    def usable_vram_mb(self) -> int:
        """VRAM a worker may plan for: ``vram_mb`` x the reserve factor of its memory type."""
        return int(self.vram_mb * RESERVE_FACTOR[self.memory_type])


class Node(BaseModel):
    """One machine. ``max_workers`` caps the workers it runs (None: one per GPU / core)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    host: str | None = None
    transport: Transport = Transport.local
    user: str | None = None
    gpus: list[Gpu] = Field(default_factory=list)
    max_workers: Annotated[int | None, Field(ge=0)] = None
    cpu_cores: Annotated[int, Field(ge=0)] = 0
    ram_mb: Annotated[int, Field(ge=0)] = 0

    @field_validator("name")
    @classmethod
    def _name_form(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("use 1-64 letters, digits, '_', '.', '-' (starting with a letter or digit)")
        return v

    @field_validator("host")
    @classmethod
    def _host_form(cls, v: str | None) -> str | None:
        if v is not None and not _HOST.match(v):
            raise ValueError(
                "not a host name or address (no spaces, no '@' (use 'user'), must not start with '-')"
            )
        return v

    @field_validator("user")
    @classmethod
    def _user_form(cls, v: str | None) -> str | None:
        if v is not None and not _USER.match(v):
            raise ValueError("use letters, digits, '_', '.', '-' (must not start with '-')")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "Node":
        if self.max_workers == 0:
            raise ValueError("zero capacity: max_workers is 0")
        if not self.gpus and self.cpu_cores == 0:
            raise ValueError("zero capacity: no gpus and cpu_cores is 0")
        dup = sorted(u for u, n in Counter(g.uuid for g in self.gpus if g.uuid).items() if n > 1)
        if dup:
            raise ValueError(f"duplicate GPU uuid {dup[0]!r}: each GPU may be listed once")
        if self.transport is Transport.ssh:
            if not self.host:
                raise ValueError("transport ssh needs a host")
            if is_loopback_host(self.host):
                raise ValueError(
                    f"transport ssh to loopback host {self.host!r}: use transport: local for this machine"
                )
        return self

    @property
    def workers(self) -> int:
        """How many workers this node runs (see the module docstring)."""
        devices = len(self.gpus) if self.gpus else self.cpu_cores
        return devices if self.max_workers is None else min(self.max_workers, devices)

    @property
    def address(self) -> str:
        """``user@host`` for ssh, the host (or ``localhost``) otherwise. Holds no secret."""
        host = self.host or "localhost"
        if self.transport is Transport.ssh and self.user:
            return f"{self.user}@{host}"
        return host


class Cluster(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: list[Node] = Field(default_factory=list)

    @model_validator(mode="after")
    def _nodes(self) -> "Cluster":
        if not self.nodes:
            raise ValueError("cluster has no nodes: list at least one under 'nodes:'")
        dup = sorted(n for n, c in Counter(node.name for node in self.nodes).items() if c > 1)
        if dup:
            raise ValueError(f"duplicate node name {dup[0]!r}: node names must be unique")
        return self

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        known = ", ".join(n.name for n in self.nodes)
        raise ConfigError(f"no node named {name!r} in the cluster (nodes: {known})")


# --- loading --------------------------------------------------------------------------------


def _loc(loc: tuple[Any, ...], data: object) -> str:
    """Render a pydantic error location, naming nodes by name: ``nodes[gpu-1].gpus[0].vram_mb``."""
    out = ""
    cur: object = data
    for part in loc:
        if isinstance(part, int):
            label = printable(part)
            if out == "nodes" and isinstance(cur, list) and part < len(cur):
                name = cur[part].get("name") if isinstance(cur[part], dict) else None
                names = [n.get("name") for n in cur if isinstance(n, dict)]
                if isinstance(name, str) and _NAME.match(name) and names.count(name) == 1:
                    label = name
            out += f"[{label}]"
        else:
            out += f".{printable(part)}" if out else printable(part)
        if isinstance(cur, dict):
            cur = cur.get(part)
        elif isinstance(cur, list) and isinstance(part, int) and part < len(cur):
            cur = cur[part]
        else:
            cur = None
    return out


def _format_errors(exc: ValidationError, data: object) -> str:
    parts = []
    for err in exc.errors(include_input=False, include_url=False):
        msg = err["msg"].removeprefix("Value error, ").replace("\n", " ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        where = _loc(err["loc"], data)
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


def parse_cluster(data: object, source: str = "cluster file") -> Cluster:
    """Validate a mapping as a Cluster; raises a one-line ConfigError naming node and field."""
    if data is None:
        raise ConfigError(f"{source}: empty: list at least one node under 'nodes:'")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with a 'nodes' list, got {type(data).__name__}")
    if "nodes" not in data and data:
        found = ", ".join(printable(k) for k in list(data)[:5]) + (", ..." if len(data) > 5 else "")
        raise ConfigError(f"{source}: not a cluster file: no 'nodes' list (found: {found})")
    try:
        return Cluster.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid: {_format_errors(exc, data)}") from exc


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a YAML cluster file; every failure is a one-line ConfigError."""
    return parse_cluster(read_yaml(path, "cluster file"), str(path))


# --- capacity ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CapacityRow:
    """One line of :func:`capacity_table`; the last row (``node == "TOTAL"``) sums the others."""

    node: str
    transport: str
    address: str
    workers: int
    gpus: int
    usable_vram_per_gpu_mb: tuple[int, ...]
    usable_vram_mb: int
    cpu_cores: int
    ram_mb: int


TOTAL = "TOTAL"


def capacity_table(cluster: Cluster) -> list[CapacityRow]:
    """Per node: workers, usable VRAM per GPU and in total, cores, RAM; then a TOTAL row.

    VRAM columns cover every GPU listed, including any beyond ``max_workers`` (left idle)."""
    rows = []
    for n in cluster.nodes:
        per_gpu = tuple(g.usable_vram_mb for g in n.gpus)
        rows.append(
            CapacityRow(
                node=n.name,
                transport=n.transport.value,
                address=n.address,
                workers=n.workers,
                gpus=len(n.gpus),
                usable_vram_per_gpu_mb=per_gpu,
                usable_vram_mb=sum(per_gpu),
                cpu_cores=n.cpu_cores,
                ram_mb=n.ram_mb,
            )
        )
    rows.append(
        CapacityRow(
            node=TOTAL,
            transport="",
            address="",
            workers=sum(r.workers for r in rows),
            gpus=sum(r.gpus for r in rows),
            usable_vram_per_gpu_mb=(),
            usable_vram_mb=sum(r.usable_vram_mb for r in rows),
            cpu_cores=sum(r.cpu_cores for r in rows),
            ram_mb=sum(r.ram_mb for r in rows),
        )
    )
    return rows


@dataclass(frozen=True)
class WorkerSlot:
    """One worker a node runs: ``device`` is ``cpu`` or ``cuda:<gpu uuid, else gpu index>``."""

    device: str
    node: str = ""
    slot: int = 0
    usable_vram_mb: int = 0


def workers_for_node(cluster: Cluster, node_name: str) -> list[WorkerSlot]:
    """The workers node ``node_name`` runs, in slot order. Unknown node: ConfigError."""
    n = cluster.node(node_name)
    if n.gpus:
        return [
            WorkerSlot(
                device=f"cuda:{g.uuid if g.uuid else i}",
                node=n.name,
                slot=i,
                usable_vram_mb=g.usable_vram_mb,
            )
            for i, g in enumerate(n.gpus[: n.workers])
        ]
    return [WorkerSlot(device="cpu", node=n.name, slot=i) for i in range(n.workers)]


# --- CLI ---------------------------------------------------------------------------------------


def _per_gpu(values: tuple[int, ...]) -> str:
    if not values:
        return "-"
    if len(set(values)) == 1:
        return str(values[0]) if len(values) == 1 else f"{len(values)}x{values[0]}"
    return ",".join(str(v) for v in values)


def format_table(rows: list[CapacityRow]) -> str:
    """The capacity table as aligned text (text columns left, numbers right)."""
    header = ("NODE", "TRANSPORT", "ADDRESS", "WORKERS", "GPUS", "VRAM/GPU MB", "VRAM MB", "CORES", "RAM MB")
    numeric = {3, 4, 5, 6, 7, 8}
    body = [
        (
            r.node,
            r.transport,
            r.address,
            str(r.workers),
            str(r.gpus),
            _per_gpu(r.usable_vram_per_gpu_mb) if r.node != TOTAL else "",
            str(r.usable_vram_mb),
            str(r.cpu_cores),
            str(r.ram_mb) if r.ram_mb else "-",
        )
        for r in rows
    ]
    table = [header, *body]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return "\n".join(line(r) for r in table)


def _fail(exc: ShoalError) -> int:
    print(f"shoal: {exc}", file=sys.stderr)
    return exc.exit_code


def cli_validate(path: str | Path) -> int:
    """``shoal cluster validate FILE``: one line on stdout (0) or ``shoal: <error>`` on stderr (2)."""
    try:
        cluster = load_cluster(path)
    except ShoalError as exc:
        return _fail(exc)
    total = capacity_table(cluster)[-1]
    print(
        f"{path}: ok: {len(cluster.nodes)} node(s), {total.workers} worker(s), "
        f"{total.gpus} GPU(s), {total.cpu_cores} CPU core(s)"
    )
    return 0


def cli_show(path: str | Path) -> int:
    """``shoal cluster show FILE``: the capacity table (usable VRAM after the reserve factor)."""
    try:
        cluster = load_cluster(path)
    except ShoalError as exc:
        return _fail(exc)
    print(format_table(capacity_table(cluster)))
    return 0
