"""The training worker's use of storage/: resume at start, async saves by rank 0.

Resume order: the job's Redis LATEST pointer (if it names this store), else the store's
own LATEST object, else a scan of manifests (``shoal.storage.resume``) — so a job resumes even
after Redis was wiped. A completed save is announced with a ``checkpoint`` event; the
coordinator then moves the Redis pointer (fenced, never backwards). Save failures are
logged and never stop training; LATEST simply does not move.
"""

from __future__ import annotations

import logging

import torch

from shoal.core.faults import FaultPlan
from shoal.storage.async_saver import AsyncCheckpointer
from shoal.storage.errors import CheckpointCorrupt, NoCheckpoint
from shoal.core.durable import execute_confirmed
from shoal.storage.latest import LatestPointer
from shoal.storage.resume import resume
from shoal.storage.rng import capture_rng, restore_rng
from shoal.storage.sharded import Chunk, ShardedCheckpoint, ShardedTrainState, WholeTensorReader, load_into
from shoal.storage.train_state import TrainState
from shoal.worker import torch_compat as tc
from shoal.storage.uri import open_store
from shoal.worker.engine import StepEngine
from shoal.worker.sharded_engine import ShardedEngine
from shoal.worker.membership import Membership

log = logging.getLogger("shoal.worker.checkpoints")

CLOSE_TIMEOUT_S = 120.0


class Checkpoints:
    def __init__(self, store, membership: Membership, keep: int, faults: FaultPlan | None = None):
        self.store = store
        self.membership = membership
        self.faults = faults or FaultPlan([])
        self.keep = keep
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
        client = self.membership.client  # not a value a fail-over may drop (under Sentinel)
        (raw,) = execute_confirmed(client, client.pipeline(transaction=False).get(self.membership.keys.latest),
                                   "read of LATEST")
        return [LatestPointer.from_json(raw).step] if raw else []

    def _phase(self, phase: str, step: int) -> None:
        self.faults.at(self.membership.worker_id, step, phase)

    def resume(self, engine: StepEngine | ShardedEngine) -> tuple[int, int] | None:
        """Load the newest verifying checkpoint into ``engine``; (step, cursor) or None. Any
        checkpoint into any engine: a full (data-parallel) one or a sharded one of any shard
        size, into data parallelism or HSDP of any shard size. An HSDP engine takes it once
        its model is sharded (its replica group formed): only the counters are read here."""
        try:
            state, manifest = resume(self.store, self.membership.client, self.membership.job_id, on_warning=log.warning)
        except NoCheckpoint:
            log.info("no checkpoint yet in %s: starting at step 0", self.store.uri)
            return None
        layout = f"sharded over {state.shards}" if isinstance(state, ShardedCheckpoint) else "full"
        if isinstance(engine, ShardedEngine):
            engine.after_shard(lambda: self._load_when_sharded(engine, state))
            log.info("resuming from %s step %d (cursor %s, a %s checkpoint) once the model is sharded",
                     self.store.uri, state.step, state.data_cursor, layout)
        else:
            restore_into(engine, state)
            log.info("resumed from %s step %d (cursor %s, a %s checkpoint)", self.store.uri, state.step,
                     state.data_cursor, layout)
        return state.step, int(state.data_cursor)

    def _load_when_sharded(self, engine: ShardedEngine, state) -> None:
        """(Once the replica group formed.) Load ``state``, the checkpoint chosen at start. A
        group can take a while to form, and retention may have removed that checkpoint
        meanwhile (measured in the HSDP chaos soak: 9 s later, ``shard-0-of-2.bin: missing``,
        and the worker died): then the newest checkpoint that verifies now is loaded instead,
        and ``engine.resumed_at`` says which step and cursor the member starts from."""
        try:
            restore_into(engine, state)
            return
        except CheckpointCorrupt as exc:
            log.warning("the checkpoint of step %d is gone since this worker started (%s; retention keeps the newest "
                        "%d): loading the newest one instead", state.step, exc, self.keep)
        newer, _manifest = resume(self.store, self.membership.client, self.membership.job_id, on_warning=log.warning)
        restore_into(engine, newer)
        engine.resumed_at = (newer.step, int(newer.data_cursor))
        log.info("resumed from %s step %d (cursor %s) instead", self.store.uri, newer.step, newer.data_cursor)

    def save(self, engine: StepEngine | ShardedEngine, *, step: int, cursor: int, epoch: int, generation: int,
             world_size: int, wait: bool, shard: int = 0) -> None:
        """Start the checkpoint of ``step``: data parallelism, rank 0's whole state; HSDP,
        this member's shards (every member of the saving replica group calls it; one that
        finds its previous save still running waits for it instead of skipping, so that the
        group's parts are of one step)."""
        counters = dict(step=step, epoch=epoch, data_cursor=cursor, generation=generation, world_size=world_size)
        if isinstance(engine, ShardedEngine):
            state = capture_sharded(engine, shard, **counters)
            wait_s = CLOSE_TIMEOUT_S
        else:
            state = TrainState.capture(engine.model, engine.optimizer, engine.lr_scheduler, scaler=engine.scaler,
                                       **counters)
            wait_s = CLOSE_TIMEOUT_S if wait else 0.0
        self._pending_generation = generation
        started = self.saver.save_async(state, wait_s=wait_s)
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


