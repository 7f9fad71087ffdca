"""Process groups as objects: making a generation's groups, their collectives, aborting them.

A *generation* is one fixed membership of the job (world size, rank of each worker), chosen by
the coordinator. A worker process owns one :class:`Rendezvous` for its job; it makes every
group the process joins - torch's registered default group of a generation
(:meth:`Rendezvous.join`: a data-parallel generation's group, or an HSDP replica group's
shard group) and standalone gloo groups (:meth:`Rendezvous.standalone`: an HSDP generation's
cross-replica groups) - each meeting through :class:`shoal.worker.store.RedisStore` under its
own store prefix, and returns it as a :class:`Group` object. Nothing here keeps a "current
group": the group's owner (a training layout, :mod:`shoal.worker.layout`) holds it, hands it to
whatever runs collectives on it (the step engine, the reducer, the state transfer) and closes it
when its generation ends. Generations strictly increase within a process: a prefix is never
reused (re-using one after ``destroy_process_group`` can hang). This module holds no mutable
state of its own (``tests/packaging/test_layout.py`` checks).

Backend and device: what the worker's placement chose (:mod:`shoal.worker.placement`: NCCL
when every worker of the node has a GPU of its own, else gloo, with the model on the GPU when
one is visible); without one, nccl when CUDA is available, gloo otherwise. gloo all-reduces
and broadcasts CUDA tensors, but its point-to-point send and receive take host memory only:
:meth:`Group.isend`, :meth:`Group.recv` and :meth:`Group.recv_many` stage a CUDA tensor
through a host copy when the group is gloo.

The address gloo advertises to the peers (:func:`choose_address`): the interface named by the
``iface`` option (``--iface`` / ``SHOAL_IFACE``); else an interface the user named in
``GLOO_SOCKET_IFNAME``; else the interface holding the local address of this worker's
connection to Redis - every peer reaches Redis, so that address routes by construction (gloo's
own default is the host name's address, 127.0.0.1 on many hosts). A loopback or unknown local
address (Redis on this host, a unix socket) leaves gloo's default. When the group cannot
connect, the RendezvousFailed message is one line naming the peer address tried, the address
advertised, where it came from, and the option that changes it.

Aborting. A collective never decides that a peer failed (its timeout, derived from the job's
``step_timeout``, is only a backstop): the coordinator does, from heartbeats and step
progress, and publishes a table naming the members it ``evicted``. Any thread may then abort
exactly the group concerned: :meth:`Group.request_abort` on the object, or
:meth:`Rendezvous.request_abort` for the registered group of one generation still being
joined (an abort asked for while a group forms holds for the group formed). Every wait of a
group is on an event that the work's completion *or* an abort sets, so a collective in flight
with a hung, partitioned or dead peer returns at once with CollectiveFailed, and every later one
of that group fails before it starts; an abort lives and dies with its group object, never
with a generation number that a later group could share. gloo cannot cancel a collective in
flight (``abort()`` and ``shutdown()`` leave it blocked), so an aborted group is *abandoned*:
removed from torch at once (the next generation's group forms immediately, on its own store
prefix) and freed by a thread once its stuck work ends (a peer closing, or the group's
timeout). Tensors handed to an abandoned collective may still be written by it: callers must
not reuse them (``Group.abort_reason`` tells; the step engine allocates a new bucket). An NCCL
group is aborted (``ncclCommAbort``) before it is dropped, so a dead NCCL peer never hangs the
survivors.

This module is the one place where torch.distributed and redis-py errors of the training side
are translated (:func:`translate_error`); a group's collectives (:meth:`Group.all_reduce`,
:meth:`Group.all_reduce_async` whose :class:`PendingReduce` waits the same way,
:meth:`Group.broadcast`, :meth:`Group.barrier`) and its point-to-point transfers
(:meth:`Group.isend`, reaped by the next all-reduce, :meth:`Group.recv`,
:meth:`Group.recv_many`) raise only :class:`~worker.errors.CollectiveFailed`.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import redis
import torch
import torch.distributed as dist

from shoal.events.keys import job_keys
from shoal.worker.classify import connect_cause, formation_error, peer_connect_failed, timed_out
from shoal.worker.errors import (
    CollectiveFailed,
    InterfaceUnavailable,
    RendezvousFailed,
    RendezvousTimeout,
    WorkerError,
)
from shoal.worker import torch_compat as tc
from shoal.worker.placement import local_device
from shoal.worker.store import RedisStore, legacy_rendezvous
from shoal.events import envvars

log = logging.getLogger(__name__)


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"`` (for callers without a placement)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for(backend: str) -> torch.device:
    """The device of a group of ``backend`` without a placement: this worker's GPU for nccl
    (:func:`shoal.worker.placement.local_device`), the CPU for gloo."""
    return local_device("cuda" if backend == "nccl" else "cpu")


# --- the address gloo advertises ------------------------------------------------------------
#: The environment variable of the interface option (CLI: ``--iface`` of worker and agent).
IFACE_ENV = envvars.IFACE
#: gloo's own variable: read when a gloo group is created (torch's ``ProcessGroupGloo``
#: constructor; ``init_process_group`` ignores ``pg_options`` for gloo, so no device can be
#: handed in). An address, not an interface, cannot be given to gloo.
GLOO_IFACE_ENV = "GLOO_SOCKET_IFNAME"
_OPTION = f"--iface/{IFACE_ENV}"
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Advertised:
    """Where this worker's gloo listens and what it tells its peers: ``address`` on ``iface``
    ("": gloo's default, the host name's address), chosen because of ``source``."""

    address: str
    iface: str
    source: str

    def describe(self) -> str:
        """E.g. ``10.0.0.5 on eth0 (the connection to Redis)``."""
        where = f"{self.address or '?'} on {self.iface}" if self.iface else f"{self.address or '?'}"
        return f"{where} ({self.source})"


def interface_address(name: str) -> str:
    """The (primary) IPv4 address of interface ``name``; "" when it has none or does not exist."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return ""
    return socket.inet_ntoa(raw[20:24])


