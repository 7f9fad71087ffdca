"""Joining and leaving the torch.distributed process group of one generation.

A *generation* is one fixed membership of the job (world size, rank of each worker), chosen by
the coordinator. Every worker of generation ``g`` calls :func:`join_group` with the rank the
coordinator gave it; the call returns once all ``world_size`` ranks have connected (gloo/nccl
rendezvous through :class:`shoal.worker.store.RedisStore` under
``job_keys(job).rendezvous(g)``). When the generation ends - a peer died, a worker joins,
the coordinator publishes a new table - every member calls :func:`leave_group` and then
joins the next generation. Generations must strictly increase within a process: a prefix is
never reused (re-using one after ``destroy_process_group`` can hang).

Backend: nccl when CUDA is available (the worker is expected to see exactly one GPU, e.g.
through ``CUDA_VISIBLE_DEVICES``), gloo otherwise. Multi-host gloo may need
``GLOO_SOCKET_IFNAME`` to pick the right interface.

This module is the one place where torch.distributed and redis-py errors of the training side
are translated (:func:`translate_error`); the collective wrappers :func:`all_reduce`,
:func:`broadcast` and :func:`barrier`, and the point-to-point :func:`isend` (reaped by the next
:func:`all_reduce`), :func:`recv` and :func:`recv_many`, raise only
:class:`~worker.errors.CollectiveFailed`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import redis
import torch
import torch.distributed as dist

from shoal.events.keys import job_keys
from shoal.worker.errors import (
    CollectiveFailed,
    RendezvousFailed,
    RendezvousTimeout,
    WorkerError,
)
from shoal.worker.store import RedisStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Group:
    """The process group this process belongs to (one per generation)."""

    job_id: str
    generation: int
    rank: int
    world_size: int
    backend: str
    device: torch.device
    store: RedisStore


_current: Group | None = None
_last_generation: dict[str, int] = {}


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_for(backend: str) -> torch.device:
    """The device tensors must live on for ``backend`` (current CUDA device for nccl)."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def current_group() -> Group | None:
    """The group joined by :func:`join_group` and not yet left, or None."""
    return _current


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
    if rendezvous:
        timed_out = isinstance(exc, dist.DistStoreError) or "timed out" in text.lower() or "timeout" in text.lower()
        return (RendezvousTimeout if timed_out else RendezvousFailed)(f"{what}: {first}")
    return CollectiveFailed(f"{what}: {first}")


def join_group(
    client: redis.Redis,
    job_id: str,
    generation: int,
    rank: int,
    world_size: int,
    timeout: float,
    *,
    collective_timeout: float | None = None,
    backend: str | None = None,
) -> Group:
    """Join generation ``generation`` of ``job_id`` as ``rank`` of ``world_size``.

    Blocks until every rank of the generation has connected, at most about ``timeout`` seconds
    (each wait on the store is capped at ``timeout``; RendezvousTimeout otherwise; the caller then reports it and waits for a newer
    generation - it must not retry the same generation). ``collective_timeout`` (default
    ``timeout``) bounds every later collective of the group: a peer that hangs rather than
    dies is detected after it.

    Raises WorkerError when this process is still in a group (call :func:`leave_group` first)
    or ``generation`` is not greater than the last one joined for this job;
    RendezvousFailed on Redis or backend errors. On failure the process is left with no
    group, ready to join a later generation.
    """
    global _current
    if _current is not None or dist.is_initialized():
        raise WorkerError(
            f"join_group(generation={generation}): still in generation "
            f"{_current.generation if _current else '?'}; call leave_group() first"
        )
    if not 0 <= rank < world_size:
        raise WorkerError(f"join_group: rank {rank} outside world of size {world_size}")
    last = _last_generation.get(job_id)
    if last is not None and generation <= last:
        raise WorkerError(
            f"join_group: generation {generation} not newer than {last}, already joined; "
            "a rendezvous prefix is never reused"
        )
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    backend = backend or default_backend()
    _last_generation[job_id] = generation
    store = RedisStore(client, job_keys(job_id).rendezvous(generation), timeout=timeout, max_wait=timeout)
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout or timeout),
        )
    except Exception as exc:  # noqa: BLE001 - translated
        _destroy_quietly()
        raise translate_error(
            exc, f"rendezvous of generation {generation} (rank {rank}/{world_size})", rendezvous=True
        ) from exc
    _current = Group(job_id, generation, rank, world_size, backend, device_for(backend), store)
    log.info("joined generation %d as rank %d/%d (%s)", generation, rank, world_size, backend)
    return _current


