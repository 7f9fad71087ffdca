"""Where training resumes from a checkpoint (:class:`ResumePoint`): the counters every
checkpoint record carries and its manifest records, defined once for the three records
(:class:`~shoal.storage.train_state.TrainState`, a sharded checkpoint's
:class:`~shoal.storage.sharded.ShardedTrainState` and the opened
:class:`~shoal.storage.sharded.ShardedCheckpoint`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

#: The counters, as the manifest names them.
COUNTERS = ("step", "epoch", "data_cursor", "generation", "world_size")


class _Counters(Protocol):
    step: int
    epoch: int
    data_cursor: Any
    generation: int
    world_size: int


@dataclass(kw_only=True)
class ResumePoint:
    """The committed ``step`` a checkpoint holds, the ``epoch`` its data cursor is in, the
    data loader's ``data_cursor`` (any JSON value it understands), the ``generation`` the step
    was committed in and that generation's ``world_size``. The base of the checkpoint records
    (keyword-only fields, so each record keeps its own positional ones)."""

    step: int
    epoch: int = 0
    data_cursor: Any = 0
    generation: int = 0
    world_size: int = 1

    @staticmethod
    def counters(source: _Counters) -> dict[str, Any]:
        """``source``'s counters (a manifest's, another record's) as keyword arguments of a
        record."""
        return {name: getattr(source, name) for name in COUNTERS}

    def manifest_fields(self) -> dict[str, Any]:
        """The counters as the manifest records them. The cursor goes through JSON (tuples
        become lists, dict keys strings). ``ValueError`` if a counter is not an int in range
        or the cursor is not JSON-serializable (NaN/inf included)."""
        kind = type(self).__name__
        for name in ("step", "epoch", "generation"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{kind}.{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 1:
            raise ValueError(f"{kind}.world_size must be an int >= 1, got {self.world_size!r}")
        try:
            cursor = json.loads(json.dumps(self.data_cursor, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{kind}.data_cursor must be JSON-serializable: {exc}") from exc
        return {"step": self.step, "epoch": self.epoch, "data_cursor": cursor, "generation": self.generation,
                "world_size": self.world_size}