def interface_of(address: str) -> str:
    """The interface whose (primary) IPv4 address is ``address``; "" when none is."""
    for _index, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return ""


def redis_local_address(client: redis.Redis) -> str:
    """The local IP address of ``client``'s TCP connection to Redis ("" for a unix socket or
    when it cannot be read). Takes a pooled connection (connecting it if needed, bounded by
    the client's connect timeout) and gives it back. Raises redis errors of the connect."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        sock = getattr(conn, "_sock", None)
        name = sock.getsockname() if sock is not None else None
    except OSError:
        name = None
    finally:
        pool.release(conn)
    return name[0] if isinstance(name, tuple) and name else ""


def choose_address(client: redis.Redis, iface: str | None = None,
                   host_address: Callable[[], str] | None = None) -> Advertised:
    """The address gloo should advertise, and why (see the module docstring for the order).
    ``iface`` (default: ``SHOAL_IFACE``) names the interface outright. RendezvousFailed, one
    line, when the named interface does not exist or has no IPv4 address. ``host_address``:
    what the host name resolves to (default: :func:`host_name_address`; a caller that asks
    often caches it - a resolver that times out must not slow every rendezvous)."""
    iface = iface or os.environ.get(IFACE_ENV) or ""
    if iface:
        address = interface_address(iface)
        if not address:
            known = ", ".join(n for _, n in socket.if_nameindex())
            raise InterfaceUnavailable(f"interface {iface!r} ({_OPTION}) has no IPv4 address on this host "
                                       f"(interfaces: {known}); name one the peers reach with {_OPTION}")
        return Advertised(address, iface, _OPTION)
    user = os.environ.get(GLOO_IFACE_ENV, "")
    if user:
        return Advertised(interface_address(user.split(",")[0]), user, GLOO_IFACE_ENV)
    try:
        local = redis_local_address(client)
    except redis.RedisError as exc:
        raise translate_error(exc, "finding the address to advertise", rendezvous=True) from exc
    if local and not local.startswith("127.") and local != "::1":
        found = interface_of(local)
        if found:
            return Advertised(local, found, "the connection to Redis")
    return Advertised((host_address or host_name_address)(), "", "the host name; Redis is reached over loopback"
                      if local.startswith("127.") else "the host name")


def host_name_address() -> str:
    """What the host name resolves to (what gloo advertises by default)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""


@contextlib.contextmanager
def _gloo_interface(advertised: Advertised) -> Iterator[None]:
    """``GLOO_SOCKET_IFNAME`` names ``advertised.iface`` while a gloo group is created (the
    user's own value, if any, is put back afterwards)."""
    if not advertised.iface or advertised.source == GLOO_IFACE_ENV:
        yield
        return
    before = os.environ.get(GLOO_IFACE_ENV)
    os.environ[GLOO_IFACE_ENV] = advertised.iface
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(GLOO_IFACE_ENV, None)
        else:
            os.environ[GLOO_IFACE_ENV] = before


_REMOTE = re.compile(r"remote=\[([^\]]+)\]:(\d+)")


def connect_failure(text: str, what: str, advertised: Advertised) -> str:
    """One line for a gloo group that could not connect: the peer address tried (when gloo
    names one), the address this worker advertised and why, and the option to change it."""
    remote = _REMOTE.search(text)
    cause = connect_cause(text)
    tried = f"could not connect to peer {remote.group(1)}:{remote.group(2)} ({cause})" if remote \
        else f"peers could not connect ({cause})"
    return f"{what}: {tried}; advertised {advertised.describe()}; set {_OPTION} to an interface the peers reach"


