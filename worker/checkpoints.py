"""The training worker's use of storage/: resume at start, async saves by rank 0.

Resume order: the job's Redis LATEST pointer (if it names this store), else the store's
own LATEST object, else a scan of manifests (``shoal.storage.resume``) — so a job resumes even
after Redis was wiped. A completed save is announced with a ``checkpoint`` event; the
coordinator then moves the Redis pointer (fenced, never backwards). Save failures are
logged and never stop training; LATEST simply does not move.
"""

from __future__ import annotations

import logging

from shoal.core.faults import FaultPlan
from shoal.storage.async_saver import AsyncCheckpointer
from shoal.storage.errors import NoCheckpoint
from shoal.storage.latest import LatestPointer
from shoal.storage.resume import resume
from shoal.storage.train_state import TrainState
from shoal.storage.uri import open_store
from shoal.worker.engine import StepEngine
from shoal.worker.membership import Membership

log = logging.getLogger("shoal.worker.checkpoints")

CLOSE_TIMEOUT_S = 120.0


class Checkpoints:
    def __init__(self, store, membership: Membership, keep: int, faults: FaultPlan | None = None):
        self.store = store
        self.membership = membership
        self.faults = faults or FaultPlan([])
        self._pending_generation = 0
        self.saver = AsyncCheckpointer(store, keep_last=keep, on_saved=self._saved,
                                       on_error=lambda exc: log.error("checkpoint failed, LATEST not moved: %s", exc),
                                       on_phase=self._phase if self.faults else None,
                                       protect=self._pinned)

    @classmethod
    def open(cls, spec, membership: Membership, faults: FaultPlan | None = None) -> "Checkpoints":
        return cls(open_store(spec.checkpoint_uri, create_bucket=True), membership, spec.checkpoint_keep, faults)

    def _pinned(self) -> list[int]:
        """The step the job's Redis LATEST pointer names: retention must keep it (while the
        coordinator is away the pointer lags the store's LATEST). Redis errors propagate,
        so that retention is skipped rather than guessing."""
        raw = self.membership.client.get(self.membership.keys.latest)
        return [LatestPointer.from_json(raw).step] if raw else []

    def _phase(self, phase: str, step: int) -> None:
        self.faults.at(self.membership.worker_id, step, phase)

    def resume(self, engine: StepEngine) -> tuple[int, int] | None:
        """Load the newest verifying checkpoint into ``engine``; (step, cursor) or None."""
        try:
            state, manifest = resume(self.store, self.membership.client, self.membership.job_id, on_warning=log.warning)
        except NoCheckpoint:
            return None
        state.restore(engine.model, engine.optimizer, engine.lr_scheduler, rng=state.rng is not None,
                      scaler=engine.scaler)
        log.info("resumed from %s step %d (cursor %s)", self.store.uri, state.step, state.data_cursor)
        return state.step, int(state.data_cursor)

    def save(self, engine: StepEngine, *, step: int, cursor: int, epoch: int, generation: int, world_size: int, wait: bool) -> None:
        state = TrainState.capture(engine.model, engine.optimizer, engine.lr_scheduler, step=step, epoch=epoch,
                                   data_cursor=cursor, generation=generation, world_size=world_size,
                                   scaler=engine.scaler)
        self._pending_generation = generation
        started = self.saver.save_async(state, wait_s=CLOSE_TIMEOUT_S if wait else 0.0)
        if not started:
            log.info("checkpoint of step %d skipped: the previous save is still being written", step)
        if wait:
            self.saver.wait(CLOSE_TIMEOUT_S)

    def _saved(self, manifest) -> None:
        self._phase("ckpt_before_event", manifest.step)
        self.membership.checkpointed(manifest.step, self.store.uri, self._pending_generation)
        log.info("checkpoint of step %d complete in %s", manifest.step, self.store.uri)

    def close(self) -> None:
        self.saver.close(CLOSE_TIMEOUT_S)
