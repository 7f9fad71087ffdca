"""The input pipeline: batches of the next steps fetched and collated ahead, exactly.

shoal knows the future sample order: given the committed cursor, this rank's shard-table
ranges and the global batch size, the next steps' local indices are determined (as long as
the generation keeps its ranges and the steps commit). :class:`Prefetcher` works like
``DataLoader(num_workers, prefetch_factor)`` without guessing: background loaders fetch and
collate the micro-batches of the next ``prefetch_steps`` steps, and the engine takes them
through its one seam, ``StepEngine.fetch_batch`` (``engine.fetcher = prefetcher.fetch``).

Keys: never a wrong or stale batch
    Every planned item is keyed by :class:`ItemKey` - the step's cursor, this rank's ranges
    (its slice of that step's global batch) and the micro-batch index - and holds the exact
    dataset indices it collates. :meth:`Prefetcher.fetch` serves a request only from an item
    whose indices are *exactly* the requested ones; anything else is a **miss**, fetched inline
    in the training thread (correct, just not prefetched). A batch's content is a pure function
    of its indices (dataset and collate function are the job's, identical everywhere), so a
    generation change, a new shard table or a step redone with other ranges can only cause
    misses, never a wrong batch; the generation number itself is not part of the key because a
    new generation that keeps this rank's ranges rightly reuses what was prefetched. The
    cursor still moves only on commit (the training worker's business): exactly-once is
    unchanged.

Aiming
    The training worker calls :meth:`Prefetcher.start_step` before each step (the step's
    cursor and exact ranges, plus the ranges of the steps after it) and :meth:`Prefetcher.aim`
    after each commit and when a generation starts. Each call recomputes the plan (:func:`plan`):
    items whose key is still planned are kept (also while a loader works on them), the others
    are dropped (a result for a dropped item is discarded when it arrives), new ones are queued
    in step order. At most ``2 x loaders`` items are in flight, so after a re-aim at most that
    much stale work delays the new plan, and at most ``prefetch_steps`` steps of batches are
    held in memory.

Loaders (``loader_workers``)
    * ``>= 1``: that many **processes**. On Linux they are forked (as ``DataLoader`` does):
      the dataset and collate function are inherited, need not be picklable, and are not
      re-imported. A forked loader first frees what it inherited but never reads - the
      model's parameters, buffers and gradients, the optimizer's state, the gradient buckets
      (``release``, :func:`release_storages`) - and returns those pages to the kernel: the
      worker then writes its parameters every step, and a loader that kept the pages held a
      copy of the whole model (measured: 2.9 GB per loader for the 340 M LM example, enough
      for the kernel's OOM killer on 24 GiB). The training worker starts them in ``prepare()``, before its heartbeat,
      watcher and process-group threads and sockets exist, so a child holds no copy of a gloo
      socket (which would keep a dead worker's connections open) and no lock of those threads.
      Where fork is not available they are spawned, which needs a picklable dataset and
      collate function; when that fails, one thread is used instead (logged). Children never
      touch CUDA: they return CPU tensors, small ones (up to :data:`INLINE_TENSOR_BYTES`)
      copied through the pipe, larger ones moved through shared memory
      (``torch.multiprocessing``'s reductions); pinning happens in the training process.
      Each child dies with its worker - ``PR_SET_PDEATHSIG`` (SIGKILL; Linux) plus a check of
      its parent's pid every poll - also when the worker is SIGKILLed; it ignores SIGINT and
      SIGTERM (a drain signal to the whole process group must not take the loaders away while
      the worker finishes its steps: the worker closes them), runs with one torch thread, its
      own RNG seeds (job seed, loader index) and its log records on stderr (never through an
      inherited Redis connection).
    * ``0``: one background **thread** in the worker process (a dataset that cannot be forked
      or pickled: an open connection, a CUDA tensor). The dataset is then never read by two
      threads at once: the thread and inline misses share a lock.
    * ``prefetch_steps: 0``: no background loading at all: every batch inline in the training
      thread, as before this module (the input wait is still measured).

Errors
    A dataset or collate function that raises in a loader fails the step that consumes the
    item, in the training thread, exactly as inline: the engine's ``UserCodeError``
    (``training step raised ValueError: ... (at file.py:42 in __getitem__)``). An error of an
    item that is never consumed (its step was re-planned away) is never raised. A loader
    process that dies (killed, out of memory) makes the pipeline fall back to inline fetching
    for the rest of the process, with a warning; so does a batch that cannot be sent between
    processes (not picklable) for that item.

Input wait
    :attr:`Prefetcher.step_wait` is how long the training thread waited for its batches in the
    current step (for an item in flight, or fetching inline): the heartbeat's
    ``input_wait_time``. ``0`` means the loaders kept ahead of the training.

Pinned memory
    With a CUDA device (and ``torch.cuda.is_available()``) the prefetched batches are pinned
    in the training process (the loaders' result thread, on that device), so the engine's
    ``non_blocking`` copies to the device are asynchronous.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import pickle
import queue
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as torch_mp

from shoal.worker.data import DataOrder, NormalRanges, StepBatch, micro_batches
from shoal.worker.errors import raised_at

log = logging.getLogger("shoal.worker.prefetch")

Ranges = tuple[tuple[int, int, int], ...]
RangesLike = Sequence[Sequence[int]]
#: A rank's ranges as a function of a step's global batch (streaming datasets)
RangesOf = Callable[[StepBatch], RangesLike]


def read_samples(dataset: Any, indices: Sequence[int], owned: frozenset[int] | None) -> list[Any]:
    """The samples of ``indices``: ``dataset[i]`` each, or, for a streaming dataset with this
    rank's ``owned`` shards, ``dataset.read(indices, owned)`` (samples of shards it does not
    own by ranged reads, the others from its cache)."""
    if owned is None:
        return [dataset[i] for i in indices]
    return list(dataset.read(list(indices), owned))

#: How often a blocked loader, result thread or waiting fetch looks up (a closed pipeline, a
#: dead parent or child): the longest any of them sleeps without checking.
POLL_S = 0.2
#: How long :meth:`Prefetcher.close` waits for a loader to exit on its own before killing it.
CLOSE_WAIT_S = 2.0
#: Items in flight per loader (``DataLoader``'s default ``prefetch_factor``).
IN_FLIGHT_PER_LOADER = 2
#: A CPU tensor of at most this many bytes travels from a loader process inside the pickled
#: batch (copied through the pipe); a larger one through shared memory, as ``DataLoader``'s
#: do. Shared memory moves one file descriptor per storage, and the receiver opens a new
#: authenticated connection to the loader for each: for batches of a few hundred KB that
#: costs more than the copy, and it runs in the worker's result thread, which holds the GIL
#: the training thread needs between its operators (on 2 cores, 2 workers: the MLP of
#: bench/real_models.py went from 0.88x to 0.96x DDP's steps/s, median of 4 pairs each).
INLINE_TENSOR_BYTES = 1 << 20
#: Steps whose planned items a :class:`Prefetcher` keeps (:func:`plan`'s ``memo``).
PLAN_MEMO_STEPS = 16


def normalize_ranges(ranges: RangesLike) -> Ranges:
    """Shard-table ranges as a hashable tuple of ``(start, stop, step)`` int triples."""
    if type(ranges) is NormalRanges:
        return ranges
    return tuple((int(r[0]), int(r[1]), int(r[2])) for r in ranges)


@dataclass(frozen=True)
class ItemKey:
    """One prefetched micro-batch: the step's global ``cursor``, this rank's ``ranges`` of
    that step's global batch (its slice) and the micro-batch index within the slice."""

    cursor: int
    ranges: Ranges
    micro: int