def capture_sharded(engine: ShardedEngine, shard: int, **counters) -> ShardedTrainState:
    """This member's part of a sharded checkpoint (live tensors: the saver snapshots them):
    the local shard of every sharded tensor; member 0 also the replicated tensors (buffers,
    optimizer step counts) and values (parameter groups, LR scheduler, RNG)."""
    chunks: list[Chunk] = []
    groups: dict = {}
    for key, value in tc.flat_state(engine.model, engine.optimizer).items():
        if not isinstance(value, torch.Tensor):
            groups[key] = value
            continue
        piece = tc.chunk_of(value)
        if piece is not None:
            local, offsets, size = piece
            if local.numel():
                chunks.append(Chunk(key, local, offsets, size))
        elif shard == 0:
            chunks.append(Chunk(key, value, (0,) * value.dim(), tuple(value.shape)))
    first = shard == 0
    scheduler = engine.lr_scheduler.state_dict() if first and engine.lr_scheduler is not None else None
    return ShardedTrainState(shard=shard, shard_size=engine.shard_group.world_size, chunks=chunks,
                             optimizer_groups=groups if first else None, scheduler=scheduler,
                             rng=capture_rng() if first else None, **counters)


def restore_into(engine: StepEngine | ShardedEngine, state: TrainState | ShardedCheckpoint) -> None:
    """Load ``state`` into ``engine`` whatever the two layouts (see :meth:`Checkpoints.resume`)."""
    if isinstance(state, TrainState) and not isinstance(engine, ShardedEngine):
        state.restore(engine.model, engine.optimizer, engine.lr_scheduler, rng=state.rng is not None,
                      scaler=engine.scaler)
        return
    if isinstance(state, TrainState):  # a data-parallel checkpoint into HSDP
        try:
            whole = tc.flatten_whole(engine.model, engine.optimizer, state.model, state.optimizer)
        except ValueError as exc:
            raise CheckpointCorrupt(f"checkpoint of step {state.step}: {exc}") from exc
        reader = WholeTensorReader({k: v for k, v in whole.items() if isinstance(v, torch.Tensor)})
        values = {k: v for k, v in whole.items() if not isinstance(v, torch.Tensor)}
    else:
        reader, values = state.reader, state.optimizer_groups or {}
    target = tc.flat_state(engine.model, engine.optimizer)
    load_into({k: v for k, v in target.items() if isinstance(v, torch.Tensor)}, reader)
    for key, value in target.items():
        if not isinstance(value, torch.Tensor) and key in values:
            target[key] = values[key]
    tc.set_flat_state(engine.model, engine.optimizer, target)
    if engine.lr_scheduler is not None and state.scheduler is not None:
        engine.lr_scheduler.load_state_dict(state.scheduler)
    if state.rng is not None:
        restore_rng(state.rng)
