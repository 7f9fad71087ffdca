"""A training worker's input: which samples each step takes, and fetching them ahead.

:class:`InputPipeline` holds the job's data order (the committed cursor -> the global batch of
a step, :class:`~shoal.worker.data.DataOrder`), a streaming dataset's split of each batch by
shard owner (:class:`~shoal.worker.stream_input.StreamInput`; None for a map-style dataset)
and the prefetcher that fetches the coming steps' batches in loader processes
(:class:`~shoal.worker.prefetch.Prefetcher`, installed as the engine's fetcher). The training
worker asks it, per step, for this rank's samples (:meth:`InputPipeline.step`), tells it when
a step committed (:meth:`committed`) and when a generation formed (:meth:`formed`,
:meth:`switched`), and reads its figures for the heartbeat and the progress history.

It must be built before any thread or socket of the worker exists (its loaders are forked:
see :mod:`shoal.worker.prefetch`). Not thread-safe: the training thread alone calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from shoal.core.jobspec import JobSpec
from shoal.events.models import Member, ShardTable
from shoal.worker.data import DataOrder
from shoal.worker.decide import Announce, TrainStep
from shoal.worker.engine import StepEngine
from shoal.worker.membership import Membership
from shoal.worker.prefetch import Prefetcher
from shoal.worker.stream_input import StreamInput, is_streaming
from shoal.worker.stream_order import DEFAULT_WINDOW
from shoal.worker.userapi import TrainingSetup

log = logging.getLogger("shoal.worker")


def training_tensors(engine) -> Iterator:
    """What a forked loader frees (it never reads them): the model's parameters, buffers and
    gradients, the optimizer's state and the engine's gradient buckets."""
    model, optimizer = engine.model, engine.optimizer
    for p in model.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from model.buffers()
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    reducer = getattr(engine, "reducer", None)
    for bucket in getattr(reducer, "buckets", ()) or ():
        yield bucket.flat


Ranges = tuple[tuple[int, int, int], ...]


class InputPipeline:
    """See the module docstring. Every attribute exists from ``__init__`` on."""

    def __init__(self, setup: TrainingSetup, engine: StepEngine, spec: JobSpec, membership: Membership) -> None:
        n = len(setup.dataset)
        #: samples in the dataset (one epoch)
        self.num_samples = n
        #: a streaming dataset's per-step assignment by shard owner (None: map-style dataset)
        self.stream: StreamInput | None = None
        if is_streaming(setup.dataset):  # shard-aware order; each rank reads the shards it owns
            shard_samples = list(setup.dataset.shard_samples)
            self.order = DataOrder(n, spec.seed, spec.step_samples, shard_samples=shard_samples,
                                   window=int(getattr(setup.dataset, "shuffle_window", None) or DEFAULT_WINDOW))
            self.stream = StreamInput(setup.dataset, self.order,
                                      tolerance=int(getattr(setup.dataset, "balance_tolerance", None) or 0))
            membership.num_shards = len(shard_samples)
            log.info("streaming dataset: %d shards, shuffle window %d shards", len(shard_samples), self.order.window)
        else:
            self.order = DataOrder(n, spec.seed, spec.step_samples)
        #: the job's length in steps: ``max_steps``, else every epoch's steps (the last batch
        #: of an epoch may be short), whichever is fewer
        by_epochs = self.order.steps_per_epoch() * spec.epochs
        self.total_steps = min(by_epochs, spec.max_steps) if spec.max_steps else by_epochs
        log.info("built %s: %d samples, %d steps/epoch", spec.entrypoint, n, self.order.steps_per_epoch())
        self.prefetch = Prefetcher(
            setup.dataset, engine.collate_fn, num_samples=n, seed=spec.seed,
            global_batch=spec.step_samples, device=engine.device,
            # the engine's split (a compiled model's fixed shape): the prefetcher's items are its micro-batches
            micro_batch=engine.compiled_shape or engine.micro_batch,
            workers=spec.loader_workers if setup.loader_workers is None else setup.loader_workers,
            steps=spec.prefetch_steps if setup.prefetch_steps is None else setup.prefetch_steps,
            end=self.order.cursor_after(self.total_steps),  # nothing past the last step is fetched
            order=self.order, release=lambda: training_tensors(engine))
        if self.stream is not None:
            self.prefetch.owned_at = self.stream.reading
        engine.fetcher = self.prefetch.fetch
        #: (generation, step, ranks behind) of the last group formed: in that step the ranks
        #: behind take no samples (a streaming dataset's split leaves them out)
        self._behind: tuple[int, int, frozenset[int]] = (0, -1, frozenset())

    def epoch(self, cursor: int) -> int:
        """The epoch (0-based) that ``cursor`` is in."""
        return cursor // self.order.num_samples

    # ---- per step ----------------------------------------------------------------------------

    def step(self, act: TrainStep, table: ShardTable | None, member: Member | None, worker_id: str,
             later: Member | None = None):
        """The global batch of ``act``, this rank's ranges of it and its sample indices; the
        prefetcher is told the step started (its batches are taken now). ``later``: this
        member's entry in a re-slice expected after this step (the steps after it are
        prefetched on its ranges)."""
        batch = self.order.batch(act.cursor)
        ranges = act.ranges
        if self.stream is not None:  # the split by shard owner replaces the table's ranges
            active = self._active_ranks(act, table, worker_id)
            ranges = self.stream.ranges(batch, active)
            self.stream.note_step(batch, active)
        local = batch.for_rank(ranges)
        self.prefetch.start_step(act.cursor, ranges, self._steady(ranges, later or member))
        return batch, ranges, local

    def committed(self, batch, ranges: Ranges, member: Member | None) -> None:
        """The step of ``batch`` committed: aim the prefetcher at the next steps."""
        self.prefetch.aim(batch.next_cursor, self._steady(ranges, member))
        if self.stream is not None:
            self.stream.plan_ahead(batch.next_cursor, self.prefetch.end)

    def heartbeat_figures(self) -> dict:
        """What the heartbeat publishes of the input: the last step's wait for its batches and,
        for a streaming dataset, its counters (read at most once a second)."""
        figures = {"input_wait_time": round(self.prefetch.step_wait, 4)}
        if self.stream is not None:
            figures.update(self.stream.figures(max_age=1.0))
        return figures

    @property
    def step_wait(self) -> float:
        """Seconds the last step waited for its batches."""
        return self.prefetch.step_wait

    @property
    def stream_figures(self) -> dict | None:
        """A streaming dataset's figures of the last step (None: not streaming)."""
        return self.stream.last_figures if self.stream is not None else None

    # ---- generations ---------------------------------------------------------------------------

    def formed(self, generation: int, step: int, behind: frozenset[int]) -> None:
        """A group formed at ``step``; ``behind``: the ranks that received state (they take no
        samples in its first step)."""
        self._behind = (generation, step, behind)

    def switched(self, act: Announce, table: ShardTable | None, member: Member | None, worker_id: str,
                 first: Ranges | None) -> None:
        """A generation formed: aim the prefetcher at its first steps (``first``: this rank's
        ranges of the first step, when they differ from the table's)."""
        if self.stream is not None:
            self.stream.use_table(table, worker_id)
            self.prefetch.owned = self.stream.reading(act.cursor)
            active = [r for r in range(act.world) if r not in act.behind] if act.behind else None
            end = self.prefetch.end
            first = self.stream.ranges(self.order.batch(act.cursor), active) if end is None or act.cursor < end else None
            self.stream.plan_ahead(act.cursor, self.prefetch.end)
        self.prefetch.aim(act.cursor, self._steady(first or (), member), first_ranges=first)

    def _active_ranks(self, act: TrainStep, table: ShardTable | None, worker_id: str) -> list[int] | None:
        """The ranks that take samples in ``act`` (None: all): in the first step after a
        catch-up, those that were not behind. Keeps the stream's table current."""
        self.stream.use_table(table, worker_id)
        self.prefetch.owned = self.stream.reading(act.cursor)
        generation, step, behind = self._behind
        if behind and generation == act.base and step == act.step:
            return [r for r in range(act.world) if r not in behind]
        return None

    def _steady(self, fallback: Ranges, member: Member | None) -> Ranges | Callable:
        """This member's ranges in its generation's table (the first step after a catch-up
        may take others): what the prefetcher plans the coming steps with. A streaming
        dataset's: a function of each step's batch (its split by shard owner)."""
        if self.stream is not None:
            stream = self.stream
            return lambda batch: stream.ranges(batch)
        return tuple(map(tuple, member.ranges)) if member is not None else fallback

    def close(self) -> None:
        self.prefetch.close()
