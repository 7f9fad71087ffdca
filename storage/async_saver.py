"""Checkpoint in the background while training continues.

:meth:`AsyncCheckpointer.save_async` is called at a step boundary. It deep-copies the state
to CPU memory (the only time the training thread is held) and hands the copy to a
background thread that runs :func:`~storage.checkpoint.save_checkpoint`.

At most one save is in flight. A request made while one is running waits up to ``wait_s``
(default 0: not at all) for it to finish and is otherwise **skipped**: it returns False,
nothing is copied, ``skipped`` is incremented. Training never queues behind storage; the
next step boundary simply tries again.

A failed save (storage error, LATEST regression, a failing ``on_saved`` hook) is stored in
``last_error`` and passed to ``on_error``; LATEST is only ever moved by a save that wrote its
manifest completely, so a failure never publishes anything. Every blocking call takes an
explicit timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from shoal.storage.backend import ObjectStore
from shoal.storage.checkpoint import save_checkpoint, save_sharded_checkpoint
from shoal.storage.manifest import FROM_ENV, HmacKey, Manifest
from shoal.storage.sharded import ShardedTrainState
from shoal.storage.train_state import TrainState

log = logging.getLogger("shoal.storage")


class AsyncCheckpointer:
    """Background checkpoint writer for one store; use from the training thread.

    ``on_saved(manifest)`` runs in the background thread after LATEST moved (e.g. to publish
    the Redis pointer); ``on_error(exc)`` runs there after a failure. An exception from
    ``on_saved`` counts as a failed save; one from ``on_error`` is logged. Nothing is ever
    raised into the training thread. ``on_phase`` is passed to ``save_checkpoint``.

    With ``reuse_buffers`` (default) the CPU copy of the last save is kept and overwritten
    by the next snapshot instead of allocating a new one: one state-sized CPU buffer stays
    allocated between saves, and snapshots avoid page-fault costs (see the benchmark).
    """

    def __init__(
        self,
        store: ObjectStore,
        *,
        keep_last: int | None = 3,
        hmac_key: HmacKey = FROM_ENV,
        on_saved: Callable[[Manifest], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        on_warning: Callable[[str], None] | None = None,
        reuse_buffers: bool = True,
        on_phase: Callable[[str, int], None] | None = None,
        protect: Callable[[], Iterable[int]] | None = None,
        job_id: str | None = None,
    ) -> None:
        self._store = store
        self._job_id = job_id
        self._reuse_buffers = reuse_buffers
        self._staging: TrainState | ShardedTrainState | None = None  # last snapshot, reused once its save is done
        self._keep_last = keep_last
        self._hmac_key = hmac_key
        self._on_saved = on_saved
        self._on_error = on_error
        self._on_phase = on_phase
        self._protect = protect
        self._on_warning = on_warning if on_warning is not None else log.warning
        self._idle = threading.Event()
        self._idle.set()
        self._claim = threading.Lock()
        self._closed = False
        self.last_error: BaseException | None = None
        self.saved = 0
        self.failed = 0
        self.skipped = 0

    @property
    def in_flight(self) -> bool:
        return not self._idle.is_set()

    def save_async(self, state: TrainState | ShardedTrainState, *, wait_s: float = 0.0) -> bool:
        """Snapshot ``state`` and start writing it; True if started, False if skipped because
        a save was still in flight after ``wait_s`` seconds. Errors of the snapshot itself
        (e.g. out of memory) propagate; RuntimeError after :meth:`close`."""
        if self._closed:
            raise RuntimeError("AsyncCheckpointer is closed")
        self._idle.wait(wait_s)
        with self._claim:
            if not self._idle.is_set():
                self.skipped += 1
                return False
            self._idle.clear()
        try:
            reuse = self._staging if type(self._staging) is type(state) else None
            snapshot = state.snapshot(reuse=reuse)
            self._staging = snapshot if self._reuse_buffers else None
            thread = threading.Thread(
                target=self._run, args=(snapshot,), name=f"shoal-checkpoint-{state.step}", daemon=True
            )
            thread.start()
        except BaseException:
            self._idle.set()
            raise
        return True

    def _run(self, snapshot: TrainState | ShardedTrainState) -> None:
        save = save_sharded_checkpoint if isinstance(snapshot, ShardedTrainState) else save_checkpoint
        try:
            manifest = save(
                self._store,
                snapshot,
                keep_last=self._keep_last,
                hmac_key=self._hmac_key,
                on_warning=self._on_warning,
                on_phase=self._on_phase,
                protect=self._protect,
                job_id=self._job_id,
            )
            if self._on_saved is not None and manifest is not None:  # a sharded save's member 0 publishes
                self._on_saved(manifest)
            self.saved += 1
        except Exception as exc:  # reported, not raised: the thread has no caller
            self.failed += 1
            self.last_error = exc
            log.error("checkpoint of step %d failed: %s", snapshot.step, exc)
            if self._on_error is not None:
                try:
                    self._on_error(exc)
                except Exception:
                    log.exception("on_error hook failed")
        finally:
            self._idle.set()

    def wait(self, timeout_s: float) -> bool:
        """Block until no save is in flight or ``timeout_s`` passed; True if idle."""
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Refuse new saves and wait up to ``timeout_s`` for the one in flight; True if it
        finished (the staging buffer is then released). A save still running after the
        timeout continues in its daemon thread and dies with the process (the store stays
        consistent: the save is atomic)."""
        self._closed = True
        finished = self.wait(timeout_s)
        if finished:
            self._staging = None
        return finished
