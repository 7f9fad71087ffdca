"""Uneven machines: equal slices against slices sized by speed (``batch_split: by_speed``),
side by side in one run, interleaved and repeated.

    python3 scripts/dev.py python -m bench.uneven [--quick] [--steps 80] [--repeat 2]
                                                 [--quota 0.4] [--slow-quota 0.2] [--trace] [--inline-data]
                                                 [--steal] [--compare-steal]

Three CPU workers (OMP_NUM_THREADS=1 each) train the digits data with a 64-512-512-10 MLP
(0.3 M parameters, float64), a global batch of 14400, SGD with momentum, gradients
all-reduced in buckets of 0.5 MiB (``bucket_cap_mb``: they leave while backward still runs). Each worker runs in a cgroup
(v1 ``cpu`` controller) of its own: two may use ``--quota`` of a core (default 1), the third
is held to ``--slow-quota`` (default: half a core) by a CFS quota over a 20 ms period. The
groups' ``cpu.shares`` follow the quotas (2:2:1; the three together weigh less than one nice-0
process, so they are neither starved nor a burden):
this box has 2 cores shared with other engineers, and when it is contended a quota alone does
not bind (every process gets less than half a core anyway), while the shares still give the
slow worker half the others' CPU. So "half as fast" holds on a quiet box and a busy one.

Each round measures, in this order:

- ``solo=``: the three processes, in their cgroups, at the same time, each training on its own
  (forward, backward, optimizer step on slices of the equal size, no collective) for a few
  seconds: that the cgroups make the third half as fast (2:2:1), for information;
- a job with **equal slices**, then one with **slices by speed**, each from its third committed
  step to its last (the by-speed job's re-slices - switched to in place - included): its
  samples/s, and each worker's **solo rate** in that same run: the samples of its slices over
  the seconds of its own work (data, forward, backward; ``compute`` in the ledger), i.e. how
  fast it goes when it waits for nobody. ``ratio`` = job samples/s over the sum of those.

Why the solo rates come from the job's own run: the load other engineers put on this box
moved a job's throughput 4x between two rounds minutes apart (2026-11-28: 8423 and 2369
samples/s), so a denominator measured at another moment - even just before and after -
made ratios of 0.26 and 1.7. Measured within the run, numerator and denominator share its
load. ``speedup=`` (by speed over equal, consecutive runs) is shown too, with that caveat.

Per job: ``steps_per_s``, ``beyond_slowest_ms`` (the median step beyond its slowest member's
own work: the all-reduce, the update), ``switches_s`` (each generation switch's cost beyond a
median step), ``generations``, ``first_switch_step`` (the first step committed in a newer
generation: how long the job ran on equal slices), ``skew_median``/``skew_max`` (per step, the
slowest member's own work over the mean member's: 1 is a perfect split, the estimate's error
shows here), ``waited_s`` (the window's seconds the others waited for the slowest one's own
work) and ``window_s``.

``--steal``: the by-speed job with ``batch_split_steal: true`` - a member done with its slice
takes chunks of the others' still untaken within the step (:mod:`shoal.worker.steal`).

``--compare-steal``: each round also runs the by-speed job with that balancing, right after the
other (before it in odd rounds): ``ratio_steal=`` and ``steal_gain=`` (its samples/s over the
other's, pair by pair). Read the gain, not the ratio: the in-run rates move with what a worker does in its own work (a
stolen chunk's claim and its read in the thief's training thread count there), so balancing
within the step raises ``ratio`` by turning waiting into slower own work even where it trains
not one sample more a second.

``ratio_solo=`` (and per round ``ratio_solo_*=``): the jobs' samples/s over the sum of the
round's ``solo=`` rates instead (the three alone in their cgroups at the same time, each
reading its own samples inline: the issue's "sum of the workers' solo rates" taken literally).
Sound where the quotas bind (they ask less than the box's cores, e.g. ``--quota 0.75``): the
solo rates are then the quotas', whatever else runs; with 1/1/0.5 on two cores they are what
three processes get of an oversubscribed box at that moment.

``--inline-data``: every batch fetched in the training thread (``loader_workers: 0``,
``prefetch_steps: 0``) instead of by the default forked loader, which shares its worker's cgroup.

Prints ``name=value`` lines: each round's figures, then ``ratio_equal=`` and ``ratio_speed=``
(job samples/s over the sum of the solo rates, median over rounds; target: by speed >= 0.90
where equal slices give about 0.60), ``allclose=`` (the final float64 weights of the last
round's two jobs, which trained the same global batches: equal up to the order of float
additions), and ``loadavg=`` before and after (other engineers' work shares the machine).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent

HIDDEN = 512
BATCH = 14_400
DATASET = 144_000
CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 20_000
SHARES_PER_CORE = 335  # a nice-5 process's weight: the three groups weigh less than one nice-0 process
SKIP = 3  # committed steps left out at the start of each job (its first generation forming)
TRACE = False  # --trace: every step's samples and own work per worker


class _Double(nn.Module):
    """The MLP in float64, fed the dataset's float32 images."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                 nn.Linear(HIDDEN, 10)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.double())