def plan(order: DataOrder, cursor: int, ranges: RangesLike | RangesOf, steps: int, micro_batch: int | None, *,
         first_ranges: RangesLike | None = None, end: int | None = None,
         memo: dict[tuple[int, Ranges], list[tuple[ItemKey, tuple[int, ...]]]] | None = None
         ) -> list[tuple[ItemKey, tuple[int, ...]]]:
    """The items of ``steps`` steps from ``cursor`` on, in the order the training consumes
    them, each with its dataset indices: the step at ``cursor`` takes ``first_ranges`` (when
    given) and every later one ``ranges``; each slice is split as the engine splits it
    (:func:`shoal.worker.data.micro_batches`). A cursor advances by its batch's actual size
    (an epoch's short last batch included); nothing at or past ``end`` (the cursor at which
    training ends) is planned. ``ranges`` may be a function of the step's
    :class:`~shoal.worker.data.StepBatch` (a streaming dataset's per-step assignment, which
    depends on the batch's shards). A pure function (when ``ranges`` is one); ``memo`` keeps
    each step's items by (cursor, ranges) across calls (a step is planned again every step
    until it trains: its slice is cut once)."""
    items: list[tuple[ItemKey, tuple[int, ...]]] = []
    c = cursor
    for s in range(steps):
        if end is not None and c >= end:
            break
        batch = order.batch(c)
        if s == 0 and first_ranges is not None:
            rr = normalize_ranges(first_ranges)
        else:
            rr = normalize_ranges(ranges(batch) if callable(ranges) else ranges)
        got = memo.get((c, rr)) if memo is not None else None
        if got is None:
            got = [(ItemKey(c, rr, k), tuple(chunk.tolist()))
                   for k, chunk in enumerate(micro_batches(batch.for_rank(rr), micro_batch))]
            if memo is not None:
                while len(memo) >= PLAN_MEMO_STEPS:
                    del memo[next(iter(memo))]
                memo[(c, rr)] = got
        items += got
        c = batch.next_cursor
    return items