def translate_error(exc: BaseException, what: str, *, rendezvous: bool = False) -> WorkerError:
    """The shoal error for a torch.distributed / redis-py failure during ``what``.

    During a rendezvous (``rendezvous=True``): store timeouts become RendezvousTimeout, other
    failures RendezvousFailed. Otherwise every failure becomes CollectiveFailed. A WorkerError
    passes through unchanged. Callers ``raise translate_error(e, ...) from e``.
    """
    if isinstance(exc, WorkerError):
        return exc
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if isinstance(exc, redis.RedisError):
        msg = f"{what}: Redis failed: {first}"
        return RendezvousFailed(msg) if rendezvous else CollectiveFailed(msg)
    kind = formation_error(exc)
    if rendezvous:
        late = isinstance(exc, dist.DistStoreError) or timed_out(text)
        cls = RendezvousTimeout if late and not kind.configuration else RendezvousFailed
        return cls(f"{what}: {first}", formation_error=kind)
    return CollectiveFailed(f"{what}: {first}", formation_error=kind)


#: Seconds a wait on NCCL work sleeps between polls (an abort ends it at once).
NCCL_POLL_S = 0.0005
TEARDOWN_TIMEOUT = 10.0


class PendingReduce:
    """An all-reduce in flight, started by :meth:`Group.all_reduce_async`.

    :meth:`wait` waits like every wait of a group: it returns once the collective completed
    and raises CollectiveFailed when it failed, when the group is (or gets) aborted - at once,
    whatever the peers do - or past the collective timeout. A pending reduce that is given up
    without a successful wait must be handed to :meth:`Group.abandon`: its tensor may still be
    written by it, so the caller must not reuse that tensor."""

    __slots__ = ("work", "what", "group")

    def __init__(self, work: object, what: str, group: "Group") -> None:
        self.work = work
        self.what = what
        self.group = group

    def wait(self) -> None:
        self.group._wait(self.work, self.what)

    def completed(self) -> bool:
        """Whether the collective has ended (successfully or not: :meth:`wait` then returns
        at once, or raises). Never blocks."""
        return bool(self.work.is_completed())


