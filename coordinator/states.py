"""The coordinator's view of one job: its status and its worker records (:class:`CoordState`).

The states, their allowed moves and the failure causes are the wire's vocabulary and live in
:mod:`shoal.events.states`; the two records in :mod:`shoal.events.records`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.events.records import JobStatus, WorkerRecord
from shoal.events.states import WorkerState


@dataclass(frozen=True)
class CoordState:
    """Everything a decision needs about one job: status + worker records."""

    status: JobStatus = field(default_factory=JobStatus)
    workers: dict[str, WorkerRecord] = field(default_factory=dict)

    def in_state(self, states: frozenset[WorkerState]) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.state in states]