class _State(Enum):
    PLANNED = "planned"  # not given to a loader yet
    RUNNING = "running"  # a loader works on it
    READY = "ready"  # value: the collated batch
    FAILED = "failed"  # value: the exception the dataset or collate function raised
    LOST = "lost"  # its loader died or the batch could not be sent: fetch it inline


@dataclass(eq=False)
class _Item:
    key: ItemKey
    indices: tuple[int, ...]
    state: _State = _State.PLANNED
    value: Any = None


class LoaderTraceback(Exception):
    """The traceback, as text, of an exception raised in a loader process: the ``__cause__``
    of that exception when the training thread raises it again."""

    def __str__(self) -> str:
        return "raised in a loader process:\n" + str(self.args[0] if self.args else "")


@dataclass(frozen=True)
class _Failure:
    """A user exception raised in a loader process, in a form that crosses processes: the
    exception itself when it pickles, else its type name and message; where the user's code
    raised it (:func:`~shoal.worker.errors.raised_at` in the loader) and the traceback text."""

    type_name: str
    message: str
    where: str
    text: str
    blob: bytes | None

    @classmethod
    def capture(cls, exc: BaseException) -> "_Failure":
        try:
            blob: bytes | None = pickle.dumps(exc)
            pickle.loads(blob)  # a custom __init__ may pickle fine and fail to unpickle
        except Exception:  # noqa: BLE001 - then rebuilt from name and message
            blob = None
        return cls(type(exc).__name__, str(exc), raised_at(exc), "".join(traceback.format_exception(exc)), blob)

    def rebuild(self) -> BaseException:
        """The exception to raise in the training thread: the same type and message (so the
        engine's one-line UserCodeError reads as inline), ``shoal_raised_at`` naming the
        user's line in the loader, the loader's traceback as its cause."""
        exc: BaseException | None = None
        if self.blob is not None:
            try:
                exc = pickle.loads(self.blob)
            except Exception:  # noqa: BLE001
                exc = None
        try:
            if not isinstance(exc, BaseException):
                raise TypeError
            exc.shoal_raised_at = self.where  # type: ignore[attr-defined]
        except (TypeError, AttributeError):  # not an exception, or one without __dict__
            exc = type(self.type_name, (Exception,), {"__module__": __name__})(self.message)
            exc.shoal_raised_at = self.where  # type: ignore[attr-defined]
        exc.__cause__ = LoaderTraceback(self.text)
        return exc


