"""The training engine protocol: one interface, one module per layout.

A *layout* is how the members of a generation train one model together. Three exist:

- :class:`~shoal.worker.layout_dp.DataParallel` (``shard_size`` 1): every member holds the
  whole model; a generation's members form one group and all-reduce the gradient in buckets;
- :class:`~shoal.worker.layout_hsdp.Hsdp` (``shard_size`` > 1, elastic HSDP): replica groups
  of ``shard_size`` members shard the model with FSDP2 over a shard group each keeps for life,
  and each generation's cross-replica groups carry the gradient between them.

Everything outside the layouts - the generation switch (:mod:`shoal.worker.switch`), the
training loop (:mod:`shoal.worker.training`), the checkpoint code
(:mod:`shoal.worker.checkpoints`), the evaluator and the input pipeline - talks to a
:class:`Layout` and never asks which one it holds (``tests/packaging/test_layout.py`` checks
that nothing outside the ``layout*`` modules branches on one). A layout owns the process groups
of its generations: it makes them through the worker's :class:`~shoal.worker.process_group.
Rendezvous`, hands them to whatever runs collectives (its step, the reducer, the state
transfer), aborts exactly those an eviction concerns, and closes them.
:func:`shoal.worker.layouts.layout_for`, the one place that reads the spec's ``shard_size``,
picks the class; :class:`LayoutOptions`, built
once from the job spec, is what every layout reads (a field added there reaches all of them).

- :class:`~shoal.worker.layout_diloco.Diloco` (``sync: diloco``): semi-synchronous DiLoCo;
  every member runs inner steps alone and a round ends with one outer exchange.

Adding a layout is one module implementing
:class:`Layout` plus its tests, and one line in :func:`shoal.worker.layouts.layout_for`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shoal.core.jobspec import CompileOptions, DilocoOptions, JobSpec
from shoal.events.keys import JobKeys
from shoal.events.models import Member, ShardTable
from shoal.worker.checkpoints import RESUME, Restore
from shoal.worker.decide import Formed, FormFailed
from shoal.worker.engine import StepResult
from shoal.worker.process_group import Rendezvous
from shoal.worker.reducer import DEFAULT_BUCKET_CAP_MB
from shoal.worker.steal import StepShares, default_chunk


@dataclass(frozen=True)
class LayoutOptions:
    """What every layout reads of the job spec (one record: a field added here reaches every
    layout). ``device``: the model's (the worker's placement)."""

    device: torch.device
    precision: str = "fp32"
    max_grad_norm: float | None = None
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    shard_size: int = 1
    #: ``torch.compile``'s options (None: the model is not compiled)
    compile: CompileOptions | None = None
    #: a compiled job's fixed micro-batch when ``TrainingSetup.micro_batch`` is unset: the
    #: slice of the largest world size (every rank at every world size cuts its slice in
    #: micro-batches of this shape, the short last one padded)
    fixed_micro_batch: int | None = None
    activation_checkpointing: bool = False
    #: ``sync: diloco``'s options (None: every step all-reduces)
    diloco: DilocoOptions | None = None
    #: the spec's ``global_batch_size`` (DiLoCo: the samples of one inner step over all members)
    global_batch: int = 64
    #: slices by speed evened out within each step (``batch_split_steal``): the default chunk
    #: a member's slice is cut in (the setup's ``micro_batch`` wins); None: no balancing in a step
    steal_chunk: int | None = None

    @classmethod
    def from_spec(cls, spec: JobSpec, device: torch.device) -> "LayoutOptions":
        compile_options = spec.compile_options
        fixed = -(-spec.global_batch_size // spec.max_workers) if compile_options is not None else None
        return cls(device=torch.device(device), precision=spec.precision, max_grad_norm=spec.max_grad_norm,
                   bucket_cap_mb=spec.bucket_cap_mb, shard_size=spec.shard_size, compile=compile_options,
                   fixed_micro_batch=fixed, activation_checkpointing=spec.activation_checkpointing,
                   diloco=spec.diloco_options, global_batch=spec.global_batch_size,
                   steal_chunk=(default_chunk(spec.global_batch_size, spec.max_workers)
                                if spec.batch_split == "by_speed" and spec.batch_split_steal else None))


@dataclass
class GroupSettings:
    """How a layout makes its groups: the worker's rendezvous, the job's keys (store prefixes),
    this worker's id, and the timeouts (the rendezvous's, and the collectives' backstop)."""

    rendezvous: Rendezvous
    keys: JobKeys
    worker_id: Callable[[], str]
    rdzv_timeout: float
    collective_timeout: float


