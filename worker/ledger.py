"""The ledger of committed steps: proof that every sample was used exactly once.

When ``SHOAL_LEDGER_DIR`` is set, every worker appends one JSON line per committed step:
step, cursor, epoch, generation, worker, pid, the whole global batch and the samples it trained
(its slice, or what its layout chose: DiLoCo's round redone after a failure), the seconds of its
own work in the step (``compute``: data, forward, backward; benches take each worker's rate from
it) and its exposed communication seconds (``comm``) (plus, with fp16, the loss scale the step
used, whether it was an overflow step skipped, and the scale's state after it; with
``SHOAL_LEDGER_DIGESTS=1``, the digest of the weights after the step).
:func:`verify` checks a run's ledgers: each step committed in one generation only, the
ranks' slices partition the step's batch, and each complete epoch used every sample once.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from shoal.events import envvars


class Ledger:
    """Appends committed steps to ``ledger-<pid>-<random>.jsonl`` in ``SHOAL_LEDGER_DIR`` (no-op
    when unset). The random part keeps one file per process even where PIDs repeat: workers of
    several containers (each its own PID namespace) sharing one ledger folder, or a restarted
    container whose new worker gets its predecessor's PID and would append to a file whose
    last line a kill cut off."""

    def __init__(self, path: Path | None):
        self._fh = open(path, "a", buffering=1) if path else None

    @classmethod
    def from_env(cls) -> "Ledger":
        d = envvars.LEDGER_DIR.get()
        if not d:
            return cls(None)
        Path(d).mkdir(parents=True, exist_ok=True)
        return cls(Path(d) / f"ledger-{os.getpid()}-{secrets.token_hex(4)}.jsonl")

    def commit(self, worker_id: str, step: int, batch, generation: int, local, world: int = 0,
               extra: dict | None = None) -> None:
        if self._fh is None:
            return
        entry = {"t": time.time(), "world": world, "worker": worker_id, "pid": os.getpid(), "step": step,
                 "cursor": batch.cursor, "epoch": batch.epoch, "generation": generation, "count": batch.count,
                 "batch": [int(i) for i in batch.indices], "indices": [int(i) for i in local]}
        self._fh.write(json.dumps({**entry, **(extra or {})}) + "\n")


def read(directory: Path) -> list[dict]:
    """Every complete entry (a line ending in a newline) of the ledgers in ``directory``: a
    line still being written by a running worker, or cut off by a killed one, is left out."""
    out = []
    for f in sorted(Path(directory).glob("ledger-*.jsonl")):
        *complete, _partial = f.read_text().split("\n")
        out += [json.loads(line) for line in complete if line]
    return out


@dataclass(frozen=True)
class Verdict:
    ok: bool
    steps: int
    epochs_complete: int
    problem: str = ""
    #: steps committed by only some ranks of their generation (see verify)
    partial_commits: int = 0


def verify(entries: list[dict], num_samples: int) -> Verdict:
    """Check the exactly-once invariants over a run's ledger entries (see module doc)."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    for e in entries:
        by_step[e["step"]].append(e)
    steps = sorted(by_step)
    if steps != list(range(1, len(steps) + 1)):
        return Verdict(False, len(steps), 0, "committed step numbers have gaps")
    used: dict[int, list[int]] = defaultdict(list)
    partial = 0
    for step in steps:
        group = by_step[step]
        if len({e["generation"] for e in group}) != 1:
            return Verdict(False, len(steps), 0, f"step {step} committed in two generations")
        batch = group[0]["batch"]
        if any(e["batch"] != batch or e["cursor"] != group[0]["cursor"] for e in group):
            return Verdict(False, len(steps), 0, f"ranks disagree on the batch of step {step}")
        recorded = sorted(i for e in group for i in e["indices"])
        world = group[0].get("world") or len(group)
        if len(group) >= world:
            if recorded != sorted(batch):
                return Verdict(False, len(steps), 0, f"the ranks' slices of step {step} do not partition its batch")
        else:
            # a peer died during the step's last exchange: the all-reduce completed on some ranks
            # (their update holds every rank's gradient) and the others adopted it at the next
            # generation's resync, so fewer ranks recorded the step; their slices must not overlap
            if len(set(recorded)) != len(recorded) or not set(recorded) <= set(batch):
                return Verdict(False, len(steps), 0, f"the recorded slices of step {step} overlap or leave its batch")
            partial += 1
        used[group[0]["epoch"]] += batch
    complete = 0
    for epoch, indices in sorted(used.items()):
        if len(indices) >= num_samples or epoch < max(used):
            if sorted(indices) != list(range(num_samples)):
                return Verdict(False, len(steps), complete, f"epoch {epoch}: a sample missing or used twice")
            complete += 1
        elif len(set(indices)) != len(indices):
            return Verdict(False, len(steps), complete, f"epoch {epoch}: a sample used twice")
    return Verdict(True, len(steps), complete, partial_commits=partial)