def _pin(obj: Any) -> Any:
    """``obj`` with every tensor in page-locked memory (nested tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory()
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_pin(o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pin(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _pin(v) for k, v in obj.items()}
    return obj


def _tensor_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Rebuild a tensor :class:`_BatchPickler` sent by value (a fresh, writable copy)."""
    kind = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).reshape(shape)


class _BatchPickler(ForkingPickler):
    """``ForkingPickler`` (tensors through shared memory) except that plain CPU tensors of at
    most :data:`INLINE_TENSOR_BYTES` are pickled by value (any tensor whose bytes cannot be
    read that way - quantized - goes through shared memory as before)."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided \
                and not obj.is_quantized and not obj.requires_grad and obj.numel() * obj.element_size() <= INLINE_TENSOR_BYTES:
            try:
                flat = obj.resolve_conj().resolve_neg().contiguous().reshape(-1)
                data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            except (RuntimeError, TypeError, ValueError):
                return NotImplemented
            return _tensor_from_bytes, (data, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        return NotImplemented


def _loader_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7919 + 0x5EED) % 2**63


# ---- the loader processes ------------------------------------------------------------------

def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), then make sure
    the parent has not died already."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass  # the pid check of every poll still ends it
    if os.getppid() != parent_pid:
        os._exit(0)


def _own_logging() -> None:
    """Log records of the user's dataset go to stderr (the worker's log), never through a
    handler inherited from the worker (its Redis handler's connection is the worker's)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s loader %(process)d %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)


def release_storages(tensors: Any) -> int:
    """(In a forked loader.) Free the memory of every tensor of ``tensors`` (an iterable; its
    storage, so every view of it too) and hand the freed pages back to the kernel
    (``malloc_trim``); the bytes freed. What the parent process holds is not touched: after
    a fork these pages are the child's own mapping of the parent's memory."""
    freed = 0
    seen: set[int] = set()
    with torch.no_grad():
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
                continue
            if storage.data_ptr() in seen or storage.is_shared():
                continue
            seen.add(storage.data_ptr())
            freed += storage.nbytes()
            storage.resize_(0)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):
            pass
    return freed


def _loader_main(dataset: Any, collate_fn: Callable[[list[Any]], Any], tasks: Any, results: Any,
                 parent_pid: int, index: int, seed: int, release: Callable[[], Any] | None = None) -> None:
    """A loader process: ``(task id, indices)`` from ``tasks`` -> ``(task id, ok, payload)``
    on ``results``. ``ok`` True: the batch, pickled for shared memory; False: a
    :class:`_Failure`, pickled; None: the batch could not be pickled (fetch it inline).
    ``release`` (forked loaders): the tensors to free first (:func:`release_storages`).
    Ends on ``None`` or when its parent is gone."""
    _die_with_parent(parent_pid)
    # what the fork inherited (the interpreter's modules, torch's, the model: ~300,000 objects)
    # is never garbage here: frozen, a full collection walks only the loader's own objects
    # (0.14 s a collection less, every few batches, taken from its worker's CPU) and leaves
    # the inherited pages shared instead of writing to every object's header (Instagram's
    # gc.freeze-before-fork). Collected automatically: a loader has no training steps
    # (:mod:`shoal.worker.collector`).
    gc.freeze()
    gc.enable()
    if release is not None:
        release_storages(release())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _own_logging()
    torch.set_num_threads(1)
    s = _loader_seed(seed, index)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    try:
        while True:
            try:
                task = tasks.get(timeout=POLL_S)
            except queue.Empty:
                if os.getppid() != parent_pid:
                    return
                continue
            if task is None:
                return
            task_id, indices, owned = task
            try:
                batch = collate_fn(read_samples(dataset, indices, owned))
            except BaseException as exc:  # noqa: BLE001 - the user's code: raised in the training thread
                try:
                    failure = _Failure.capture(exc)
                except Exception:  # noqa: BLE001 - an exception whose str() raises
                    failure = _Failure(type(exc).__name__, "(its message could not be read)", "", "", None)
                results.put((task_id, False, pickle.dumps(failure)))
                continue
            try:
                payload: bytes | None = bytes(_BatchPickler.dumps(batch))
            except Exception as exc:  # noqa: BLE001 - not picklable: the training thread fetches it
                print(f"loader {index}: a batch cannot be sent to the worker ({type(exc).__name__}: {exc}); "
                      "it is fetched in the training thread", file=sys.stderr)
                payload = None
            results.put((task_id, True if payload is not None else None, payload))
    finally:
        results.cancel_join_thread()  # never hang at exit on a parent that stopped reading