class Layout(Protocol):
    """The training engine every part of the worker talks to (see the module docstring).

    Threads: :meth:`abort_for`, :meth:`abort_all` and :meth:`membership_lost` may be called
    from any thread (the watcher's, the heartbeat's) and only abort groups or end the process;
    everything else runs on the training thread."""

    # --- what it trains (read by the loop, the evaluator, the input pipeline, the switch) ------
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    device: torch.device
    collate_fn: Callable[[list[Any]], Any]
    micro_batch: int | None
    #: where batches come from (the input pipeline's prefetcher installs its ``fetch``)
    fetcher: Callable[[list[int]], Any] | None
    #: the last check before a step is applied (raises StepAborted to refuse it)
    commit_guard: Callable[[], None] | None
    #: called when a step's own work is done and it starts waiting on peers
    before_collectives: Callable[[], None] | None
    #: the fp16 loss scale (None unless the layout supports fp16 and the job uses it)
    scaler: Any
    #: whether a checkpoint save waits for the previous one rather than being skipped (every
    #: member of a sharded layout writes its own part of the same step)
    save_waits: bool
    #: whether rank 0's own part is the whole checkpoint, so it can write one alone, outside any
    #: group (a drained job's last state: ``worker.decide``); a sharded layout's needs its
    #: whole saving replica group
    saves_alone: bool
    #: whether the layout's steps take :meth:`step`'s ``shares`` (slices by speed evened out
    #: within the step, ``batch_split_steal``; data parallelism only): the training loop builds
    #: them only then
    steals: bool

    # --- a generation's groups ----------------------------------------------------------------
    def form(self, table: ShardTable, member: Member, step: int, cursor: int) -> Formed | FormFailed:
        """Form ``table``'s groups as ``member`` and start every member from the most
        advanced one's state (``step``/``cursor``: this member's committed ones)."""

    def leave(self, *, background: bool = False) -> None:
        """Leave the generation's groups (what outlives a generation stays). Never raises."""

    def aborted(self) -> bool:
        """Whether the generation's groups were aborted (their collectives fail at once)."""

    def abort_for(self, generation: int, members: frozenset[str], evicted: Sequence[str], newer: int) -> None:
        """(Any thread.) Table ``newer`` evicts ``evicted``: abort exactly the collectives this
        member shares with them in ``generation`` (its members: ``members``)."""

    def abort_all(self, generation: int, why: str) -> None:
        """(Any thread.) The job failed: abort every group of ``generation``, formed or forming."""

    def membership_lost(self, generation: int, why: str) -> None:
        """(Any thread.) This worker is no longer a member (declared failed, or its record lost
        with Redis's data): its step cannot commit; abort its collectives now."""

    def before_rejoin(self) -> None:
        """Evicted while alive, about to rejoin with this process's state: a layout whose
        state cannot go on in this process ends it here (for its agent to start it again)."""

    def close(self) -> None:
        """Leave every group (also what outlives a generation) and remove hooks: the process
        ends next. Never raises."""

    # --- the step -----------------------------------------------------------------------------
    def step(self, local_indices: Sequence[int], global_count: int, generation: int, *, base_generation: int,
             world_size: int, shares: StepShares | None = None) -> StepResult:
        """Train this rank's ``local_indices`` of a global batch of ``global_count`` samples in
        the generation ``base_generation`` of ``world_size`` ranks, telling the others the
        newest ``generation`` seen. ``shares``: the whole step's slices by rank, for a layout
        that evens its members out within the step (:attr:`steals`; the result's ``trained``
        then says which samples this rank took). StepAborted (nothing applied),
        InconsistentStep, UserCodeError."""

    def warm_up(self) -> float:
        """Before joining: compile on the fixed shape (a joiner must not make its peers wait
        for its compile); its seconds (0: nothing to do - not compiled, or compiled later,
        once the layout can run a step)."""

    def before_update(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once in the next step, after its collectives, before anything applies."""

    def evaluate(self, eval_fn: Callable[[torch.nn.Module], dict[str, float]]) -> dict[str, float]:
        """``eval_fn(model)`` without gradients; UserCodeError if it raises."""

    def evaluate_split(self, dataset: Any, sums_fn: Any, batch_size: int) -> dict[str, float]:
        """A distributed evaluation of ``dataset`` (``TrainingSetup.eval_dataset``), split across
        the generation's members like the training data and reduced: ``val_<name>`` metrics,
        the same at any world size. Every member calls it for the same step; CollectiveFailed
        when a peer fails, UserCodeError when the user's code raises."""

    def fetch_batch(self, indices: list[int]) -> Any:
        """The collated batch of ``indices`` on the engine's device."""

    # --- state --------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict (a collective in a sharded layout)."""

    def state_extras(self) -> dict[str, Any]:
        """Replicated state beyond model, optimizer and scheduler (JSON values)."""

    def load_state_extras(self, extra: dict[str, Any]) -> None:
        """Take another replica's :meth:`state_extras`."""

    def checkpoint(self, shard: int, **counters: Any) -> Any:
        """This member's part of a checkpoint of the current state (``counters``: step,
        epoch, data_cursor, generation, world_size), ready for the store."""

    def resume(self, state: Any, newest: Callable[[], Any], parts: Restore = RESUME) -> None:
        """Load a checkpoint chosen at start (``newest``: the newest one that verifies now, for
        a layout that loads later and finds ``state`` gone). May defer the load until the
        layout can take it (a sharded model, once its group formed). ``parts``: everything
        (a resume), or a warm start's weights (and optimizer state)."""


def eval_metrics(names: list[str], total: torch.Tensor) -> dict[str, float]:
    """A distributed evaluation's metrics from its reduced ``[samples, sums...]``:
    ``val_<name>`` = each sum over the number of samples."""
    values = total.tolist()
    count = values[0] or 1.0
    return {f"val_{name}": value / count for name, value in zip(names, values[1:])}