class Group:
    """One process group and everything with its lifetime: the torch ``ProcessGroup`` object,
    its abort flag, the collective a thread waits on, its posted sends and abandoned work.

    Two kinds: the registered default group of a generation (:meth:`Rendezvous.join`; a
    data-parallel generation's group, or the shard group of an HSDP replica group), dropped
    with ``destroy_process_group``; and standalone gloo groups torch never registers
    (:meth:`Rendezvous.standalone`; an HSDP generation's cross-replica group), dropped by
    their owner. Every collective of this class is started on the torch object's own methods
    (:mod:`shoal.worker.torch_compat`) and waited for abortably (:meth:`request_abort`, from
    any thread, ends every wait at once); each raises only CollectiveFailed. Not thread-safe
    beyond that: one thread starts collectives (an autograd hook counts as that thread)."""

    def __init__(self, job_id: str, generation: int, rank: int, world_size: int, backend: str, device: torch.device,
                 store: object, timeout: float, torch_group: object, *, registered: bool, name: str = "",
                 teardowns: "Teardowns | None" = None) -> None:
        self.job_id = job_id
        self.generation = generation
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        #: where the callers' tensors live (the model's device)
        self.device = device
        self.store = store
        #: the collective timeout the group was made with (s)
        self.timeout = timeout
        self.torch_group = torch_group
        self.registered = registered
        #: where a group dropped in the background is freed (its rendezvous's)
        self.teardowns = teardowns
        #: for messages: ``generation 4`` or ``generation 4 cross-replica group of shard 1``
        self.name = name or f"generation {generation}"
        self._lock = threading.Lock()
        #: set once the group is aborted: its collectives fail at once
        self.abort_reason = ""
        #: the event the training thread waits on now
        self._waiting: threading.Event | None = None
        #: work objects of aborted or given-up collectives, still in flight
        self._abandoned: list[object] = []
        #: posted sends: (work, the tensor or its host copy, destination)
        self._pending_sends: list[tuple[object, torch.Tensor, int]] = []
        self.closed = False

    def __repr__(self) -> str:
        return f"Group({self.name}, rank {self.rank}/{self.world_size}, {self.backend})"

    # ---- aborting --------------------------------------------------------------------------------
    def request_abort(self, reason: str) -> bool:
        """(Any thread.) The collective in flight, if any, and every later one fail at once
        with CollectiveFailed naming ``reason``. True when aborted by this call."""
        with self._lock:
            if self.abort_reason or self.closed:
                return False
            self.abort_reason = reason
            waiting = self._waiting
        if waiting is not None:
            waiting.set()
        log.warning("aborting %s's collectives: %s", self.name, reason)
        return True

    def _require(self, what: str) -> None:
        if self.closed:
            raise CollectiveFailed(f"{what}: not in a process group")
        if self.abort_reason:
            raise CollectiveFailed(f"{what}: aborted ({self.abort_reason})", local=True)

    # ---- waiting --------------------------------------------------------------------------------
    def _wait(self, work: object, what: str, timeout: float | None = None) -> None:
        """Wait for ``work`` (a torch Work) until it completes, the group is aborted, or
        ``timeout`` s passed (then the group is aborted: its collectives are stuck). Raises
        CollectiveFailed for all but success. A work that completed wins over a late abort."""
        if timeout is None and self.backend == "nccl":
            timeout = self.timeout  # NCCL's own timeout does not end the wait: this does
        done = threading.Event()
        completed: list[BaseException | None] = []  # filled when the work ended (the event alone may be an abort)
        with self._lock:
            if self.abort_reason and not _ended(work):  # one that ended already wins here too
                self._abandoned.append(work)
                raise CollectiveFailed(f"{what}: aborted ({self.abort_reason})", local=True)
            self._waiting = done

        def on_done(_f: object) -> None:
            completed.append(None)
            done.set()

        threaded = False  # a thread waited for the work already (it may be waited for only once)
        try:
            if self._polled(work):
                finished = _poll(work, completed, done, timeout)
            else:
                try:
                    future = work.get_future()
                except RuntimeError:  # gloo's point-to-point work has no future: a thread waits for it
                    future = None
                if future is not None:
                    future.add_done_callback(on_done)
                else:
                    threaded = True
                    threading.Thread(target=_wait_in_thread, args=(work, completed, done), name="pg-wait",
                                     daemon=True).start()
                finished = done.wait(timeout)
        finally:
            with self._lock:
                self._waiting = None
        if not completed:
            if not finished:  # a peer that hangs: not this process's own doing
                self.request_abort(f"{what} took longer than {timeout:.0f} s")
            with self._lock:
                self._abandoned.append(work)
            raise CollectiveFailed(f"{what}: aborted ({self.abort_reason or 'no reason'})", local=finished)
        try:
            if completed[0] is not None:
                raise completed[0]
            if not threaded:
                work.wait()  # raises what the work failed with; NCCL: orders the current stream after it
        except Exception as exc:  # noqa: BLE001 - translated
            raise translate_error(exc, what) from exc

    def _polled(self, work: object) -> bool:
        """Whether ``work`` must be polled: NCCL marks its future complete when the collective
        is *enqueued* (CUDA-event semantics; ``wait()`` only orders the current stream after
        it), so waiting on the future would return at once and the host would then block,
        unabortably, in the next read of the result. Its ``is_completed()`` asks the GPU
        without blocking."""
        return self.backend == "nccl" and hasattr(work, "is_completed")

    # ---- collectives ------------------------------------------------------------------------------
    def serial_collectives(self) -> bool:
        """Whether a rank should keep at most one collective in flight: gloo groups of three or
        more ranks. A gloo collective in flight holds the group's connections open; a rank whose
        collective failed (a peer died) while another one was in flight would keep its sockets
        open after leaving the group, so a live peer blocked on it - in a collective that needs
        this rank's data - would wait for the collective timeout instead of failing at once, and
        two such ranks can wait for each other. That takes a third rank: in a gloo group of two
        the only peer of a rank whose collective failed is the one that broke it, so every
        collective in flight fails at once, and the buckets go as soon as they are ready (as
        DDP's do: 8 % more steps/s for the MLP of bench/real_models.py on 2 cores). NCCL runs
        collectives in stream order anyway, and a dead NCCL peer is handled by aborting the
        communicator: launching them all at once costs nothing."""
        return self.backend != "nccl" and self.world_size > 2

    def all_reduce_async(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                         what: str = "all_reduce") -> PendingReduce:
        """Start an in-place all_reduce of ``tensor`` and return at once (any thread may call
        it, e.g. an autograd hook). Every rank must start the same collectives in the same
        order: the backends match them by that order. ``tensor`` must not be touched until the
        returned reduce was waited for. CollectiveFailed when it cannot be started (the group
        is closed or aborted, the backend refuses)."""
        self._require(what)
        try:
            work = tc.allreduce(self.torch_group, tensor, op)
        except Exception as exc:  # noqa: BLE001 - translated
            raise translate_error(exc, what) from exc
        return PendingReduce(work, what, self)

    def claim(self, key: str, block: int, chunks: Sequence[int]) -> tuple[int, int] | None:
        """The next chunk of a step's work this rank takes (:meth:`RedisStore.claim
        <shoal.worker.store.RedisStore.claim>` in the group's store; :mod:`shoal.worker.steal`).
        CollectiveFailed when the group is aborted or the store cannot be reached."""
        what = "a claim of the step's next chunk"
        self._require(what)
        try:
            return self.store.claim(key, block, chunks)
        except Exception as exc:  # noqa: BLE001 - translated
            raise translate_error(exc, what) from exc

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   what: str = "all_reduce") -> None:
        """In-place all_reduce; CollectiveFailed on any failure. Reaps the posted sends."""
        self.wait_all([self.all_reduce_async(tensor, op, what)])

    def wait_all(self, pending: list[PendingReduce]) -> None:
        """Wait for each of ``pending`` in order; once all completed, reap the sends posted
        before them (:meth:`wait_sends`). On the first failure the ones not yet waited for are
        abandoned (:meth:`abandon`) and CollectiveFailed is raised."""
        for i, p in enumerate(pending):
            try:
                p.wait()
            except CollectiveFailed:
                self.abandon(pending[i + 1:])
                raise
        if self._pending_sends:
            self.wait_sends()

    def abandon(self, pending: list[PendingReduce]) -> None:
        """Give up ``pending`` reduces without waiting: their work is kept, like an aborted
        collective's, until the group is freed (their tensors must not be reused)."""
        with self._lock:
            self._abandoned.extend(p.work for p in pending)

    def all_gather(self, tensor: torch.Tensor, what: str = "all_gather") -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on every rank), in rank order;
        CollectiveFailed on any failure. Reaps the posted sends."""
        self._require(what)
        outputs = [torch.empty_like(tensor) for _ in range(self.world_size)]
        try:
            work = tc.allgather(self.torch_group, outputs, tensor)
        except Exception as exc:  # noqa: BLE001 - translated
            raise translate_error(exc, what) from exc
        self._wait(work, what)
        if self._pending_sends:
            self.wait_sends()
        return outputs

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """In-place broadcast from ``src``; CollectiveFailed on any failure."""
        what = f"broadcast from rank {src}"
        self._require(what)
        try:
            work = tc.broadcast(self.torch_group, tensor, src)
        except Exception as exc:  # noqa: BLE001 - translated
            raise translate_error(exc, what) from exc
        self._wait(work, what)

    def barrier(self) -> None:
        """Barrier over the group; CollectiveFailed on any failure."""
        self._require("barrier")
        try:
            work = tc.barrier(self.torch_group)
        except Exception as exc:  # noqa: BLE001 - translated
            raise translate_error(exc, "barrier") from exc
        self._wait(work, "barrier")

    # ---- point to point -------------------------------------------------------------------------
    def _through_host(self, tensor: torch.Tensor) -> bool:
        """Whether a point-to-point transfer of ``tensor`` must go through host memory: gloo's
        send and receive take host memory only (its collectives take CUDA tensors)."""
        return self.backend == "gloo" and tensor.device.type != "cpu"

    def isend(self, tensor: torch.Tensor, dst: int) -> None:
        """Post a point-to-point send of ``tensor`` to rank ``dst`` and return at once; gloo's
        I/O thread moves the bytes. ``tensor`` must not change until the send completed: the
        receiver must take the data before it joins any later collective, so the next
        successful :meth:`all_reduce` reaps (:meth:`wait_sends`) every send posted before it;
        closing the group drops sends still pending. CollectiveFailed on failure."""
        self._require("isend")
        wire = _host_copy(tensor) if _through_host(self, tensor) else tensor
        try:
            work = tc.send(self.torch_group, wire, dst)
        except Exception as exc:  # noqa: BLE001 - translated
            raise translate_error(exc, f"send to rank {dst}") from exc
        self._pending_sends.append((work, wire, dst))  # keeps a staged copy alive until the send completed

    def wait_sends(self) -> None:
        """Wait for every send posted with :meth:`isend`; CollectiveFailed when one failed."""
        while self._pending_sends:
            work, _tensor, dst = self._pending_sends[0]
            self._wait(work, f"send to rank {dst}")
            self._pending_sends.pop(0)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Point-to-point receive from rank ``src`` into ``tensor``; CollectiveFailed on failure."""
        self.recv_many([tensor], src)

    def recv_many(self, tensors: list[torch.Tensor], src: int, timeout: float | None = None) -> None:
        """Receive into each of ``tensors`` in order (the messages ``src`` sent, in order): all
        receives are posted first, so the data streams without a round trip per message.
        CollectiveFailed on failure, on an abort, or when all of it has not arrived within
        ``timeout`` s (then the group is aborted; each wait is also bounded by the group's
        timeout)."""
        self._require("recv")
        wires = [_host_copy(t, fill=False) if _through_host(self, t) else t for t in tensors]
        try:
            works = [tc.recv(self.torch_group, w, src) for w in wires]
        except Exception as exc:  # noqa: BLE001 - translated
            raise translate_error(exc, f"recv from rank {src}") from exc
        what = f"recv from rank {src}" if timeout is None else f"recv from rank {src} (bulk, bounded by {timeout:.0f} s)"
        self._wait(works[0] if len(works) == 1 else _AllOf(works), what, timeout)
        for tensor, wire in zip(tensors, wires):
            if wire is not tensor:  # staged through host memory (gloo): onto the tensor's device
                tensor.copy_(wire)

    # ---- timeouts and closing ----------------------------------------------------------------------
    def extend_timeout(self, seconds: float) -> None:
        """Make the collective timeout at least ``seconds`` (for the operations started from
        now on): a member receiving a state larger than its own - a joiner whose optimizer
        holds no state yet - learns the size only from the header. Never shortens it."""
        if self.closed or seconds <= self.timeout:
            return
        device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
        tc.set_timeout(self.torch_group, device, seconds)
        self.timeout = seconds

    def close(self, *, background: bool = False) -> None:
        """Drop the group. Never raises; idempotent. ``background``: an orderly switch (no
        collective in flight, every member leaves at the same step boundary): the backend's
        teardown (gloo joins its I/O threads, ~20-30 ms, GIL released) runs on a short-lived
        thread. An aborted group is always dropped that way (its stuck work ends whenever its
        peers go). Otherwise synchronously: closing the sockets now is what makes peers still
        inside a collective fail at once."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            aborted = bool(self.abort_reason)
        background = background or aborted
        keep: list = [self.torch_group] if background else []
        if self.registered:
            if aborted and self.backend == "nccl":
                try:
                    tc.abort_default_nccl()
                except Exception:  # noqa: BLE001 - best effort: the group is dropped next anyway
                    log.warning("aborting the NCCL group failed; continuing", exc_info=True)
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may complain while being torn down
                log.warning("destroy_process_group failed; continuing", exc_info=True)
        elif not background:
            keep = [self.torch_group]  # freed here, below, by dropping the last reference
        self.torch_group = None
        keep += [w for w, _t, _d in self._pending_sends] + [t for _w, t, _d in self._pending_sends]  # gloo holds weak refs
        keep += self._abandoned
        self._pending_sends, self._abandoned = [], []
        if background:
            (self.teardowns or Teardowns()).free_later(keep, wait=not aborted)
        else:
            keep.clear()


def _through_host(group: Group, tensor: torch.Tensor) -> bool:
    return group._through_host(tensor)


def _host_copy(tensor: torch.Tensor, *, fill: bool = True) -> torch.Tensor:
    """A host buffer shaped like ``tensor`` (pinned when it is on a GPU), holding its values
    (``fill``) or not yet (a receive's)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)
    return host.copy_(tensor) if fill else host


def _ended(work: object) -> bool:
    """Whether ``work`` ended already (succeeded or failed: waiting for it then returns at once
    or raises what it failed with). A collective whose data all arrived before a late abort
    was requested counts: a peer on the other side of it may have applied the step already,
    and dropping it here would make this side redo a step that side committed."""
    try:
        return bool(work.is_completed())
    except (AttributeError, RuntimeError):
        return False


def _poll(work: object, completed: list, done: threading.Event, timeout: float | None) -> bool:
    """Poll ``work.is_completed()`` until it is, ``done`` is set (an abort) or ``timeout`` s
    passed; True unless the timeout passed. Marks ``completed`` when the work ended."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if work.is_completed():  # also True when it failed: work.wait() then raises
            completed.append(None)
            return True
        if done.wait(NCCL_POLL_S):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


def _wait_in_thread(work: object, completed: list, done: threading.Event) -> None:
    """``work.wait()`` (a point-to-point work may be waited for only once); what it raised
    goes to ``completed``."""
    try:
        work.wait()
        completed.append(None)
    except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
        completed.append(exc)
    done.set()


class _AllOf:
    """Several point-to-point works waited for as one, in order (by one thread)."""

    def __init__(self, works: list) -> None:
        self.works = works

    def get_future(self) -> None:
        raise RuntimeError("point-to-point works have no future")

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class Teardowns:
    """Groups dropped in the background, freed by short-lived threads (one set per
    :class:`Rendezvous`): :meth:`wait` waits for them (a synchronous leave does, before the
    next group forms)."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def wait(self, timeout: float = TEARDOWN_TIMEOUT) -> bool:
        """Wait up to ``timeout`` s in total for groups dropped in the background to be freed;
        True when none is pending."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._threads:
                    return True
                t = self._threads[0]
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                return False
            with self._lock:
                if self._threads and self._threads[0] is t:
                    self._threads.pop(0)

    def free_later(self, box: list, *, wait: bool = True) -> None:
        """Drop the references in ``box`` (the caller keeps no other) from a thread
        (``wait=False``: :meth:`wait` does not wait for it - an aborted group's, which lasts
        until its stuck collective ends)."""

        def run() -> None:
            try:
                box.clear()  # the last reference: the C++ destructor runs in this thread
            except Exception:  # noqa: BLE001 - a broken group may complain while being torn down
                log.warning("freeing a process group failed; continuing", exc_info=True)

        t = threading.Thread(target=run, name="pg-teardown", daemon=True)
        with self._lock:
            self._threads[:] = [x for x in self._threads if x.is_alive()]
            if wait:
                self._threads.append(t)
        t.start()


# --- making groups: the rendezvous ----------------------------------------------------------------
#: How long a generation's group may take to connect once its members met at the barrier:
#: each store wait for a peer's address, and each of gloo's connect attempts (it makes up to
#: four, so a peer that cannot be reached - a wrong interface - ends the rendezvous in ~20 s).
#: A member slower than that to publish its address gets a new generation of the same members.
CONNECT_TIMEOUT_S = 5.0


class Rendezvous:
    """Makes this worker process's process groups for one job, and owns what making them
    needs: the generation being joined and its abort flag (under one lock), the last
    generation joined (a store prefix is never reused), the address gloo advertises, and the
    background teardowns. One per worker process; the groups it makes are objects
    (:class:`Group`) their owner - a training layout - holds, passes to whatever runs
    collectives on them (the step, the reducer, the state transfer) and closes.

    Two kinds of groups: :meth:`join` makes torch's registered default group (one at a time:
    a data-parallel generation's group, or an HSDP replica group's shard group), dropped with
    ``destroy_process_group``; :meth:`standalone` makes a gloo group torch never registers
    (an HSDP generation's cross-replica group), dropped by its owner.

    ``backend``/``iface``: the worker's placement and interface option (see
    :func:`choose_address`); ``client`` reaches the job's Redis (the stores)."""

    def __init__(self, client: redis.Redis, job_id: str, *, backend: str | None = None, iface: str | None = None):
        self.client = client
        self.job_id = job_id
        self.backend = backend or default_backend()
        self.iface = iface
        self.teardowns = Teardowns()
        self._lock = threading.Lock()
        #: (generation, abort reason) of the registered group being joined now (None: none)
        self._forming: list | None = None
        #: the registered group joined and not yet closed
        self._joined: Group | None = None
        self._last_generation = 0
        self._advertised: Advertised | None = None
        self._host: str | None = None

    def _host_address(self) -> str:
        """:func:`host_name_address`, looked up once."""
        if self._host is None:
            self._host = host_name_address()
        return self._host

    @property
    def joined(self) -> Group | None:
        """The registered group :meth:`join` made and nobody closed yet (None: none)."""
        group = self._joined
        return group if group is not None and not group.closed else None

    def join(self, generation: int, rank: int, world_size: int, timeout: float, *,
             collective_timeout: float | None = None, device: torch.device | None = None,
             prefix: str | None = None) -> Group:
        """Join generation ``generation`` as ``rank`` of ``world_size``: torch's registered
        default group, meeting under ``prefix`` (default: the generation's rendezvous keys).

        Blocks until every rank has connected, at most about ``timeout`` seconds (each wait
        on the store and each connect is capped at :data:`CONNECT_TIMEOUT_S` or ``timeout``,
        whichever is shorter; RendezvousTimeout otherwise: the caller reports it and waits
        for a newer generation - it must not retry the same one). ``collective_timeout``
        (default ``timeout``) bounds every later collective of the group. ``device``: where
        the caller's tensors live (default: :func:`device_for` the backend).

        Raises WorkerError when a registered group is still open (close it first) or
        ``generation`` is not greater than the last one joined; RendezvousFailed on Redis or
        backend errors, or when :meth:`request_abort` ended the rendezvous. On failure no
        registered group is left behind."""
        joined = self.joined
        if joined is not None or dist.is_initialized():
            raise WorkerError(f"join(generation={generation}): still in generation "
                              f"{joined.generation if joined else '?'}; close that group first")
        if not 0 <= rank < world_size:
            raise WorkerError(f"join: rank {rank} outside world of size {world_size}")
        if generation <= self._last_generation:
            raise WorkerError(f"join: generation {generation} not newer than {self._last_generation}, already "
                              "joined; a rendezvous prefix is never reused")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        backend = self.backend
        self._last_generation = generation
        what = f"rendezvous of generation {generation} (rank {rank}/{world_size})"
        advertised = self._advertise() if backend == "gloo" else None
        forming = [generation, ""]
        with self._lock:
            self._forming = forming
        # rank + world size: every rank reads gloo's full mesh of addresses in one table (O(1)
        # Redis commands per rank). NCCL reads one key (rank 0's unique id): O(W) already, and
        # key by key. The legacy switch (benches only) reads gloo's addresses key by key too.
        table = {} if legacy_rendezvous() or backend != "gloo" else {"rank": rank, "world_size": world_size}
        store = RedisStore(self.client, prefix or job_keys(self.job_id).rendezvous(generation), timeout=timeout,
                           max_wait=timeout, abort=lambda: forming[1], **table)
        if backend == "nccl":
            # NCCL's watchdog would tear the process down on a timeout: shoal aborts the
            # communicator itself (on an eviction, or past the collective timeout) and goes on
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        collective = collective_timeout or timeout
        try:
            with _gloo_interface(advertised) if advertised else contextlib.nullcontext():
                # connecting is bounded by the connect timeout (peers that reached the barrier
                # are alive: a connect that takes longer goes nowhere, e.g. a wrong interface);
                # the group's collectives then get the collective timeout
                dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                        timeout=timedelta(seconds=min(CONNECT_TIMEOUT_S, timeout)))
                tc.set_timeout(tc.default_group(), torch.device("cuda") if backend == "nccl" else torch.device("cpu"),
                               collective)
        except Exception as exc:  # noqa: BLE001 - translated
            destroy_default()
            with self._lock:
                self._forming, why = None, forming[1]
            err = translate_error(exc, what, rendezvous=True)
            if why:
                err = RendezvousFailed(f"{what}: aborted ({why})")
            if advertised is not None and _connect_failure(exc):
                err = type(err)(connect_failure(str(exc), what, advertised), formation_error=err.formation_error)
            raise err from exc
        group = Group(self.job_id, generation, rank, world_size, backend, device or device_for(backend), store,
                      collective, tc.default_group(), registered=True, teardowns=self.teardowns)
        with self._lock:  # an abort requested while forming holds for the group formed
            self._forming = None
            if forming[1]:
                group.abort_reason = forming[1]
            self._joined = group
        log.info("joined generation %d as rank %d/%d (%s, %s)", generation, rank, world_size, backend, group.device)
        return group

    def standalone(self, prefix: str, rank: int, world_size: int, timeout: float, *, generation: int,
                   device: torch.device, name: str, collective_timeout: float | None = None,
                   abort: Callable[[], str] | None = None) -> Group:
        """A gloo group of ``world_size`` ranks that torch does not register (for one
        generation of an HSDP job: a cross-replica group), meeting under the store prefix
        ``prefix``. Blocks like :meth:`join` (RendezvousFailed/RendezvousTimeout on failure);
        its owner closes it (:meth:`Group.close`). ``abort`` (any thread may make it return a
        reason) ends the rendezvous at once with RendezvousFailed, and an abort asked for
        while it was being formed holds for the group formed."""
        what = f"rendezvous of {name} (rank {rank}/{world_size})"
        advertised = self._advertise()
        store = RedisStore(self.client, prefix, timeout=timeout, max_wait=timeout, rank=rank, world_size=world_size,
                           abort=abort)
        try:
            torch_group = tc.new_gloo_group(store, rank, world_size, min(CONNECT_TIMEOUT_S, timeout),
                                            address=advertised.address if advertised.iface else "")
        except Exception as exc:  # noqa: BLE001 - translated
            why = abort() if abort is not None else ""
            err = RendezvousFailed(f"{what}: aborted ({why})") if why else translate_error(exc, what, rendezvous=True)
            if not why and _connect_failure(exc):
                err = type(err)(connect_failure(str(exc), what, advertised), formation_error=err.formation_error)
            raise err from exc
        group = Group(self.job_id, generation, rank, world_size, "gloo", device, store, collective_timeout or timeout,
                      torch_group, registered=False, name=name, teardowns=self.teardowns)
        tc.set_timeout(torch_group, torch.device("cpu"), group.timeout)
        why = abort() if abort is not None else ""
        if why:
            group.request_abort(why)
        return group

    def request_abort(self, generation: int, reason: str) -> bool:
        """(Any thread.) Abort the registered group of ``generation`` if it is being joined
        now (its rendezvous fails with RendezvousFailed) or was joined and is still open (its
        collective in flight, if any, and every later one fail at once with CollectiveFailed
        naming ``reason``). A group of another generation is never touched. True when it was
        aborted by this call."""
        with self._lock:
            forming = self._forming
            if forming is not None and forming[0] == generation:
                if forming[1]:
                    return False
                forming[1] = reason
                log.warning("aborting generation %d's rendezvous: %s", generation, reason)
                return True
            group = self._joined
        if group is None or group.closed or group.generation != generation:
            return False
        return group.request_abort(reason)

    def close_joined(self, *, background: bool = False) -> None:
        """Close the registered group :meth:`join` made (if still open) and leave no default
        group behind. Never raises; idempotent. A synchronous close first waits (bounded) for
        pending background teardowns."""
        group = self._joined
        if group is not None and not group.closed and not (background or group.abort_reason):
            self.teardowns.wait()
        if group is not None:
            group.close(background=background)
        destroy_default()
        with self._lock:
            self._joined = None

    def _advertise(self) -> Advertised:
        """:func:`choose_address`, logged when it changes."""
        chosen = choose_address(self.client, self.iface, self._host_address)
        if chosen != self._advertised:
            log.info("gloo advertises %s", chosen.describe())
            self._advertised = chosen
        return chosen


def _connect_failure(exc: BaseException) -> bool:
    """Whether a failed gloo group creation is gloo failing to connect to a peer (rather than
    Redis, the store or our own checks)."""
    if isinstance(exc, (WorkerError, redis.RedisError, dist.DistStoreError)):
        return False
    return peer_connect_failed(str(exc))


def destroy_default() -> None:
    """No default group left, and torch's group counter reset (see :func:`_reset_group_names`)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may complain while being torn down
            log.warning("destroy_process_group failed; continuing", exc_info=True)
    _reset_group_names()


def _reset_group_names() -> None:
    """Make the next group's name (and so its store keys, ``<name>//cpu//...``) the same on
    every member. torch names an unnamed default group by a per-process counter that it
    bumps before connecting and resets only in ``destroy_process_group`` of an initialised
    group: a member whose rendezvous failed would otherwise count one ahead of members that
    never tried that generation, and no later generation could form (they wait for each
    other's keys under different names)."""
    tc.reset_group_counter()
