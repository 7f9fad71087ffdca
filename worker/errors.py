"""Errors of the training side of a worker (store, process group, engine, user API).

Outside errors (torch.distributed, redis-py) are translated into these in one place:
:func:`shoal.worker.process_group.translate_error`. The worker loop reacts by class:

* :class:`RendezvousFailed` / :class:`RendezvousTimeout` - the group of a generation could not
  be formed; report it and wait for the next generation.
* :class:`CollectiveFailed` - a collective raised (a peer died, was killed, or the group is
  broken). The generation's groups must be left (:meth:`shoal.worker.layout.Layout.leave`).
* :class:`StepAborted` - the step was NOT applied (no optimizer step, grads zeroed, buffers
  restored); redo the same step (same cursor) in the next generation.
* :class:`InconsistentStep` - a StepAborted raised by every rank when the ranks disagreed on
  the global batch (different shard tables or cursors); the control plane should re-plan.
* :class:`UserCodeError` - the user's model/loss/step function raised; a bug, not a peer failure.
* :class:`EntrypointError` - the job's ``module:function`` could not be loaded or returned junk.
* :class:`StateMismatch` - a state broadcast between workers whose models differ in structure.
"""

from __future__ import annotations

from shoal.core.errors import ShoalError
from shoal.events.exits import WorkerExit
from shoal.events.models import FormationError


class WorkerError(ShoalError):
    """Base class of every error the training side of a worker raises on purpose.
    ``formation_error`` classifies it for the coordinator when it ends a generation's
    formation (:func:`shoal.worker.classify.formation_error`; TRANSIENT unless known)."""

    default_formation_error = FormationError.TRANSIENT

    def __init__(self, *args: object, formation_error: FormationError | None = None, local: bool = False) -> None:
        super().__init__(*args)
        self.formation_error = formation_error or self.default_formation_error
        #: this process gave the operation up itself - its group was aborted here (an
        #: eviction it was told of, the job's end), its commit fence refused - rather than a
        #: peer failing it (a closed connection, a timeout): what the progress watchdog reads
        #: to tell a member that keeps aborting a step from the peers it takes down with it
        self.local = local


class RendezvousFailed(WorkerError):
    """The process group of one generation could not be formed (store or backend failure)."""


class InterfaceUnavailable(RendezvousFailed):
    """The interface named for gloo to advertise (``--iface``) does not exist here or has no
    IPv4 address: a configuration error, the same at every try."""

    default_formation_error = FormationError.NO_INTERFACE_ADDRESS


class RendezvousTimeout(RendezvousFailed):
    """Not every rank of the generation arrived at the rendezvous within the timeout."""


class ReplicaGroupLost(WorkerError):
    """Elastic HSDP: this worker's replica group lost a member (or this worker was evicted).
    Its shard group cannot go on, and cannot be made again in this process (torch resolves
    FSDP's groups by name): the process exits with :attr:`exit_code` and its node agent
    starts it again at once, without a back-off or a restart spent; it rejoins as a new
    worker and forms a new replica group, healed from the live ones."""

    exit_code = WorkerExit.RESTART


class CollectiveFailed(WorkerError):
    """A collective (all_reduce, broadcast, barrier) raised: a peer died or timed out, or the
    group was already destroyed. The group is unusable; leave it and join the next generation."""


class StepAborted(WorkerError):
    """A training step was abandoned before the optimizer stepped.

    The model parameters, optimizer state, LR scheduler and module buffers are exactly as
    before the step, and the gradients are zeroed. The caller must not advance its cursor and
    redoes the step in the next generation. ``__cause__`` holds the collective failure.
    """


class InconsistentStep(StepAborted):
    """The ranks of a step disagreed on the global batch (the all-reduced sample count differs
    from the expected one: ranks used different shard tables or cursors). Every rank sees the
    same reduced count, so every rank aborts the step; nothing was applied."""


class UserCodeError(WorkerError):
    """The user's code (dataset, model forward/backward, loss or step function) raised.

    Not retried by the runtime: it is expected to fail again. ``__cause__`` keeps the
    original traceback; :func:`raised_at` names where, for the one-line message.
    """


def raised_at(exc: BaseException) -> str:
    """``file.py:42 in fn``: the innermost frame of ``exc``'s traceback outside torch and
    shoal's own code (the user's line that raised), else the innermost frame ("" without a
    traceback). An exception raised in a loader process carries that place with it
    (``shoal_raised_at``, set by :mod:`shoal.worker.prefetch`)."""
    remote = getattr(exc, "shoal_raised_at", None)
    if isinstance(remote, str) and remote:  # raised by a loader (worker/prefetch.py): where it was raised there
        return remote
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    if not frames:
        return ""
    mine = ("/torch/", "/shoal/worker/", "/worker/engine.py", "/worker/reducer.py", "/worker/prefetch.py")
    user = [f for f in frames if not any(m in f[0].co_filename for m in mine)]
    code, line = (user or frames)[-1]
    return f"{code.co_filename}:{line} in {code.co_name}"


class EntrypointError(WorkerError):
    """The job's ``module:function`` entrypoint could not be imported, called, or validated."""

    exit_code = WorkerExit.ENTRYPOINT_ERROR


class StateMismatch(WorkerError):
    """A state broadcast found a model/optimizer whose structure differs from the source's."""