class _Pool:
    """What both kinds of loader share: handing a batch over (pinned first for CUDA)."""

    def __init__(self, deliver: Callable[[int, _State, Any], None], pin_device: torch.device | None) -> None:
        self._deliver = deliver
        self._pin_device = pin_device

    def _ready(self, task_id: int, batch: Any) -> None:
        """Deliver a fetched batch, in page-locked memory when the device is CUDA (given up
        for the rest of the run if pinning fails: it is an optimisation only)."""
        if self._pin_device is not None:
            try:
                batch = _pin(batch)
            except Exception as exc:  # noqa: BLE001 - pinning is an optimisation only
                log.warning("pinning a prefetched batch failed (%s): copies will be synchronous", exc)
                self._pin_device = None
        self._deliver(task_id, _State.READY, batch)


class _Processes(_Pool):
    """``workers`` loader processes and the result thread that hands their batches over."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any], workers: int, method: str, seed: int,
                 deliver: Callable[[int, _State, Any], None], broken: Callable[[str], None],
                 pin_device: torch.device | None, release: Callable[[], Any] | None = None) -> None:
        super().__init__(deliver, pin_device)
        ctx = torch_mp.get_context(method)
        self._thread: threading.Thread | None = None
        self.method = method
        self._broken = broken
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        self._stopping = threading.Event()
        self.procs = []
        parent = os.getpid()
        try:
            for i in range(workers):
                # only a forked child inherits ``release`` (a closure over the model) for free
                p = ctx.Process(target=_loader_main, name=f"shoal-loader-{i}", daemon=True,
                                args=(dataset, collate_fn, self._tasks, self._results, parent, i, seed,
                                      release if method == "fork" else None))
                p.start()
                self.procs.append(p)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._receive, name="loader-results", daemon=True)
        self._thread.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def submit(self, task_id: int, indices: tuple[int, ...], owned: frozenset[int] | None = None) -> None:
        self._tasks.put((task_id, indices, owned))

    def _receive(self) -> None:
        if self._pin_device is not None and self._pin_device.index is not None:
            torch.cuda.set_device(self._pin_device)
        while not self._stopping.is_set():
            try:
                task_id, ok, payload = self._results.get(timeout=POLL_S)
            except queue.Empty:
                dead = [p for p in self.procs if not p.is_alive()]
                if dead and not self._stopping.is_set():
                    self._broken(", ".join(f"loader process {p.pid} ended (exit code {p.exitcode})" for p in dead))
                    return
                continue
            except (EOFError, OSError, ValueError) as exc:  # the queue was closed under us
                if not self._stopping.is_set():
                    self._broken(f"the loaders' result queue failed: {exc}")
                return
            if ok is None:
                self._deliver(task_id, _State.LOST, None)
                continue
            try:
                value = pickle.loads(payload)
            except Exception as exc:  # noqa: BLE001 - e.g. its loader died before handing over its memory
                log.warning("a prefetched batch could not be received (%s): fetching it inline", exc)
                self._deliver(task_id, _State.LOST, None)
                continue
            if not ok:
                self._deliver(task_id, _State.FAILED, value.rebuild())
                continue
            self._ready(task_id, value)

    def close(self) -> None:
        """Stop the loaders (sentinels, then SIGKILL after :data:`CLOSE_WAIT_S`) and the
        result thread; idempotent."""
        self._stopping.set()
        for _ in self.procs:
            try:
                self._tasks.put(None)
            except (OSError, ValueError):
                break
        deadline = time.monotonic() + CLOSE_WAIT_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(CLOSE_WAIT_S)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(CLOSE_WAIT_S)
        for q in (self._tasks, self._results):
            q.cancel_join_thread()
            q.close()


class _Thread(_Pool):
    """One loader thread in the worker process (``loader_workers: 0``, or when processes
    cannot be used); it reads the dataset under ``lock``, as inline misses do."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any], lock: threading.Lock,
                 deliver: Callable[[int, _State, Any], None], pin_device: torch.device | None) -> None:
        super().__init__(deliver, pin_device)
        self.method = "thread"
        self.procs: list = []
        self._dataset = dataset
        self._collate = collate_fn
        self._lock = lock
        self._tasks: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loader", daemon=True)
        self._thread.start()

    @property
    def pids(self) -> list[int]:
        return []

    def submit(self, task_id: int, indices: tuple[int, ...], owned: frozenset[int] | None = None) -> None:
        self._tasks.put((task_id, indices, owned))

    def _run(self) -> None:
        if self._pin_device is not None and self._pin_device.index is not None:
            torch.cuda.set_device(self._pin_device)
        while not self._stopping.is_set():
            try:
                task = self._tasks.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if task is None:
                return
            task_id, indices, owned = task
            try:
                with self._lock:
                    batch = self._collate(read_samples(self._dataset, indices, owned))
            except BaseException as exc:  # noqa: BLE001 - the user's code: raised in the training thread
                try:
                    exc.shoal_raised_at = raised_at(exc)  # type: ignore[attr-defined]
                except AttributeError:  # an exception without __dict__: named where the thread re-raises it
                    pass
                self._deliver(task_id, _State.FAILED, exc)
                continue
            self._ready(task_id, batch)

    def close(self) -> None:
        self._stopping.set()
        self._tasks.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(CLOSE_WAIT_S)


