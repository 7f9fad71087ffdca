"""A training worker's evaluations: running the job's ``eval_fn`` and its distributed
evaluation (``TrainingSetup.eval_dataset``), and reporting their metrics.

Every member evaluates the same committed step on its identical model (nobody then waits for
rank 0 in the next step's all-reduce): ``eval_fn`` whole on every member, the evaluation
dataset split across the members and reduced (:meth:`Layout.evaluate_split`: the same
metrics at any world size, in less time as members are added). A distributed evaluation whose
collective fails (a peer died meanwhile) is not reported; the next step fails the same way and
the generation is replaced. Rank 0 reports the metrics where people look: the
coordinator (job record, ``shoal status``, ``shoal events``), the progress history (the
report, the dashboard) and TensorBoard. An evaluation and the next step's own work are one
busy span for the step timeout: :meth:`Evaluator.busy_since` tells the step how long the
evaluation before it took.

:meth:`Evaluator.metrics` computes a step's metrics once and then remembers them, so an
action performed again after a Redis error only sends again and never evaluates twice. Not
thread-safe: the training thread alone calls it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from shoal.worker.decide import Evaluate
from shoal.worker.errors import CollectiveFailed
from shoal.worker.layout import Layout
from shoal.worker.membership import Membership
from shoal.worker.progress import ProgressRecorder
from shoal.worker.tensorboard import TensorBoardLog

log = logging.getLogger("shoal.worker")


class Evaluator:
    """See the module docstring. ``busy(flag)`` marks this worker's own work for the step
    timeout (the heartbeat's busy mark); ``progress`` is set once the worker joined."""

    def __init__(self, engine: Layout, eval_fn: Callable | None, membership: Membership,
                 tensorboard: TensorBoardLog | None, busy: Callable[[bool], None], *, eval_dataset: Any = None,
                 eval_sums: Callable | None = None, eval_batch_size: int = 64,
                 on_report: Callable[[int, dict], None] | None = None) -> None:
        self.engine = engine
        self.eval_fn = eval_fn
        self.eval_dataset = eval_dataset
        self.eval_sums = eval_sums
        self.eval_batch_size = eval_batch_size
        #: called with (step, metrics) after rank 0 reported an evaluation (checkpoint
        #: retention's best-by-metric record)
        self.on_report = on_report
        self.membership = membership
        self.tensorboard = tensorboard
        self.busy = busy
        self.progress: ProgressRecorder | None = None
        #: the last evaluation: ((step, cursor), metrics)
        self._evaluation: tuple[tuple[int, int], dict[str, float]] | None = None
        #: (generation, step, seconds it took) of the last periodic evaluation: the next step
        #: of that generation counts as busy that much longer
        self._took: tuple[int, int, float] | None = None

    @property
    def enabled(self) -> bool:
        """Whether the job evaluates at all (an ``eval_fn`` or an evaluation dataset)."""
        return self.eval_fn is not None or self.eval_dataset is not None

    def metrics(self, step: int, cursor: int) -> dict[str, float]:
        """The metrics of the model as of committed ``step`` at ``cursor`` (``eval_fn``'s and
        the distributed evaluation's): computed once, then remembered. Raises UserCodeError
        when the user's code raises, CollectiveFailed when the distributed evaluation's
        all-reduce fails (a peer failed)."""
        if self._evaluation is None or self._evaluation[0] != (step, cursor):
            metrics: dict[str, float] = {}
            if self.eval_fn is not None:
                metrics.update(self.engine.evaluate(self.eval_fn))
            if self.eval_dataset is not None:
                metrics.update(self.engine.evaluate_split(self.eval_dataset, self.eval_sums, self.eval_batch_size))
            self._evaluation = ((step, cursor), metrics)
        return self._evaluation[1]

    def run(self, act: Evaluate) -> None:
        """A periodic evaluation (every member); rank 0 reports it. Busy from its start to the
        next step's all-reduce. Raises UserCodeError when ``eval_fn`` raises (a crash, as in a
        step)."""
        started = time.monotonic()
        fresh = self._evaluation is None or self._evaluation[0] != (act.step, act.cursor)
        if fresh:
            self.busy(True)
        try:
            metrics = self.metrics(act.step, act.cursor)
        except CollectiveFailed as exc:  # a peer failed: the next step fails too, and is redone
            log.warning("the evaluation of step %d is not reported: %s", act.step, exc)
            return
        finally:
            self.busy(False)
        if fresh:
            self._took = (act.generation, act.step, time.monotonic() - started)
        if act.report:
            self.report(act.step, act.epoch, act.generation, metrics)
        log.info("evaluated step %d (epoch %d) in %.3f s%s: %s", act.step, act.epoch, time.monotonic() - started,
                 ", reported" if act.report else "", json.dumps(metrics))

    def busy_since(self, generation: int, step: int) -> float | None:
        """Called once per step, when it starts (``step`` committed in ``generation`` before
        it): when its busy span began - the start of the evaluation right before it in the
        same group - or None (the step's own start). Forgets that evaluation's time."""
        took, self._took = self._took, None
        if took is not None and took[:2] == (generation, step):
            return time.monotonic() - took[2]
        return None

    def report(self, step: int, epoch: int, generation: int, metrics: dict, final: bool = False) -> None:
        """Rank 0's evaluation, where people look (see the module docstring). Raises redis
        errors of the coordinator's report (the action is performed again)."""
        self.membership.evaluated(step, epoch, generation, metrics, final=final)
        if self.on_report is not None:
            self.on_report(step, metrics)
        if self.progress is not None:
            self.progress.record_eval(step, epoch, generation, metrics)
        if self.tensorboard is not None:
            self.tensorboard.metrics(step, metrics)
