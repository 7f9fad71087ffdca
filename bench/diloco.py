"""DiLoCo (``sync: diloco``) against shoal's synchronous data parallelism, in one run.

    python3 scripts/dev.py python -m bench.diloco [--quick] [--epochs 2] [--repeat 2]
    python3 scripts/dev.py python -m bench.diloco --link 100,50     (root: network namespaces)

The model: the digits data with a 64-2400-2400-10 MLP (5.9 M parameters, a 24 MB fp32
gradient: communication weighs), AdamW (lr 1e-3) as the (inner) optimizer, global batch 64,
2 worker processes (OMP_NUM_THREADS=1), one Redis. Every run trains the same samples in the
same order (``--epochs`` of the 5000 digits); the runs are interleaved A/B ``--repeat`` times.
Prints ``name=value``:

- ``speedup=``: samples/s of DiLoCo with H=50 over synchronous data parallelism's (steady state,
  from the ledgers' commit times; this machine's loopback, **not** a slow link: see
  ``link=``);
- ``utilisation=``: DiLoCo H=50's compute over its round time (compute + exposed outer
  exchange, medians of the ledgers' per-round figures);
- ``loss_gap_h25=``, ``loss_gap_h50=``: the test-set loss of the final weights at equal samples,
  DiLoCo over synchronous data parallelism, minus 1 (+0.03 = 3 % worse), on the digits
  example's small MLP for ``--loss-epochs`` epochs (default 60: 120 outer steps at H=50; 30
  with ``--quick``), AdamW at peak lr 1e-3 under the same warm-up + cosine schedule on both
  sides (over the synchronous run's steps; a member's inner steps follow it), with the outer
  ``--outer-lr`` / ``--outer-momentum`` (default the paper's 0.7 / 0.9);
- ``recovery=``: seconds from ``kill -9`` of one of three members in the middle of a round to
  the survivors' next outer step (the digits MLP with 0.05 s per inner step, H=10, heartbeat
  TTL 1 s); with ``lost_inner_steps=`` (the survivors' inner steps of that round trained again:
  0 when their finished work was kept) and ``exactly_once=`` from the ledgers;
- ``link=``: the link the figures were taken on (``loopback``).

``--link RATE_MBIT,DELAY_MS`` (root): the throughput figures across network namespaces
(:class:`shoal.ops.chaos.netns.Net`): two worker hosts whose links are paced to RATE_MBIT each
way (TBF) and delayed DELAY_MS / 2 each (so DELAY_MS one way between the workers), Redis and
the coordinator on hosts of their own; the link is measured worker to worker first and a link
that misses 80 % of its rate refuses the run. ``--link-sync-steps`` synchronous steps, then
``--link-rounds`` DiLoCo rounds of ``--h`` inner steps (``--outer-dtype`` on the wire), the
5.9 M-parameter MLP at global batch ``--batch`` (default 64; it sets an inner step's compute
against the link's exchange: 1024 gives ~0.2 s an inner step, the issue's regime), on a
training set of two whole rounds (2 x H x batch digits: an epoch's end would cut a round
short); prints ``link=``,
``speedup=``, ``utilisation=``, ``sync_utilisation=``, ``exactly_once=``, ``false_evictions=`` (members
the coordinator declared failed in either run: nothing is injected, so every one is false). Every namespace is
deleted at the end, also on failure or SIGTERM. ``--no-idle-slow-start`` sets the worker hosts'
``net.ipv4.tcp_slow_start_after_idle`` to 0 (measured: no effect on the exchange here).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import redis
import torch
from torch import nn

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.examples.digits import DigitGlyphs
from shoal.examples.digits import make_model as digits_model
from shoal.ops.embedded import start_server
from shoal.ops.localproc import LocalProcs
from shoal.worker import ledger
from shoal.worker.userapi import TrainingSetup
from tests.helpers import ControlWatcher, wait_until

HIDDEN = 2400
BATCH = 64
WORKERS = 2
DIGITS = 5000


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, 10))


#: the throughput runs' training set size (``--link``: whole rounds per epoch), read by
#: :func:`build` in the worker processes; the 5000 digits without it
DATASET_ENV = "SHOAL_BENCH_DILOCO_SIZE"


def build() -> TrainingSetup:
    """The bench's entrypoint (``bench.diloco:build``)."""
    model = make_model()
    return TrainingSetup(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                         dataset=DigitGlyphs(train=True, size=int(os.environ.get(DATASET_ENV, "0")) or None),
                         loss_fn=lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum"))


#: the loss comparison's inner steps per member (= the synchronous run's steps: equal samples,
#: equal steps), read by :func:`build_small` in the worker processes
LOSS_STEPS_ENV = "SHOAL_BENCH_DILOCO_STEPS"


def warmup_cosine(optimizer, total: int, warmup: float = 0.05):
    """Linear warm-up over ``warmup`` of ``total`` steps, then a cosine decay to 0 at ``total``
    (the inner schedule of the DiLoCo paper; the same on both sides of the comparison: it
    steps once per synchronous step and once per inner step)."""
    w = max(1, int(total * warmup))

    def factor(s: int) -> float:
        if s < w:
            return (s + 1) / w
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - w) / max(1, total - w))))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_small() -> TrainingSetup:
    """The loss comparison's entrypoint (``bench.diloco:build_small``): the digits example's
    MLP (64-128-64-10) with AdamW (peak lr 1e-3) under :func:`warmup_cosine` over the run's
    steps (``SHOAL_BENCH_DILOCO_STEPS``; a constant lr without it)."""
    torch.manual_seed(0)
    model = make_small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    total = int(os.environ.get(LOSS_STEPS_ENV, "0"))
    return TrainingSetup(model=model, optimizer=opt, dataset=DigitGlyphs(train=True),
                         lr_scheduler=warmup_cosine(opt, total) if total else None,
                         loss_fn=lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum"))


def make_small_model() -> nn.Module:
    torch.manual_seed(0)
    return digits_model()


def test_loss(path: Path, make=make_model) -> tuple[float, float]:
    """The mean cross-entropy and the accuracy of the weights at ``path`` on the 1000 test digits."""
    model = make()
    model.load_state_dict(torch.load(path, weights_only=True))
    data = DigitGlyphs(train=False)
    x = torch.stack([data[i][0] for i in range(len(data))])
    y = torch.stack([torch.as_tensor(data[i][1]) for i in range(len(data))])
    with torch.no_grad():
        out = model(x)
        return float(nn.functional.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


def _spec(job: str, epochs: int, h: int | None, entrypoint: str = "bench.diloco:build", batch: int = BATCH,
          **kw) -> JobSpec:
    sync = dict(sync="diloco", diloco={"inner_steps": h}) if h else {}
    return JobSpec(**(dict(name=job, entrypoint=entrypoint, global_batch_size=batch, epochs=epochs,
                           min_workers=WORKERS, max_workers=WORKERS, heartbeat_interval=0.2, heartbeat_ttl=2.0,
                           step_timeout=600, loader_workers=0, prefetch_steps=0) | sync | kw))


def run(url: str, tmp: Path, job: str, spec: JobSpec, workers: int, make=make_model) -> dict:
    """Run ``spec`` on ``workers`` workers to completion: samples/s, medians of compute and
    exposed communication per step, the test loss of the final weights."""
    client = redis.Redis.from_url(url)
    create_job(client, spec)
    watch = ControlWatcher(client, job)
    lg, export = tmp / f"ledger-{job}", tmp / f"export-{job}"
    env = {"SHOAL_LEDGER_DIR": str(lg), "SHOAL_EXPORT_DIR": str(export)}
    with LocalProcs(url, tmp / f"logs-{job}", extra_env=env) as procs:
        procs.coordinator(f"coord-{job}")
        for i in range(workers):
            procs.worker(job, f"w{i}")
        watch.wait_for(lambda d: d.job_state == "completed", 1800)
    entries = ledger.read(lg)
    verdict = ledger.verify(entries, DIGITS)
    first = min(e["worker"] for e in entries)
    mine = sorted((e for e in entries if e["worker"] == first), key=lambda e: e["t"])
    steady = mine[1:] if len(mine) > 2 else mine  # from the first commit: the start-up left out
    samples = sum(e["count"] for e in steady[1:])
    rate = samples / (steady[-1]["t"] - steady[0]["t"])
    finals = sorted(export.glob("final-*.pt"))
    return {"rate": rate, "compute": statistics.median(e["compute"] for e in steady),
            "comm": statistics.median(e["comm"] for e in steady), "loss": test_loss(finals[0], make)[0],
            "accuracy": test_loss(finals[0], make)[1],
            "exactly_once": verdict.ok, "steps": verdict.steps}


def run_recovery(url: str, tmp: Path) -> dict:
    """Three members, H=10; kill -9 one of them in the middle of round 3."""
    client = redis.Redis.from_url(url)
    job, h, batch = "diloco-kill", 10, 48
    spec = JobSpec(name=job, entrypoint="tests.entrypoints:diloco_digits", global_batch_size=batch, max_steps=12,
                   sync="diloco", diloco={"inner_steps": h}, min_workers=2, max_workers=3, heartbeat_interval=0.2,
                   heartbeat_ttl=1.0, loader_workers=0, prefetch_steps=0)
    create_job(client, spec)
    watch = ControlWatcher(client, job)
    lg = tmp / "ledger-kill"
    env = {"SHOAL_LEDGER_DIR": str(lg), "SHOAL_TEST_STEP_DELAY": "0.05"}
    with LocalProcs(url, tmp / "logs-kill", extra_env=env) as procs:
        procs.coordinator("coord-kill")
        ws = [procs.worker(job, f"w{i}") for i in range(3)]
        watch.wait_for(lambda d: d.world_size == 3, 120)

        def first_full() -> int:  # the first round committed by all three (two may start alone)
            by_step: dict[int, set[int]] = {}
            for e in ledger.read(lg) if lg.exists() else []:
                by_step.setdefault(e["step"], set()).add(e["pid"])
            return min((s for s, pids in by_step.items() if len(pids) == 3), default=0)

        full = wait_until(first_full, 300, "a round committed by all three members")
        killed_at = time.time()
        os.kill(ws[2].pid, signal.SIGKILL)  # inside round full + 1's inner steps
        watch.wait_for(lambda d: d.job_state == "completed", 300)
    entries = ledger.read(lg)
    redone = [e for e in entries if e["step"] == full + 1]
    round_samples = h * batch
    thirds = [set(redone[0]["batch"][k * round_samples // 3:(k + 1) * round_samples // 3]) for k in range(3)]
    # a survivor whose own third is in its redone round kept its inner steps; one that trained
    # only a half of the batch from scratch lost them (its own third's inner steps, h of them)
    lost = sum(0 if any(t <= set(e["indices"]) for t in thirds) else h for e in redone)
    return {"recovery": min(e["t"] for e in redone) - killed_at, "lost": lost,
            "exactly_once": ledger.verify(entries, DIGITS).ok and ws[2].pid not in {e["pid"] for e in redone}}


def run_net(net, tmp: Path, job: str, spec: JobSpec, hosts: list, size: int = DIGITS) -> dict:
    """Run ``spec`` to completion with its coordinator on ``net``'s host ``coord`` and one
    worker on each of ``hosts``: samples/s and the medians of compute and exposed
    communication per step (round), from the ledgers (as :func:`run`)."""
    client = net.client()
    create_job(client, spec)
    watch = ControlWatcher(client, job)
    lg = tmp / f"ledger-{job}"
    env = {"SHOAL_LEDGER_DIR": str(lg), "SHOAL_HOME": str(tmp / f"home-{job}"), DATASET_ENV: str(size)}
    procs = [net.hosts["coord"].shoal(f"coord-{job}", "coordinator", "--id", f"coord-{job}", "--no-launcher", env=env)]
    procs += [h.shoal(f"{job}-{h.name}", "worker", job, env=env) for h in hosts]
    try:
        end = watch.wait_for(lambda d: d.job_state in ("completed", "failed"), 1200)
        if end.job_state != "completed":
            raise RuntimeError(f"{job} {end.job_state}: {end.reason}\n{net.dump()}")
    finally:
        for p in procs:  # this job's processes only: the network stays for the next job
            p.signal(signal.SIGTERM)
        for p in procs:
            if p.wait(20) is None:
                p.signal(signal.SIGKILL)
                p.wait(10)
    entries = ledger.read(lg)
    first = min(e["worker"] for e in entries)
    mine = sorted((e for e in entries if e["worker"] == first), key=lambda e: e["t"])
    steady = mine[1:] if len(mine) > 2 else mine
    samples = sum(e["count"] for e in steady[1:])
    return {"rate": samples / (steady[-1]["t"] - steady[0]["t"]),
            "compute": statistics.median(e["compute"] for e in steady),
            "comm": statistics.median(e["comm"] for e in steady), "steps": len(mine),
            "exactly_once": ledger.verify(entries, size).ok,
            # nothing is injected here: every member the coordinator declared failed is a false one
            "false_evictions": sum(len(d.removed_by(failure=True)) for d in watch.seen)}


def main_link(args) -> int:
    """``--link RATE_MBIT,DELAY_MS``: synchronous data parallelism, then DiLoCo H=``--h``, on
    two worker hosts (network namespaces) whose links are paced to RATE_MBIT each way and
    delayed DELAY_MS / 2 each (DELAY_MS one way between the two workers); Redis and the
    coordinator on hosts of their own. The link is measured first (``Net.check_link``, worker
    to worker): a link that does not carry 80 % of the rate refuses the run."""
    from shoal.ops.chaos.netns import LinkCheckFailed, Net, NetUnavailable
    from tests.helpers import ROOT

    mbit, delay = (float(x) for x in args.link.split(","))
    signal.signal(signal.SIGTERM, lambda signum, _f: (_ for _ in ()).throw(SystemExit(128 + signum)))
    with tempfile.TemporaryDirectory(prefix="shoal-diloco-link-") as t:
        tmp = Path(t)
        try:
            net = Net(tmp / "net", cwd=ROOT)
        except NetUnavailable as exc:
            print(f"link: network namespaces cannot be made here: {exc}")
            return 2
        with net:
            net.start_redis(net.add_host("redis"))
            net.add_host("coord")
            ws = [net.add_host("w0"), net.add_host("w1")]
            for w in ws:
                net.set_link(w, mbit, delay / 2)
                if args.no_idle_slow_start:  # a host setting (per network namespace), not shoal's
                    w.exec("sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0")
            try:
                got = net.check_link(ws[0], ws[1], mbit, seconds=4.0, warm=2.0)
            except LinkCheckFailed as exc:
                print(f"link: {exc}")
                return 3
            print(f"link check w0 -> w1: {got:.1f} Mbit/s (set {mbit:g} Mbit/s, {delay:g} ms one way)", flush=True)
            # two whole rounds an epoch: an epoch's end cuts a round short (fewer inner steps, the
            # same exchange), and with the 5000 digits every other round of 50 x 64 was one
            size = 2 * args.h * args.batch
            res = {}
            for name, h, steps in (("sync", None, args.link_sync_steps), (f"h{args.h}", args.h, args.link_rounds)):
                job = f"diloco-link-{name}"
                extra = {"diloco": {"inner_steps": h, "outer_dtype": args.outer_dtype}} if h else {}
                res[name] = run_net(net, tmp, job, _spec(job, 1000, h, batch=args.batch, max_steps=steps, **extra), ws,
                                    size)
                r = res[name]
                print(f"  {name}: {r['steps']} steps, {r['rate']:.1f} samples/s, compute {r['compute']:.3f} s + exposed "
                      f"comm {r['comm']:.3f} s per step (a step: a round with DiLoCo)", flush=True)
    d, s = res[f"h{args.h}"], res["sync"]
    print(f"link={mbit:g}mbit,{delay:g}ms outer_dtype={args.outer_dtype} batch={args.batch} dataset={size}"
          f"{' tcp_slow_start_after_idle=0' if args.no_idle_slow_start else ''}")
    print(f"speedup={d['rate'] / s['rate']:.2f}")
    print(f"utilisation={d['compute'] / (d['compute'] + d['comm']):.3f}")
    print(f"sync_utilisation={s['compute'] / (s['compute'] + s['comm']):.3f}")
    print(f"exactly_once={d['exactly_once'] and s['exactly_once']}")
    print(f"false_evictions={d['false_evictions'] + s['false_evictions']}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description="DiLoCo vs synchronous data parallelism")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="interleaved rounds of the throughput runs")
    ap.add_argument("--loss-epochs", type=int, default=60, help="epochs of the loss comparison")
    ap.add_argument("--quick", action="store_true", help="2 epochs, 1 round")
    ap.add_argument("--recovery-only", action="store_true", help="only the kill -9 run")
    ap.add_argument("--loss-only", action="store_true", help="only the loss comparison")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="the loss comparison's outer learning rate")
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="the loss comparison's outer momentum")
    ap.add_argument("--link", metavar="RATE_MBIT,DELAY_MS",
                    help="throughput across network namespaces through a link of that rate and one-way delay")
    ap.add_argument("--h", type=int, default=50, help="--link: DiLoCo's inner steps")
    ap.add_argument("--link-sync-steps", type=int, default=12, help="--link: synchronous steps")
    ap.add_argument("--link-rounds", type=int, default=5, help="--link: DiLoCo rounds")
    ap.add_argument("--batch", type=int, default=BATCH,
                    help="--link: the global batch (both jobs): sets a step's compute against the link's exchange")
    ap.add_argument("--no-idle-slow-start", action="store_true",
                    help="--link: set net.ipv4.tcp_slow_start_after_idle=0 in the worker hosts (Linux's default 1 "
                         "restarts TCP slow start on a connection idle for one RTO: every outer exchange, after a "
                         "round of inner steps, starts from a small window)")
    ap.add_argument("--outer-dtype", choices=("fp32", "bf16", "int8"), default="fp32",
                    help="--link: DiLoCo's outer gradient on the wire")
    args = ap.parse_args()
    if args.link:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        return main_link(args)
    if args.quick:
        args.epochs, args.repeat, args.loss_epochs = 2, 1, 30
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the loss runs' schedule spans the synchronous run's steps (the workers inherit it)
    os.environ[LOSS_STEPS_ENV] = str(args.loss_epochs * -(-DIGITS // BATCH))
    runs: dict[str, list[dict]] = {"sync": [], "h50": []}
    losses: dict[str, list[dict]] = {"sync": [], "h25": [], "h50": []}
    with tempfile.TemporaryDirectory(prefix="shoal-diloco-bench-") as t:
        tmp = Path(t)
        server = start_server(tmp / "redis", appendonly=False)
        try:
            for i in range(0 if args.recovery_only or args.loss_only else args.repeat):  # interleaved: a drift hits every variant
                for name, h in (("sync", None), ("h50", 50)):
                    job = f"diloco-{name}-{i}"
                    runs[name].append(run(server.url, tmp, job, _spec(job, args.epochs, h), WORKERS))
            for name, h in () if args.recovery_only else (("sync", None), ("h25", 25), ("h50", 50)):
                job = f"diloco-loss-{name}"
                outer = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
                spec = _spec(job, args.loss_epochs, h, entrypoint="bench.diloco:build_small",
                             **({"diloco": {"inner_steps": h, **outer}} if h else {}))
                losses[name].append(run(server.url, tmp, job, spec, WORKERS, make=make_small_model))
            if not args.recovery_only:
                report(args, runs, losses)
            if args.loss_only:
                return 0
            rec = run_recovery(server.url, tmp)
        finally:
            server.stop()
    print(f"recovery={rec['recovery']:.2f}")
    print(f"lost_inner_steps={rec['lost']}")
    print(f"exactly_once={rec['exactly_once'] and all(r['exactly_once'] for rs in [*runs.values(), *losses.values()] for r in rs)}")
    return 0


def report(args, runs: dict, losses: dict) -> None:
    """Print the throughput and loss figures (before the recovery run: a failure there keeps them)."""
    loss = {name: rs[0]["loss"] for name, rs in losses.items()}
    print(f"  test loss (accuracy) after {args.loss_epochs} epochs of the digits example's MLP (equal samples, "
          f"AdamW, warm-up + cosine over {os.environ[LOSS_STEPS_ENV]} steps on both sides; outer lr {args.outer_lr}, "
          f"momentum {args.outer_momentum}): "
          + ", ".join(f"{n} {rs[0]['loss']:.4f} ({rs[0]['accuracy']:.3f}, {rs[0]['steps']} steps)"
                      for n, rs in losses.items()))
    print(f"loss_gap_h25={loss['h25'] / loss['sync'] - 1:+.4f}")
    print(f"loss_gap_h50={loss['h50'] / loss['sync'] - 1:+.4f}", flush=True)
    if not runs["sync"]:
        return
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("rate", "compute", "comm", "loss")}
           for name, rs in runs.items()}
    h50 = med["h50"]
    print(f"\nshoal DiLoCo bench: {WORKERS} CPU processes, 5.9 M-parameter MLP, batch {BATCH}, {args.epochs} epoch(s) "
          f"of the digits, {os.cpu_count()} cores, repeat {args.repeat}")
    for name, m in med.items():
        print(f"  {name}: {m['rate']:.0f} samples/s, compute {m['compute']:.3f} s + exposed comm {m['comm']:.3f} s "
              f"per step (a step: a round with DiLoCo)")
    print("link=loopback")
    print(f"speedup={h50['rate'] / med['sync']['rate']:.2f}")
    print(f"utilisation={h50['compute'] / (h50['compute'] + h50['comm']):.3f}")
    print(f"sync_utilisation={med['sync']['compute'] / (med['sync']['compute'] + med['sync']['comm']):.3f}",
          flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
