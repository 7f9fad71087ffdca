"""The training worker's use of storage/: resume at start, async saves by rank 0.

Resume order: the job's Redis LATEST pointer (if it names this store), else the store's
own LATEST object, else a scan of manifests (``shoal.storage.resume``) — so a job resumes even
after Redis was wiped. A completed save is announced with a ``checkpoint`` event; the
coordinator then moves the Redis pointer (fenced, never backwards). Save failures are
logged and never stop training; LATEST simply does not move.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from shoal.core.faults import FaultPlan
from shoal.storage.async_saver import AsyncCheckpointer
from shoal.core.jobspec import KeepBest
from shoal.storage.errors import CheckpointCorrupt, NoCheckpoint, StorageError
from shoal.storage.evals import best_step, record_eval
from shoal.storage.verify import list_checkpoint_steps
from shoal.core.durable import execute_confirmed
from shoal.storage.latest import LatestPointer
from shoal.storage.resume import resume
from shoal.storage.rng import restore_rng
from shoal.storage.sharded import ShardedCheckpoint, WholeTensorReader, load_into
from shoal.storage.train_state import TrainState
from shoal.worker import torch_compat as tc
from shoal.storage.uri import open_store
from shoal.worker.membership import Membership

log = logging.getLogger("shoal.worker.checkpoints")

CLOSE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Restore:
    """What a layout loads of a checkpoint (:meth:`Layout.resume`). A resume (the default)
    loads everything: weights, optimizer, LR scheduler, RNG, loss scale. A warm start
    (``init_from``) loads the weights, and the optimizer's state only with ``optimizer``;
    never the LR scheduler, the RNG, the loss scale or the counters (the job starts at step
    0 of epoch 0)."""

    warm: bool = False
    optimizer: bool = True


def restore_warm(state: TrainState, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """A whole checkpoint's warm start into a whole model: its weights, and with an
    ``optimizer`` its per-parameter state (moments, step counts); the optimizer keeps its own
    hyperparameters (this job's learning rate, not the checkpoint's). ValueError when the
    checkpoint has no optimizer state to give."""
    if optimizer is None:
        state.restore(model, rng=False)
        return
    own = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    state.restore(model, optimizer, rng=False)
    for group, hyper in zip(optimizer.param_groups, own):
        group.update(hyper)


#: a resume: everything
RESUME = Restore()


class Checkpoints:
    def __init__(self, store, membership: Membership, keep: int, faults: FaultPlan | None = None,
                 keep_best: KeepBest | None = None):
        self.store = store
        self.membership = membership
        self.faults = faults or FaultPlan([])
        self.keep = keep
        #: retention also keeps the checkpoint with the best evaluation by this metric (None: no)
        self.keep_best = keep_best
        self._pending_generation = 0
        self.saver = AsyncCheckpointer(store, keep_last=keep, on_saved=self._saved,
                                       on_error=lambda exc: log.error("checkpoint failed, LATEST not moved: %s", exc),
                                       on_phase=self._phase if self.faults else None,
                                       protect=self._pinned, job_id=membership.job_id)

    @classmethod
    def open(cls, spec, membership: Membership, faults: FaultPlan | None = None) -> "Checkpoints":
        return cls(open_store(spec.checkpoint_uri, create_bucket=True), membership, spec.checkpoint_keep, faults,
                   keep_best=spec.checkpoint_keep_best)

    def _pinned(self) -> list[int]:
        """What retention must keep besides the newest: the step the job's Redis LATEST pointer
        names (while the coordinator is away the pointer lags the store's LATEST), and with
        ``checkpoint_keep_best`` the checkpoint whose recorded evaluation is the best. Redis
        and storage errors propagate, so that retention is skipped rather than guessing."""
        client = self.membership.client  # not a value a fail-over may drop (under Sentinel)
        (raw,) = execute_confirmed(client, client.pipeline(transaction=False).get(self.membership.keys.latest),
                                   "read of LATEST")
        pinned = [LatestPointer.from_json(raw).step] if raw else []
        if self.keep_best is not None:
            best = best_step(self.store, self.keep_best.metric, self.keep_best.mode,
                             set(list_checkpoint_steps(self.store)))
            if best is not None:
                pinned.append(best)
        return pinned

    def record_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Rank 0's evaluation of ``step``, kept for ``checkpoint_keep_best`` (nothing without
        it). A storage error is logged: retention then only keeps the newest."""
        if self.keep_best is None:
            return
        try:
            record_eval(self.store, step, metrics)
        except StorageError as exc:
            log.warning("the evaluation of step %d was not recorded in %s (%s): the best checkpoint may not be kept",
                        step, self.store.uri, exc)

    def _phase(self, phase: str, step: int) -> None:
        self.faults.at(self.membership.worker_id, step, phase)

    def resume(self, layout) -> tuple[int, int] | None:
        """Load the newest verifying checkpoint into ``layout`` (:class:`~shoal.worker.layout.
        Layout`); (step, cursor) or None. Any checkpoint into any layout: a full (data-
        parallel) one or a sharded one of any shard size, into data parallelism or HSDP of any
        shard size; a layout may load it later (a sharded model once its replica group formed:
        then only the counters are read here, and the layout is given a way to the newest
        checkpoint in case retention removed this one meanwhile)."""
        try:
            state, _manifest = resume(self.store, self.membership.client, self.membership.job_id,
                                      on_warning=log.warning)
        except NoCheckpoint:
            log.info("no checkpoint yet in %s: starting at step 0", self.store.uri)
            return None
        kind = f"sharded over {state.shards}" if isinstance(state, ShardedCheckpoint) else "full"
        log.info("resuming from %s step %d (cursor %s, a %s checkpoint)", self.store.uri, state.step,
                 state.data_cursor, kind)
        layout.resume(state, self._newest)
        return state.step, int(state.data_cursor)

    def _newest(self):
        """The newest checkpoint that verifies now (NoCheckpoint when none does)."""
        state, _manifest = resume(self.store, self.membership.client, self.membership.job_id, on_warning=log.warning)
        return state

    def save(self, layout, *, step: int, cursor: int, epoch: int, generation: int, world_size: int, wait: bool,
             shard: int = 0) -> None:
        """Start the checkpoint of ``step``: this member's part (:meth:`Layout.checkpoint`:
        data parallelism, rank 0's whole state; HSDP, this member's shards - every member of
        the saving replica group calls it). A save that finds the previous one still running
        is skipped, unless ``wait`` or the layout's ``save_waits`` (every part of a sharded
        checkpoint must be of one step): then it waits for it."""
        counters = dict(step=step, epoch=epoch, data_cursor=cursor, generation=generation, world_size=world_size)
        state = layout.checkpoint(shard, **counters)
        wait_s = CLOSE_TIMEOUT_S if wait or layout.save_waits else 0.0
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


def warm_start(layout, uri: str, *, optimizer: bool) -> int:
    """Load the newest verifying checkpoint of the store ``uri`` (``init_from``, whichever
    job wrote it) into ``layout`` as a warm start (:class:`Restore`): its weights, and its
    optimizer state with ``optimizer``; the job itself starts at step 0. Any checkpoint into
    any layout, as a resume. Returns the step of the checkpoint loaded. StorageError
    (NoCheckpoint when the store holds none) when it cannot be loaded: a job asked to start
    from weights never starts from others."""
    store = open_store(uri)
    parts = Restore(warm=True, optimizer=optimizer)
    state, manifest = resume(store, on_warning=log.warning)

    def newest():  # a layout that loads later and finds that checkpoint gone
        return resume(store, on_warning=log.warning)[0]

    log.info("warm start from %s step %d (a %s checkpoint of job %s): %s; this job starts at step 0", uri,
             state.step, f"sharded over {state.shards}" if isinstance(state, ShardedCheckpoint) else "full",
             manifest.job_id or "(not recorded)", "weights and optimizer state" if optimizer else "weights only")
    layout.resume(state, newest, parts)
    return state.step


def load_flat(engine, state: TrainState | ShardedCheckpoint, parts: Restore = RESUME) -> None:
    """Load ``state`` - a whole checkpoint or a sharded one of any shard size - into
    ``engine``'s model and optimizer as their flat state (``torch_compat.flat_state``: a
    sharded model takes only its own shards), scheduler and RNG; a warm start (``parts``)
    only the model's, and the optimizer's per-parameter state with ``parts.optimizer`` (the
    optimizer keeps its own hyperparameters, and otherwise the fresh state it has)."""
    if isinstance(state, TrainState):  # a data-parallel checkpoint into HSDP
        try:
            whole = tc.flatten_whole(engine.model, engine.optimizer, state.model,
                                     state.optimizer if parts.optimizer else None)
        except ValueError as exc:
            raise CheckpointCorrupt(f"checkpoint of step {state.step}: {exc}") from exc
        reader = WholeTensorReader({k: v for k, v in whole.items() if isinstance(v, torch.Tensor)})
        values = {k: v for k, v in whole.items() if not isinstance(v, torch.Tensor)}
    else:
        reader, values = state.reader, state.optimizer_groups or {}
    target = tc.flat_state(engine.model, engine.optimizer)
    # a warm start keeps this job's hyperparameters (the parameter groups)
    wanted = tc.flat_keys(target, optimizer=parts.optimizer, groups=not parts.warm)
    load_into({k: v for k, v in target.items() if k in wanted and isinstance(v, torch.Tensor)}, reader)
    for key, value in target.items():
        if key in wanted and not isinstance(value, torch.Tensor) and key in values:
            target[key] = values[key]
    tc.set_flat_state(engine.model, engine.optimizer, target)
    if parts.warm:
        return
    if engine.lr_scheduler is not None and state.scheduler is not None:
        engine.lr_scheduler.load_state_dict(state.scheduler)
    if state.rng is not None:
        restore_rng(state.rng)
