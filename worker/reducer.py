"""The gradient of a step, all-reduced in buckets while backward still runs (DDP's reducer).

Buckets
    The trainable parameters are split, in reverse registration order (the order backward
    produces their gradients), into buckets of about ``bucket_cap_mb`` MiB (:func:`plan_buckets`:
    the first one closed once it holds 1 MiB, so communication starts early; as DDP's, a bucket
    takes the parameter that crosses its cap). Each parameter's ``.grad`` is a view of its
    bucket, so backward accumulates straight into what is reduced. The last bucket - the
    first-registered parameters, whose gradients come last - ends with ``tail`` trailing
    values that belong to the caller (the step engine's wire format): reduced with it, never
    touched here except by :meth:`GradientReducer.begin`'s zeroing.

Overlap
    A post-accumulate-grad hook marks a parameter ready once the reducer is **armed** (the
    engine arms it for the backward of the last micro-batch only; earlier ones just
    accumulate); a bucket whose parameters are all ready is all-reduced (SUM) asynchronously,
    and buckets are launched strictly in index order (bucket ``i`` only after ``0..i-1``), so
    every rank starts the same collectives in the same order whatever order its hooks fired
    in. With gloo and three or more ranks a bucket also waits until the previous collective
    completed (at most one in flight, :meth:`~shoal.worker.process_group.Group.serial_collectives`):
    a rank whose collective failed then has nothing else in flight, so leaving the group
    closes its connections and the peers blocked on it fail at once instead of waiting for
    each other (with two ranks the only peer is the one that failed). When backward returns,
    the parameters that got no gradient (unused, or used only by earlier micro-batches) are
    marked ready as they are - zeros, or what earlier micro-batches accumulated - and the
    remaining buckets are launched, in order: no deadlock, no flag to set. Once a step found
    such parameters, later steps find them before backward by walking the loss's autograd
    graph (:attr:`GradientReducer.find_unused`), so a bucket holding an unused parameter does
    not hold back the ones after it. In a group, a parameter whose gradient arrives a second
    time in one backward after its bucket was launched (reentrant checkpointing of shared
    weights) fails the step; before the launch, or without a group, the bucket simply takes
    the sum.

The contract with its one caller, :class:`shoal.worker.engine.StepEngine`, is in
:class:`GradientReducer`'s docstring. The group whose collectives carry a step is handed to
:meth:`GradientReducer.begin` by the caller (it owns it); there is no implicit one.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from shoal.worker import process_group as pg

log = logging.getLogger("shoal.worker")

#: The first bucket is at most this big (DDP's choice): its all-reduce starts early in backward.
FIRST_BUCKET_BYTES = 2**20
#: The gradient buckets' default size in MiB (the job spec's ``bucket_cap_mb``; DDP's default).
DEFAULT_BUCKET_CAP_MB = 25.0


def plan_buckets(sizes_bytes: Sequence[int], cap_bytes: float, first_bytes: float = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Split parameters (their byte sizes, in registration order) into buckets as DDP's reducer
    does: in reverse order, a bucket takes consecutive parameters and closes once it holds at
    least its cap (``first_bytes`` for bucket 0 - at most ``cap_bytes`` - then ``cap_bytes``),
    so the parameter that crosses the cap still goes with the gradients computed before it
    and its reduction starts before the rest of backward. Returns each bucket's parameter
    indices (reverse order)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    used = 0.0
    for i in reversed(range(len(sizes_bytes))):
        current.append(i)
        used += sizes_bytes[i]
        if used >= (min(first_bytes, cap_bytes) if not buckets else cap_bytes):
            buckets.append(current)
            current, used = [], 0.0
    if current:
        buckets.append(current)
    return buckets


def _params_in_graph(loss: torch.Tensor) -> set[int]:
    """``id`` of every leaf tensor whose gradient backward from ``loss`` accumulates."""
    found: set[int] = set()
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)  # AccumulateGrad
        if var is not None:
            found.add(id(var))
        stack.extend(f for f, _ in fn.next_functions)
    return found


class _TwiceReady(Exception):
    """A parameter's gradient arrived again after its bucket's all-reduce was launched."""


class _Bucket:
    """One all-reduced flat tensor: the gradients of some parameters (plus, for the last
    bucket, the trailing values) and each parameter's view of it."""

    __slots__ = ("index", "members", "flat", "grads", "views", "offsets")

    def __init__(self, index: int, members: list[int], params: list[torch.Tensor], dtype: torch.dtype,
                 device: torch.device, tail: int) -> None:
        self.index = index
        self.members = members  # parameter indices
        numel = sum(params[i].numel() for i in members)
        self.flat = torch.zeros(numel + tail, dtype=dtype, device=device)
        self.grads = self.flat[:numel]  # the gradient part (no trailing values)
        self.views: dict[int, torch.Tensor | None] = {}
        self.offsets: dict[int, tuple[int, int]] = {}
        offset = 0
        for i in members:
            p, n = params[i], params[i].numel()
            self.offsets[i] = (offset, n)
            self.views[i] = self.flat[offset : offset + n].view_as(p) if p.dtype == dtype else None
            offset += n