def leave_group(*, background: bool = False) -> None:
    """Destroy the current process group, if any. Never raises; idempotent.

    Must be called by every member when its generation ends (also after a failed
    collective), before :func:`join_group` of the next one.

    ``background=True`` is for an orderly switch (no collective in flight, every member
    leaves at the same step boundary): torch forgets the group at once, so the next
    :func:`join_group` may follow immediately, and the backend itself - whose teardown
    (gloo joins its I/O threads, ~20-30 ms, GIL released) is the expensive part - is freed
    by a short-lived thread. After a failed collective leave synchronously (the default):
    closing the sockets now is what makes peers still inside the collective fail at once.
    A synchronous call first waits (bounded) for pending background teardowns.
    """
    global _current
    if background:
        _destroy_quietly(background=True)
    else:
        wait_teardown()
        _destroy_quietly()
    _current = None


_teardowns: list[threading.Thread] = []
TEARDOWN_TIMEOUT = 10.0


def wait_teardown(timeout: float = TEARDOWN_TIMEOUT) -> bool:
    """Wait up to ``timeout`` s in total for groups left with ``background=True`` to be
    freed; True when none is pending."""
    deadline = time.monotonic() + timeout
    while _teardowns:
        t = _teardowns[0]
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            return False
        _teardowns.pop(0)
    return True


def _free_later(box: list) -> None:
    """Drop the references in ``box`` (the caller keeps no other) from a thread."""

    def run() -> None:
        try:
            box.clear()  # the last reference: the C++ destructor runs in this thread
        except Exception:  # noqa: BLE001 - a broken group may complain while being torn down
            log.warning("freeing a process group failed; continuing", exc_info=True)

    t = threading.Thread(target=run, name="pg-teardown", daemon=True)
    _teardowns[:] = [x for x in _teardowns if x.is_alive()]
    _teardowns.append(t)
    t.start()


def _destroy_quietly(*, background: bool = False) -> None:
    if not dist.is_initialized():
        return
    box = [dist.group.WORLD] if background else []
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group may complain while being torn down
        log.warning("destroy_process_group failed; continuing", exc_info=True)
    if box:
        box.extend(_pending_sends)  # dropped after the backend (gloo holds weak references)
        _pending_sends.clear()
        _free_later(box)
    else:
        _pending_sends.clear()


# --- collectives with translated errors ------------------------------------------------------
def _require_group(what: str) -> None:
    if not dist.is_initialized():
        raise CollectiveFailed(f"{what}: not in a process group")


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """In-place all_reduce over the current group; CollectiveFailed on any failure."""
    _require_group("all_reduce")
    try:
        dist.all_reduce(tensor, op=op)
    except Exception as exc:  # noqa: BLE001 - translated
        raise translate_error(exc, "all_reduce") from exc
    if _pending_sends:
        wait_sends()


def broadcast(tensor: torch.Tensor, src: int) -> None:
    """In-place broadcast from ``src``; CollectiveFailed on any failure."""
    _require_group("broadcast")
    try:
        dist.broadcast(tensor, src=src)
    except Exception as exc:  # noqa: BLE001 - translated
        raise translate_error(exc, f"broadcast from rank {src}") from exc


def isend(tensor: torch.Tensor, dst: int) -> None:
    """Post a point-to-point send of ``tensor`` to rank ``dst`` and return at once; gloo's I/O
    thread moves the bytes. ``tensor`` must not change until the send completed: the receiver
    must take the data before it joins any later collective, so the next successful
    :func:`all_reduce` reaps (:func:`wait_sends`) every send posted before it;
    :func:`leave_group` drops sends still pending. CollectiveFailed on failure."""
    _require_group("isend")
    try:
        work = dist.isend(tensor, dst)
    except Exception as exc:  # noqa: BLE001 - translated
        raise translate_error(exc, f"send to rank {dst}") from exc
    _pending_sends.append((work, tensor, dst))


_pending_sends: list[tuple[object, torch.Tensor, int]] = []


def wait_sends() -> None:
    """Wait for every send posted with :func:`isend`; CollectiveFailed when one failed."""
    while _pending_sends:
        work, _tensor, dst = _pending_sends.pop(0)
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - translated
            raise translate_error(exc, f"send to rank {dst}") from exc


def recv(tensor: torch.Tensor, src: int) -> None:
    """Point-to-point receive from rank ``src`` into ``tensor``; CollectiveFailed on failure."""
    _require_group("recv")
    try:
        dist.recv(tensor, src)
    except Exception as exc:  # noqa: BLE001 - translated
        raise translate_error(exc, f"recv from rank {src}") from exc


def recv_many(tensors: list[torch.Tensor], src: int) -> None:
    """Receive into each of ``tensors`` in order (the messages ``src`` sent, in order): all
    receives are posted first, so the data streams without a round trip per message.
    CollectiveFailed on failure (each wait bounded by the collective timeout)."""
    _require_group("recv")
    try:
        works = [dist.irecv(t, src) for t in tensors]
        for w in works:
            w.wait()
    except Exception as exc:  # noqa: BLE001 - translated
        raise translate_error(exc, f"recv from rank {src}") from exc


def barrier() -> None:
    """Barrier over the current group; CollectiveFailed on any failure."""
    _require_group("barrier")
    try:
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - translated
        raise translate_error(exc, "barrier") from exc


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the current group, ``(0, 1)`` outside any group (local runs)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