def build():
    """The bench's job (entrypoint ``bench.uneven:build``): float64, so the two jobs' final
    weights compare sharply."""
    from shoal.examples.digits import DigitGlyphs
    from shoal.worker.userapi import TrainingSetup

    torch.manual_seed(0)
    model = _Double()
    return TrainingSetup(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                         dataset=DigitGlyphs(train=True, size=DATASET),
                         loss_fn=lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum"))


def solo(seconds: float, slice_size: int) -> None:
    """(A subprocess, in its cgroup.) Train alone on slices of ``slice_size`` for ``seconds``,
    as a worker's own work does (items fetched one by one, collated, forward, backward, the
    optimizer's step); print the samples/s."""
    from torch.utils.data import default_collate

    torch.set_num_threads(1)
    setup = build()
    model, opt, ds = setup.model, setup.optimizer, setup.dataset
    gen = torch.Generator().manual_seed(os.getpid())

    def one() -> None:
        idx = torch.randint(0, len(ds), (slice_size,), generator=gen).tolist()
        x, y = default_collate([ds[i] for i in idx])
        setup.loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    one()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        one()
        n += slice_size
    print(f"{n / (time.perf_counter() - start):.1f}", flush=True)


class Cgroups:
    """One cgroup v1 ``cpu`` group per worker slot with a CFS quota; removed on close (its
    processes must have ended)."""

    def __init__(self, quotas: list[float]) -> None:
        if not (CGROUP_ROOT / "cgroup.procs").exists():
            raise SystemExit(f"no cgroup v1 cpu controller at {CGROUP_ROOT}: this bench needs one (and root)")
        self.paths: list[Path] = []
        try:
            for i, q in enumerate(quotas):
                p = CGROUP_ROOT / f"shoal-uneven-{os.getpid()}-{i}"
                p.mkdir()
                self.paths.append(p)
                (p / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (p / "cpu.cfs_quota_us").write_text(str(int(q * PERIOD_US)))
                # weight in proportion to the quota: contended, the groups share the CPU 2:2:1
                # too. A cgroup's weight replaces its processes' nice at the top level; at a
                # nice-15 process's weight (36) the workers starved behind other engineers'
                # nice-0 compiles (1 s of CPU in 2 minutes), so the three weigh together a
                # little less than one ordinary process (335 + 335 + 167 < 1024)
                (p / "cpu.shares").write_text(str(max(2, int(q * SHARES_PER_CORE))))
        except BaseException:
            self.close()
            raise

    def put(self, slot: int, pid: int) -> None:
        (self.paths[slot] / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        """Kill what is still in the groups (only this bench's processes are ever put there: a
        solo measurement or a worker left by a failure), then remove them."""
        for p in self.paths:
            for pid in (p / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        while any((p / "cgroup.procs").read_text().strip() for p in self.paths) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in self.paths:
            try:
                p.rmdir()
            except OSError as exc:
                print(f"could not remove cgroup {p}: {exc}", file=sys.stderr)
        self.paths = []


def solo_rates(groups: Cgroups, seconds: float) -> list[float]:
    procs = []
    for slot in range(3):
        p = subprocess.Popen([sys.executable, "-m", "bench.uneven", "--solo", str(seconds), str(BATCH // 3)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        groups.put(slot, p.pid)
        procs.append(p)
    out = []
    for p in procs:
        # a niced process on a box busy with other engineers' compiles can wait minutes
        text, _ = p.communicate(timeout=seconds + 900)
        if p.returncode != 0:
            raise SystemExit(f"a solo measurement failed (exit {p.returncode})")
        out.append(float(text.strip().splitlines()[-1]))
    return out


def run_job(url: str, tmp: Path, groups: Cgroups, job: str, split: str,
            steps: int, spec_extra: dict) -> tuple[float, list[float], dict, list[str]]:
    """One job of three workers in the cgroups (``spec_extra``: more fields of its spec); its
    samples/s from its SKIP-th committed step to its last (commit times from the ledger: the last
    rank's commit of each step), each worker slot's rate of its own work over the same steps (its
    slices' samples over the seconds of its own work, ``compute`` in the ledger), its final weights,
    and the reasons of its generations."""
    import redis

    from shoal.core.jobspec import JobSpec
    from shoal.core.registry import create_job
    from shoal.events.keys import job_keys
    from shoal.events.models import ShardTable
    from shoal.ops.localproc import LocalProcs
    from shoal.worker import ledger
    from tests.helpers import ControlWatcher

    client = redis.Redis.from_url(url)
    create_job(client, JobSpec(name=job, entrypoint="bench.uneven:build", global_batch_size=BATCH, max_steps=steps,
                               epochs=1000, min_workers=3, max_workers=3, heartbeat_interval=0.5, heartbeat_ttl=5.0,
                               batch_split=split, batch_split_every=5, bucket_cap_mb=0.5, **spec_extra))
    watch = ControlWatcher(client, job)
    lg, final = tmp / f"ledger-{job}", tmp / f"final-{job}"
    env = {"SHOAL_LEDGER_DIR": str(lg), "SHOAL_EXPORT_DIR": str(final), "OMP_NUM_THREADS": "1"}
    with LocalProcs(url, tmp / f"logs-{job}", extra_env=env) as procs:
        procs.coordinator(f"coord-{job}")
        pids = []
        for slot in range(3):
            pids.append(procs.worker(job, f"p{slot}").popen.pid)
            groups.put(slot, pids[-1])
        try:
            watch.wait_for(lambda d: d.job_state == "completed", 600)
        except BaseException:
            for p in procs.procs:
                print(f"===== {p.name}\n{p.log_tail(20)}", file=sys.stderr)
            raise
    entries = ledger.read(lg)
    verdict = ledger.verify(entries, DATASET)
    if not verdict.ok:
        raise SystemExit(f"{job}: the ledger is not exactly once: {verdict.problem}")
    done: dict[int, float] = {}
    counts: dict[int, int] = {}
    for e in entries:
        done[e["step"]] = max(done.get(e["step"], 0.0), e["t"])
        counts[e["step"]] = e["count"]
    samples = sum(counts[s] for s in counts if s > SKIP)
    rate = samples / (done[max(done)] - done[SKIP])
    gen = {e["step"]: e["generation"] for e in entries}
    # the generation switches in the window: the gap from the old generation's last commit to
    # the new one's first, less the median step (what the step itself took)
    gaps = sorted(done[s] - done[s - 1] for s in done if s > SKIP + 1)
    step_s = gaps[len(gaps) // 2] if gaps else 0.0
    switches = [done[s] - done[s - 1] - step_s for s in sorted(done) if s > SKIP + 1 and gen[s] != gen[s - 1]]
    # per step: the slowest member's own work, and what the step took beyond it (the
    # all-reduce, the update, bookkeeping: what no split can remove)
    slowest: dict[int, float] = {}
    for e in entries:
        slowest[e["step"]] = max(slowest.get(e["step"], 0.0), e["compute"])
    beyond = sorted(done[s] - done[s - 1] - slowest[s] for s in done if s > SKIP + 1 and gen[s] == gen[s - 1])
    # the split's error, per step: the slowest member's own work over the mean member's (1: a
    # perfect split; equal slices on 2:2:1 machines: about 1.5), and the seconds of the window
    # lost to it (the slowest's own work less the mean's: what the others waited)
    fastest: dict[int, list[float]] = {}
    for e in entries:
        fastest.setdefault(e["step"], []).append(e["compute"])
    window = [s for s in sorted(fastest) if s > SKIP]
    skew = sorted(max(fastest[s]) / (sum(fastest[s]) / len(fastest[s])) for s in window if min(fastest[s]) > 0)
    waited = sum(max(fastest[s]) - sum(fastest[s]) / len(fastest[s]) for s in window)
    first_new = min((s for s in sorted(gen) if gen[s] != gen[min(gen)]), default=0)
    print(f"job={job} steps_per_s={1 / step_s if step_s else 0:.2f} "
          f"beyond_slowest_ms={1000 * beyond[len(beyond) // 2] if beyond else 0:.0f} "
          f"switches_s={','.join(f'{x:.2f}' for x in switches)} generations={len(set(gen.values()))} "
          f"first_switch_step={first_new} skew_median={skew[len(skew) // 2] if skew else 0:.3f} "
          f"skew_max={skew[-1] if skew else 0:.3f} waited_s={waited:.2f} "
          f"window_s={done[max(done)] - done[SKIP]:.2f}")
    if TRACE:  # per step: its generation, the gap since the previous commit, each slot's samples/own work
        by_pid = {p: i for i, p in enumerate(pids)}
        for st in sorted(done):
            row = sorted((by_pid.get(e["pid"], 9), len(e["indices"]), e["compute"], e.get("comm", 0.0))
                         for e in entries if e["step"] == st)
            gap = done[st] - done[st - 1] if st - 1 in done else 0.0
            print(f"trace job={job} step={st} gen={gen[st]} gap={gap:.3f} "
                  + " ".join(f"p{i}:{n}/{c:.3f}/{x:.3f}" for i, n, c, x in row))
    own: dict[int, list[float]] = {}  # pid -> [samples, seconds]
    for e in entries:
        if e["step"] > SKIP:
            acc = own.setdefault(e["pid"], [0, 0.0])
            acc[0] += len(e["indices"])
            acc[1] += e["compute"]
    own_rates = [own[p][0] / own[p][1] if p in own and own[p][1] > 0 else 0.0 for p in pids]
    weights = torch.load(sorted(final.glob("final-*.pt"))[0], weights_only=True)
    reasons = [ShardTable.model_validate_json(f[b"data"]).reason for _s, f in client.xrange(job_keys(job).generations)]
    return rate, own_rates, weights, reasons


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    ap = argparse.ArgumentParser(description="equal slices vs slices by speed, one worker slowed by a CPU quota")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--repeat", type=int, default=2, help="rounds (solo, equal, by speed), interleaved")
    ap.add_argument("--quota", type=float, default=1.0, help="the fast workers' CPU quota, cores")
    ap.add_argument("--slow-quota", type=float, default=None, help="the slow worker's (default: half --quota)")
    ap.add_argument("--solo-seconds", type=float, default=6.0)
    ap.add_argument("--quick", action="store_true", help="40 steps, 2 rounds, 4 s solo")
    ap.add_argument("--solo", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--trace", action="store_true", help="print every step's samples, own work and exposed "
                                                          "all-reduce per worker (samples/own s/comm s)")
    ap.add_argument("--inline-data", action="store_true",
                    help="fetch every batch inline in the training thread (loader_workers 0, prefetch_steps 0) "
                         "instead of the default background loader process")
    ap.add_argument("--steal", action="store_true",
                    help="the by-speed job with batch_split_steal: true (members done with their slice take "
                         "chunks of the others' within the step)")
    ap.add_argument("--compare-steal", action="store_true",
                    help="each round also runs the by-speed job with batch_split_steal: true, right after the "
                         "other (ratio_steal=, steal_gain= its samples/s over the other's)")
    args = ap.parse_args()
    if args.steal and args.compare_steal:
        ap.error("--compare-steal compares the by-speed job without balancing to one with it: drop --steal")
    global TRACE
    TRACE = args.trace
    if args.solo:
        solo(float(args.solo[0]), int(args.solo[1]))
        return 0
    if args.quick:
        args.steps, args.repeat, args.solo_seconds = 40, 2, 4.0
    slow = args.slow_quota if args.slow_quota is not None else args.quota / 2
    os.environ["OMP_NUM_THREADS"] = "1"
    from shoal.ops.embedded import start_server

    print(f"loadavg_before={loadavg()}")
    print(f"setup=3 workers, cgroup v1 cpu quotas {args.quota:g}/{args.quota:g}/{slow:g} cores (period "
          f"{PERIOD_US // 1000} ms), batch {BATCH}, MLP 64-{HIDDEN}-{HIDDEN}-10 float64, {os.cpu_count()} cores"
          f"{', batches fetched inline' if args.inline_data else ''}"
          f"{', by speed balanced within the step' if args.steal else ''}")
    # --inline-data: the job spec's input pipeline fields
    inline = dict(loader_workers=0, prefetch_steps=0) if args.inline_data else {}
    steal = dict(batch_split_steal=True) if args.steal else {}
    groups = Cgroups([args.quota, args.quota, slow])
    equal_r, speed_r, finals = [], [], None
    steal_r, gains, solo_r = [], [], []  # --compare-steal; job samples/s over the sum of solo=
    try:
        with tempfile.TemporaryDirectory(prefix="shoal-uneven-") as t:
            tmp = Path(t)
            server = start_server(tmp / "redis", appendonly=False)
            try:
                for i in range(args.repeat):
                    alone = solo_rates(groups, args.solo_seconds)
                    eq, eq_own, eq_w, _ = run_job(server.url, tmp, groups, f"equal-{i}", "equal", args.steps, inline)

                    def with_steal():
                        return run_job(server.url, tmp, groups, f"steal-{i}", "by_speed", args.steps,
                                       {**inline, "batch_split_steal": True})

                    # --compare-steal: the two by-speed jobs in alternating order (a drift within a
                    # round then favours neither)
                    stolen = with_steal() if args.compare_steal and i % 2 else None
                    sp, sp_own, sp_w, reasons = run_job(server.url, tmp, groups, f"speed-{i}", "by_speed", args.steps,
                                                        {**inline, **steal})
                    if args.compare_steal and stolen is None:
                        stolen = with_steal()
                    equal_r.append(eq / sum(eq_own))
                    speed_r.append(sp / sum(sp_own))
                    finals = (eq_w, sp_w)
                    solo_r.append((eq / sum(alone), sp / sum(alone)))
                    print(f"round={i} ratio_solo_equal={eq / sum(alone):.3f} ratio_solo_speed={sp / sum(alone):.3f}")
                    if stolen is not None:
                        st, st_own, _w, _r = stolen
                        steal_r.append(st / sum(st_own))
                        gains.append(st / sp)
                        print(f"round={i} by_speed_steal={st:.0f} steal_own={'/'.join(f'{r:.0f}' for r in st_own)} "
                              f"ratio_steal={st / sum(st_own):.3f} ratio_solo_steal={st / sum(alone):.3f} "
                              f"steal_gain={st / sp:.3f}")
                    print(f"round={i} solo={'/'.join(f'{r:.0f}' for r in alone)} "
                          f"equal={eq:.0f} equal_own={'/'.join(f'{r:.0f}' for r in eq_own)} "
                          f"by_speed={sp:.0f} by_speed_own={'/'.join(f'{r:.0f}' for r in sp_own)} "
                          f"ratio_equal={eq / sum(eq_own):.3f} ratio_speed={sp / sum(sp_own):.3f} "
                          f"speedup={sp / eq:.3f} loadavg={loadavg()}")
                    replans = [r for r in reasons if "slices by speed" in r]
                    print(f"round={i} by_speed_generations={len(reasons)} last_plan={replans[-1] if replans else ''!r}")
            finally:
                server.stop()
    finally:
        groups.close()
    eq_w, sp_w = finals
    diff = max((eq_w[k] - sp_w[k]).abs().max().item() for k in eq_w)
    close = all(torch.allclose(eq_w[k], sp_w[k], rtol=1e-9, atol=1e-10) for k in eq_w)
    print(f"ratio_equal={statistics.median(equal_r):.3f}")
    print(f"ratio_speed={statistics.median(speed_r):.3f}")
    print(f"ratio=equal:{statistics.median(equal_r):.3f},by_speed:{statistics.median(speed_r):.3f}")
    print(f"ratio_solo=equal:{statistics.median(e for e, _ in solo_r):.3f},"
          f"by_speed:{statistics.median(b for _, b in solo_r):.3f}")
    if gains:
        print(f"ratio_steal={statistics.median(steal_r):.3f}")
        print(f"steal_gain={statistics.median(gains):.3f}")
    print(f"allclose={close}")
    print(f"max_weight_diff={diff:.3g}")
    print(f"loadavg_after={loadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