class GradientReducer:
    """The bucketed, overlapped all-reduce (SUM) of one step's gradient of ``params``.

    Built once with the parameters (non-empty, on ``device``): it plans the buckets, allocates
    them (float32, or float64 when a parameter is float64: :attr:`dtype`) and registers a
    post-accumulate-grad hook on every parameter (:meth:`close` removes them). Every step, from
    one thread, in this order:

    1. :meth:`begin` - only between steps (nothing in flight, no backward running): zeroes the
       buckets, makes each parameter's ``.grad`` a view of its bucket, resets the launch state;
       ``distributed=False`` (no group) runs the same bookkeeping and launches nothing;
    2. optionally :meth:`launch`: a collective that goes before every bucket (the engine's
       generation MAX);
    3. the caller writes the last bucket's trailing values (``buckets[-1].flat[-tail:]``)
       before anything can launch that bucket, i.e. before :meth:`arm`;
    4. :meth:`arm` right before the backward of the last micro-batch, to overlap: its hooks
       launch buckets during that backward. Without it every bucket goes in :meth:`finish`;
    5. :meth:`finish` once backward returned, then :meth:`complete` (blocks until every
       collective succeeded);
    6. on success, :meth:`unflatten_grads` before the optimizer reads ``.grad``; the reduced
       values are in :attr:`buckets` (``grads`` and, in the last one, the tail);
       on any failure from step 1 on, :meth:`abandon` - required before the next :meth:`begin`.

    Thread safety: the hooks run on autograd threads (on a GPU, the device's), concurrently
    with nothing of this class but each other; they take the reducer's lock, and so do
    :meth:`finish`, :meth:`complete` and :meth:`abandon`. A hook never raises into autograd:
    the first error (a launch that failed, a gradient after its bucket's launch, a ``.grad``
    that cannot be copied in) is kept, nothing more is launched, and :meth:`finish` or
    :meth:`complete` raises it. :meth:`complete` raises
    :class:`~shoal.worker.errors.CollectiveFailed` when a collective fails or the group is
    aborted (at once). A failure after some buckets were launched leaves the group's
    collective sequence broken: the caller must leave the group unless it redoes the step in
    a new one. The hooks hold the reducer weakly: dropping it disables them.
    """

    def __init__(self, params: list[torch.Tensor], device: torch.device, bucket_cap_mb: float, tail: int) -> None:
        self.params = params
        self.device = device
        self.tail = tail  # trailing values of the last bucket (the caller's)
        wide = any(p.dtype == torch.float64 for p in params)
        #: the buckets' dtype (float64 when a parameter is, else float32)
        self.dtype = torch.float64 if wide else torch.float32
        item = torch.empty((), dtype=self.dtype).element_size()
        self._plan = plan_buckets([p.numel() * item for p in params], bucket_cap_mb * 2**20)
        self._bucket_of = [0] * len(params)
        for b, members in enumerate(self._plan):
            for i in members:
                self._bucket_of[i] = b
        #: the persistent buckets, in launch order (replaced by :meth:`abandon` when a
        #: collective may still write into them)
        self.buckets = self._new_buckets()
        # per-step launch state (guarded by _lock: hooks may run on autograd's device threads)
        self._lock = threading.Lock()
        self._armed = False
        self._ready = [False] * len(params)
        self._left = [len(m) for m in self._plan]
        self._launched = 0  # buckets 0.._launched-1 are launched
        self._pending: list[pg.PendingReduce] = []  # launched collectives, in order
        self._waited = 0  # _pending[:_waited] completed successfully
        self._serial = True  # at most one collective in flight (Group.serial_collectives)
        #: the group this step's collectives run on (None: a local step, no collectives)
        self._group: pg.Group | None = None
        self._launch_error: BaseException | None = None
        #: ``time.perf_counter()`` when this step's first bucket was launched (None: none yet)
        self.first_launch: float | None = None
        self._distributed = False
        self._fired = 0  # parameters marked ready by their hook in the last backward
        #: walk the loss's graph for unused parameters before the last backward (set once a
        #: step found parameters without a gradient)
        self.find_unused = False
        ref = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(ref, i)) for i, p in enumerate(params)]

    @property
    def bucket_count(self) -> int:
        """How many all-reduces carry the gradient of one step."""
        return len(self._plan)

    def _new_buckets(self) -> list[_Bucket]:
        """Persistent buckets (views of them are the parameters' ``.grad``). Made anew after a
        failed step whose collectives may still write into the old ones."""
        last = len(self._plan) - 1
        return [_Bucket(b, members, self.params, self.dtype, self.device, self.tail if b == last else 0)
                for b, members in enumerate(self._plan)]

    def close(self) -> None:
        """Remove the gradient hooks from the parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def begin(self, group: "pg.Group | None") -> None:
        """Zero the buckets, make each bucket-dtype parameter's ``.grad`` a view of its bucket
        and reset the launch state (nothing is in flight between steps). The step's
        collectives run on ``group`` (None: a local step, nothing is reduced)."""
        for bucket in self.buckets:
            bucket.flat.zero_()
            for i in bucket.members:
                self.params[i].grad = bucket.views[i]  # None for parameters of another dtype
        self._ready = [False] * len(self.params)
        self._left = [len(m) for m in self._plan]
        self._launched = 0
        self._pending = []
        self._waited = 0
        self._group = group
        self._serial = group is None or group.serial_collectives()
        self._launch_error = None
        self.first_launch = None
        self._distributed = group is not None
        self._fired = 0

    def launch(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, what: str) -> None:
        """Start an all-reduce of ``tensor`` that goes before every bucket of this step (after
        :meth:`begin`, before :meth:`arm`): :meth:`complete` waits for it first,
        :meth:`abandon` gives it up. CollectiveFailed when it cannot be started."""
        self._pending.append(self._group.all_reduce_async(tensor, op, what))

    # --- launching the buckets -------------------------------------------------------------
    @staticmethod
    def _hook(ref: "weakref.ref[GradientReducer]", i: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            reducer = ref()
            if reducer is not None and reducer._armed:
                reducer._on_ready(i, fired=True)

        return hook

    def arm(self, loss: torch.Tensor) -> None:
        """Before the last micro-batch's backward: hooks mark parameters ready from now on;
        with :attr:`find_unused`, the parameters outside the loss's graph are ready now."""
        if self.find_unused:
            used = _params_in_graph(loss)
            for i, p in enumerate(self.params):
                if id(p) not in used:
                    self._on_ready(i, fired=False)
        self._armed = True

    def _on_ready(self, i: int, *, fired: bool) -> None:
        """Parameter ``i``'s gradient is final for this step: copy it into its bucket if it does
        not live there, and launch every bucket that is complete and next in order. Never
        raises (it runs inside autograd): a failure is kept for :meth:`finish`/:meth:`complete`."""
        with self._lock:
            try:
                b = self._bucket_of[i]
                if self._ready[i]:  # a second gradient in one backward
                    if b >= self._launched or not self._distributed:
                        self._copy_in(i)  # nothing read the bucket yet: it takes the sum
                    elif fired and self._launch_error is None:
                        self._launch_error = _TwiceReady(
                            f"parameter {i} received a gradient again after its bucket's all-reduce started "
                            "(reentrant activation checkpointing?): use torch.utils.checkpoint with "
                            "use_reentrant=False")
                    return
                self._ready[i] = True
                self._fired += fired
                self._copy_in(i)
                self._left[b] -= 1
                self._launch_ready()
            except Exception as exc:  # noqa: BLE001 - raised by finish() or complete()
                if self._launch_error is None:
                    self._launch_error = exc

    def _copy_in(self, i: int) -> None:
        """Put parameter ``i``'s gradient into its bucket when it is not already there (a
        parameter of another dtype, or user code that replaced ``.grad``); no gradient at all
        leaves the zeros."""
        bucket = self.buckets[self._bucket_of[i]]
        grad, view = self.params[i].grad, bucket.views[i]
        if grad is None or (view is not None and grad.data_ptr() == view.data_ptr()):
            return
        offset, n = bucket.offsets[i]
        bucket.flat[offset : offset + n].copy_(grad.reshape(-1))

    def _launch_ready(self) -> None:
        """(Under the lock; never blocks.) Launch buckets ``_launched, _launched + 1, ...``
        while they are complete - and, with serial collectives, while nothing is in flight."""
        while self._launched < len(self.buckets) and self._left[self._launched] == 0:
            if self._launch_error is not None:
                return
            bucket = self.buckets[self._launched]
            if self._distributed:
                if self._serial and not self._idle():
                    return  # launched by a later hook, or after backward
                if self.first_launch is None:
                    self.first_launch = time.perf_counter()
                self._pending.append(self._group.all_reduce_async(bucket.flat, dist.ReduceOp.SUM,
                                                                  f"all_reduce of gradient bucket {bucket.index}"))
            self._launched += 1

    def _idle(self) -> bool:
        """(Under the lock; never blocks.) Whether every launched collective has completed;
        raises CollectiveFailed when one failed."""
        while self._waited < len(self._pending):
            pending = self._pending[self._waited]
            if not pending.completed():
                return False
            pending.wait()  # ended: returns at once, or raises what it failed with
            self._waited += 1
        return True

    def finish(self) -> None:
        """After backward: every parameter not yet ready is (no gradient in the last
        micro-batch: unused, or used by earlier ones only), and the buckets that can go, go.
        A step with samples that found such parameters turns :attr:`find_unused` on. Raises
        what a hook kept (a failed launch, a gradient after its bucket's launch)."""
        with self._lock:
            armed, self._armed = self._armed, False
            if self._launch_error is not None:
                raise self._launch_error
            unused = 0
            for i in range(len(self.params)):
                if not self._ready[i]:
                    unused += 1
                    self._ready[i] = True
                    self._copy_in(i)
                    self._left[self._bucket_of[i]] -= 1
            self._launch_ready()
        if armed and self._fired and unused and not self.find_unused:
            self.find_unused = True
            log.info("%d of %d parameters got no gradient in a step: looking for unused parameters in the "
                     "autograd graph before each backward from now on", unused, len(self.params))

    def complete(self) -> None:
        """After :meth:`finish`: wait for the launched collectives in order, launching the
        remaining buckets as they may go, until every bucket's all-reduce has succeeded; then
        reap the sends posted before them (as ``Group.all_reduce`` does). Raises
        CollectiveFailed at the first failure (or abort)."""
        if not self._distributed:
            return
        while True:
            with self._lock:
                if self._launch_error is not None:
                    raise self._launch_error
                if self._waited == len(self._pending):
                    if self._launched == len(self.buckets):
                        break
                    self._launch_ready()  # nothing in flight: the next bucket goes now
                    continue
                pending = self._pending[self._waited]
            pending.wait()  # blocks; abortable
            with self._lock:
                self._waited += 1
                self._launch_ready()
        self._group.wait_sends()
        with self._lock:  # the completed works pin the group's sockets open: drop them now, not at the next
            self._pending, self._waited = [], 0  # begin (a member leaving before it must close them at once)

    def abandon(self) -> None:
        """After a failure (anywhere from :meth:`begin` on): disarm the hooks; collectives
        launched and not waited for are abandoned (kept until the group is freed); after any
        launched collective, or an abort, the buckets are replaced - a collective still in
        flight may write into the old ones. The parameters' ``.grad`` are left to the caller."""
        with self._lock:
            self._armed = False
            launched, self._pending = self._pending, []
            in_flight = launched[self._waited:]
        group = self._group
        if in_flight:
            group.abandon(in_flight)
        if launched or (group is not None and group.abort_reason):
            self.buckets = self._new_buckets()

    def unflatten_grads(self) -> None:
        """After :meth:`complete`: each parameter's ``.grad`` is its reduced gradient - a view
        of its bucket, or a copy in its own dtype for a parameter of another dtype."""
        for bucket in self.buckets:
            for i in bucket.members:
                p, view = self.params[i], bucket.views[i]
                if view is not None:
                    p.grad = view
                else:
                    offset, n = bucket.offsets[i]
                    p.grad = bucket.flat[offset : offset + n].view_as(p).to(p.dtype).clone()