def _start_method(requested: str | None, dataset: Any, collate_fn: Any) -> str:
    """``requested``, else ``fork`` on Linux (as DataLoader), else ``spawn`` when dataset and
    collate function pickle, else ``thread``."""
    if requested:
        return requested
    if sys.platform.startswith("linux") and "fork" in torch_mp.get_all_start_methods():
        return "fork"
    try:
        pickle.dumps((dataset, collate_fn))
    except Exception:  # noqa: BLE001
        return "thread"
    return "spawn"


class Prefetcher:
    """Fetches and collates the micro-batches of the next ``steps`` steps of this rank with
    ``workers`` loaders (see the module docstring for the loaders, the keys and the errors).

    The training thread (one thread) calls :meth:`start_step`, :meth:`aim`, :meth:`fetch`
    and :meth:`close`; nothing else of it is thread-safe. ``num_samples``, ``seed`` and
    ``global_batch`` give the data order (:class:`~shoal.worker.data.DataOrder`),
    ``micro_batch`` the engine's split, ``end`` the cursor at which training ends (nothing
    past it is prefetched). ``device``: the engine's; a CUDA one pins the batches.
    ``start_method``: ``fork``/``spawn``/``forkserver``/``thread`` instead of the automatic
    choice. ``release``: what a forked loader frees first (see the module docstring: the
    tensors of the model and the optimizer). Loaders start here; :meth:`close` (also at
    interpreter exit) stops them."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any], *, num_samples: int, seed: int,
                 global_batch: int, micro_batch: int | None = None, workers: int = 1, steps: int = 2,
                 device: torch.device | str | None = None, end: int | None = None,
                 start_method: str | None = None, order: DataOrder | None = None,
                 release: Callable[[], Any] | None = None) -> None:
        if workers < 0 or steps < 0:
            raise ValueError(f"need workers >= 0 and steps >= 0, got {workers}, {steps}")
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.micro_batch = micro_batch
        self.steps = steps
        self.end = end
        # its own: the training thread's caches one epoch (``order``: a template, e.g. a
        # streaming dataset's shard-aware order)
        if order is not None:
            self._order = DataOrder(order.num_samples, order.seed, order.global_batch,
                                    shard_samples=order.shard_samples, window=order.window)
        else:
            self._order = DataOrder(num_samples, seed, global_batch)
        #: a streaming dataset's shards this rank owns (None: a map-style dataset): samples of
        #: other shards are read remotely (:func:`read_samples`)
        self.owned: frozenset[int] | None = None
        #: the same for the step at a cursor (the planned items: a step of the next epoch
        #: reads that epoch's shards); None: :attr:`owned` for every item
        self.owned_at: Callable[[int], frozenset[int]] | None = None
        self._cond = threading.Condition()
        self._dataset_lock = threading.Lock()
        self._items: dict[ItemKey, _Item] = {}  # the plan, in consumption order
        self._plan_memo: dict[tuple[int, Ranges], list[tuple[ItemKey, tuple[int, ...]]]] = {}  # see plan()
        self._by_indices: dict[tuple[int, ...], list[_Item]] = {}
        self._tasks: dict[int, _Item] = {}  # in flight: task id -> item (dropped or not)
        self._next_task = 0
        self._limit = IN_FLIGHT_PER_LOADER * max(1, workers)
        self._broken: str | None = None
        self._closed = False
        #: seconds the training thread waited for batches in the current step / in all
        self.step_wait = 0.0
        self.total_wait = 0.0
        #: batches served by the loaders / fetched inline (misses) / planned, then dropped
        self.hits = 0
        self.misses = 0
        self.dropped = 0
        dev = torch.device(device) if device is not None else None
        pin = dev if dev is not None and dev.type == "cuda" and torch.cuda.is_available() else None
        self._pool: _Processes | _Thread | None = None
        if steps == 0:
            self.mode = "inline"
        else:
            method = "thread" if workers == 0 else _start_method(start_method, dataset, collate_fn)
            if method != "thread":
                try:
                    self._pool = _Processes(dataset, collate_fn, workers, method, seed, self._deliver, self._on_broken,
                                            pin, release)
                except Exception as exc:  # noqa: BLE001 - e.g. a dataset spawn cannot pickle
                    log.warning("loader processes (%s) could not start (%s: %s): one loader thread instead",
                                method, type(exc).__name__, exc)
                    method = "thread"
            if self._pool is None:
                self._pool = _Thread(dataset, collate_fn, self._dataset_lock, self._deliver, pin)
            self.mode = method
            atexit.register(self.close)
        log.info("input pipeline: %s", self.describe())

    def describe(self) -> str:
        if self.mode == "inline":
            return "batches fetched inline (prefetch_steps 0)"
        loaders = f"{len(self._pool.procs)} loader processes ({self.mode})" if self._pool.procs else "1 loader thread"
        return f"{loaders}, {self.steps} steps ahead"

    @property
    def pids(self) -> list[int]:
        """Process ids of the loader processes (none for a thread or inline)."""
        return list(self._pool.pids) if self._pool is not None else []

    # ---- the plan --------------------------------------------------------------------------

    def start_step(self, cursor: int, ranges: RangesLike, later: RangesLike | RangesOf | None = None) -> None:
        """A step starts at ``cursor`` on exactly ``ranges`` (``later``: the ranges of the
        steps after it, default the same): make sure its items are planned, first, and start
        counting its input wait."""
        self.step_wait = 0.0
        self.aim(cursor, later if later is not None else ranges, first_ranges=ranges)

    def aim(self, cursor: int, ranges: RangesLike | RangesOf, *, first_ranges: RangesLike | None = None) -> None:
        """The next step is at ``cursor`` (on ``first_ranges`` when given, else ``ranges``),
        the ones after it on ``ranges``: plan their items (keeping those already planned,
        dropping the rest) and give loaders work. Cheap when nothing changed."""
        if self._pool is None or self._broken is not None or self._closed:
            return
        wanted = plan(self._order, cursor, ranges, self.steps, self.micro_batch, first_ranges=first_ranges,
                      end=self.end, memo=self._plan_memo)
        with self._cond:
            old = self._items
            self._items = {}
            for key, indices in wanted:
                item = old.get(key)
                self._items[key] = item if item is not None and item.indices == indices else _Item(key, indices)
            self.dropped += sum(1 for k, item in old.items() if self._items.get(k) is not item)
            self._by_indices = {}
            for item in self._items.values():
                self._by_indices.setdefault(item.indices, []).append(item)
            self._dispatch()

    def _dispatch(self) -> None:
        """(Under the lock.) Give the next planned items to the loaders, in plan order, while
        fewer than the limit are in flight."""
        if self._pool is None or self._broken is not None or self._closed:
            return
        for item in self._items.values():
            if len(self._tasks) >= self._limit:
                return
            if item.state is _State.PLANNED:
                task_id, self._next_task = self._next_task, self._next_task + 1
                item.state = _State.RUNNING
                self._tasks[task_id] = item
                owned = self.owned_at(item.key.cursor) if self.owned_at is not None else self.owned
                self._pool.submit(task_id, item.indices, owned)

    def _deliver(self, task_id: int, state: _State, value: Any) -> None:
        """(A loader's thread.) The outcome of a task; dropped when its item is no longer planned."""
        with self._cond:
            item = self._tasks.pop(task_id, None)
            if item is not None and self._items.get(item.key) is item and item.state is _State.RUNNING:
                item.state, item.value = state, value
            self._dispatch()
            self._cond.notify_all()

    def _on_broken(self, reason: str) -> None:
        """(The result thread.) A loader died: every batch inline from now on."""
        log.warning("input pipeline broken (%s): fetching every batch in the training thread from now on", reason)
        with self._cond:
            self._broken = reason
            self._lose_all()

    def _lose_all(self) -> None:
        for item in self._items.values():
            if item.state in (_State.PLANNED, _State.RUNNING):
                item.state = _State.LOST
        self._tasks.clear()
        self._cond.notify_all()

    # ---- the engine's fetcher ----------------------------------------------------------------

    def fetch(self, indices: Sequence[int]) -> Any:
        """The collated batch of exactly ``indices`` (the engine's ``fetch_batch``): a
        prefetched item with these indices (waiting for it while a loader works on it), else
        fetched here. Raises what the dataset or collate function raised - in a loader or
        here - with the user's file and line (:func:`~shoal.worker.errors.raised_at`)."""
        t0 = time.perf_counter()
        try:
            return self._fetch(tuple(int(i) for i in indices))
        finally:
            waited = time.perf_counter() - t0
            self.step_wait += waited
            self.total_wait += waited

    def _fetch(self, want: tuple[int, ...]) -> Any:
        with self._cond:
            item = next((i for i in self._by_indices.get(want, ()) if self._items.get(i.key) is i), None)
            while item is not None and item.state is _State.RUNNING and not self._closed:
                self._cond.wait(POLL_S)
            if item is not None:
                del self._items[item.key]
                self._by_indices[item.indices].remove(item)
                self._dispatch()
        if item is not None and item.state is _State.READY:
            self.hits += 1
            return item.value
        if item is not None and item.state is _State.FAILED:
            self.hits += 1
            raise item.value
        self.misses += 1  # not planned (a changed plan), not yet started, or lost: inline
        with self._dataset_lock:
            return self.collate_fn(read_samples(self.dataset, want, self.owned))

    def close(self) -> None:
        """Stop the loaders and drop what was prefetched; logs what the pipeline did.
        Idempotent; :meth:`fetch` works on, inline."""
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._items, self._by_indices = {}, {}
            self._lose_all()
        atexit.unregister(self.close)
        if self._pool is not None:
            self._pool.close()
            # nothing fetched (a worker that failed before training): nothing worth a line
            log.log(logging.INFO if self.hits or self.misses else logging.DEBUG,
                    "input pipeline closed: %d batches prefetched, %d fetched inline, %.2f s waited for batches",
                    self.hits, self.misses, self.total_wait)
