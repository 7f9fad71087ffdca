"""The chaos soak's end-state checks and the table it prints.

Checks (each a line of the table; the soak fails if any fails):

- faults came for the whole window, with no long spell without one;
- the job completed;
- the ledger: every committed step once, in one generation, the ranks' slices partitioning
  its batch, every sample exactly once per epoch (:func:`shoal.worker.ledger.verify`);
- every worker that finished holds bit-identical parameters;
- those parameters are close to a failure-free single-process run with the same seed and
  the same number of steps (the step is world-size invariant up to float summation order);
- LATEST was valid at every sample; Redis memory and stream lengths stayed bounded;
- every fault injected was survived: training committed a step after it, as its kind's
  declared recovery says (:class:`shoal.ops.chaos.kinds.Recovery`: in a newer generation or in
  any; counted from the fault or from its heal);
- no worker was declared failed that no fault hit (a crash or a false eviction, which a job
  that heals itself would otherwise hide).

Which fault kinds the table counts (and in which order), which recovery times it reports and
what survived means for each is read from the registry of fault kinds
(:mod:`shoal.ops.chaos.kinds`), for the soak judged (:class:`~shoal.ops.chaos.kinds.Soak`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shoal.events.keys import (
    CONTROL_MAXLEN,
    DEAD_MAXLEN,
    FAILURES_MAXLEN,
    GENERATIONS_MAXLEN,
    LOGS_MAXLEN,
    PROGRESS_MAXLEN,
)
from shoal.ops.chaos.kinds import UNKNOWN, Injected, Soak, find
from shoal.ops.chaos.sampler import Samples
from shoal.worker import ledger

#: "close to the failure-free run": every tensor within this relative L2 distance. Steps are
#: world-size invariant up to the order of floating-point sums, and the soak trains in float64
#: so that this noise stays tiny: measured 1.3e-14 after 1,400 steps (in float32 it was 5e-5
#: after 1,400 steps and 1.2e-2 after 72,200, compounding through momentum SGD). A skipped or
#: doubled batch (which the ledger check also catches) moves the weights by far more.
REL_L2 = 1e-8
#: bounds: the event stream is trimmed exactly to its pending entries; the others are capped
#: at their XADD MAXLEN ~ (shoal.events.keys), which Redis may overshoot by up to a tenth
STREAM_BOUNDS = {"events": 5_000, **{name: cap + cap // 10 for name, cap in (
    ("control", CONTROL_MAXLEN), ("logs", LOGS_MAXLEN), ("progress", PROGRESS_MAXLEN), ("dead", DEAD_MAXLEN),
    ("failures", FAILURES_MAXLEN), ("generations", GENERATIONS_MAXLEN))}}
MEMORY_BOUND = 256 * 1024 * 1024
#: the longest spell without a fault that still counts as "faults for the whole window": a
#: worker fault waits for the previous one's recovery, but never this long
MAX_QUIET = 30.0


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Verdict:
    checks: list[Check] = field(default_factory=list)
    faults: dict[str, tuple[int, int]] = field(default_factory=dict)  #: kind -> (injected, survived)
    recoveries: list[float] = field(default_factory=list)
    soak: Soak = Soak.LOCAL

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(name, ok, detail))

    def table(self) -> str:
        lines = [f"{'fault':<20} {'injected':>8} {'survived':>8}"]
        for kind in self.soak.kinds:
            n, s = self.faults.get(kind, (0, 0))
            lines.append(f"{kind:<20} {n:>8} {s:>8}")
        lines.append("")
        w = max(len(c.name) for c in self.checks)
        lines += [f"{c.name:<{w}}  {'PASS' if c.ok else 'FAIL'}  {c.detail}" for c in self.checks]
        if self.recoveries:
            r = sorted(self.recoveries)
            lines.append(f"{'recovery after a fault':<{w}}        median {statistics.median(r):.2f} s, worst {r[-1]:.2f} s "
                         f"({self.soak.recovery_figure}; n={len(r)})")
        return "\n".join(lines)

    def summary(self) -> dict:
        """The verdict as plain data (what a soak writes to ``summary.json``)."""
        return {"ok": self.ok,
                "faults": {k: dict(zip(("injected", "survived"), self.faults.get(k, (0, 0)))) for k in self.soak.kinds},
                "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
                "recoveries": sorted(self.recoveries)}


def recovery_times(faults: list[Injected], entries: list[dict], soak: Soak = Soak.LOCAL
                   ) -> tuple[list[float], dict[str, tuple[int, int]]]:
    """Per fault: the first committed step that shows it survived, as its kind declares in
    ``soak`` (:class:`~shoal.ops.chaos.kinds.Recovery`: after the fault or after its heal; in a
    generation newer than the one it hit, or in any). A fault with no such step was not
    survived. The times returned (from the fault, or from its heal) are those of the kinds
    declared ``timed``. A kind the registry does not know is judged as :data:`UNKNOWN` says,
    and not timed."""
    times = sorted((e["t"], e["generation"]) for e in entries)
    out: list[float] = []
    counts: dict[str, list[int]] = {}
    for f in faults:
        n = counts.setdefault(f.kind, [0, 0])
        n[0] += 1
        kind = find(soak, f.kind)
        recovery = kind.recovery if kind is not None else UNKNOWN
        after = next((t for t, g in times if recovery.survived_by(f, t, g)), None)
        if after is not None:
            n[1] += 1
            if kind is not None and kind.timed:
                out.append(after - recovery.since(f))
    return out, {k: (v[0], v[1]) for k, v in counts.items()}


def compare_to_reference(finals: dict[str, dict], reference: dict) -> tuple[bool, bool, str, str]:
    """(all equal, close to reference, detail of each)."""
    states = list(finals.values())
    equal = bool(states) and all(s.keys() == states[0].keys() and all(torch.equal(s[k], states[0][k]) for k in s)
                                 for s in states[1:])
    eq_detail = f"{len(states)} finishing worker(s) bit-identical" if equal else f"{len(states)} finishing workers differ"
    if not states:
        return False, False, "no worker exported its final parameters", "nothing to compare"
    got = states[0]
    if got.keys() != reference.keys():
        return equal, False, eq_detail, "different parameter names"
    diff = max(float((got[k].double() - reference[k].double()).abs().max()) for k in reference)
    rel = max(float((got[k].double() - reference[k].double()).norm() / max(float(reference[k].double().norm()), 1e-12))
              for k in reference)
    return equal, rel <= REL_L2, eq_detail, f"max relative L2 {rel:.1e} (bound {REL_L2:g}), max |diff| {diff:.1e}"


def judge(*, completed: bool, final_step: int, elapsed: float, entries: list[dict], num_samples: int,
          finals: dict[str, dict], reference: dict | None, samples: Samples, faults: list[Injected],
          window: float, duration: float, failed: list[str] | None = None, soak: Soak = Soak.LOCAL) -> Verdict:
    """``failed``: the worker ids of the job's ``failures`` stream (every failure the
    coordinator declared); ``soak``: whose fault kinds ``faults`` are."""
    v = Verdict(soak=soak)
    times = sorted(f.t for f in faults)
    quiet = max((b - a for a, b in zip(times, times[1:])), default=0.0)
    full = window >= duration - 1.0
    v.add("faults for the whole window", full and quiet <= MAX_QUIET,
          f"{window:.1f} s of the {duration:.0f} s asked for"
          + ("" if full else " (the job ended first: give it more --steps)")
          + f"; longest spell without a fault {quiet:.1f} s (bound {MAX_QUIET:.0f} s)")
    v.add("job completed", completed, f"step {final_step}, {elapsed:.1f} s after training started")
    lv = ledger.verify(entries, num_samples)
    v.add("samples exactly once per epoch", lv.ok,
          (f"{lv.steps} steps, {lv.epochs_complete} complete epochs, 0 duplicate commits, "
           f"{lv.partial_commits} partial commits resynced" if lv.ok else lv.problem))
    if reference is None:
        v.add("parameter digests equal", False, "no reference")
    else:
        equal, close, eq_detail, close_detail = compare_to_reference(finals, reference)
        v.add("parameter digests equal", equal, eq_detail)
        v.add("close to a failure-free run", close, close_detail)
    n = samples.latest_ok + len(samples.latest_bad)
    v.add("LATEST valid when sampled", n > 0 and not samples.latest_bad,
          f"{samples.latest_ok}/{n} samples" + (f"; first bad: {samples.latest_bad[0]}" if samples.latest_bad else "")
          + (f"; {samples.skipped} skipped while Redis restarted" if samples.skipped else ""))
    over = {k: x for k, x in samples.max_xlen.items() if x > STREAM_BOUNDS.get(k, 10_000)}
    v.add("Redis memory and streams bounded", samples.max_memory < MEMORY_BOUND and not over,
          f"max used_memory {samples.max_memory / 2**20:.1f} MiB; max XLEN "
          + ", ".join(f"{k} {x}" for k, x in sorted(samples.max_xlen.items())))
    v.recoveries, v.faults = recovery_times(faults, entries, soak)
    lost = sum(n - s for n, s in v.faults.values())
    v.add("every fault survived", bool(faults) and lost == 0, f"{len(faults)} injected, {lost} not survived")
    if failed is not None:
        # a self-healing job hides its own crashes and false evictions: every worker declared
        # failed must be one a fault hit - by a kind that may end it (a slow step may not)
        hit = {f.worker for f in faults if f.worker and _may_fail_worker(soak, f.kind)} | {w for f in faults
                                                                                         for w in f.hits}
        unprovoked = sorted(set(failed) - hit, key=lambda w: (len(w), w))
        v.add("no failure without a fault", not unprovoked,
              f"{len(set(failed))} workers declared failed, each hit by a fault" if not unprovoked else
              f"declared failed without a fault: {', '.join(unprovoked[:10])} (their logs say why)")
    return v


def _may_fail_worker(soak: Soak, name: str) -> bool:
    """Whether the worker a fault of kind ``name`` hit may be declared failed for it (a kind
    the registry does not know: yes)."""
    kind = find(soak, name)
    return kind is None or kind.may_fail_worker


def load_finals(export_dir: Path) -> dict[str, dict]:
    return {f.stem.removeprefix("final-"): torch.load(f, weights_only=True) for f in sorted(export_dir.glob("final-*.pt"))}
