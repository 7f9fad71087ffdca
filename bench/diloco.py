"""DiLoCo (``sync: diloco``) against shoal's synchronous data parallelism, in one run.

    python3 scripts/dev.py python -m bench.diloco [--quick] [--epochs 2] [--repeat 2]

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
  example's small MLP for ``--loss-epochs`` epochs (12 with ``--quick``: 19 outer steps at H=50);
- ``recovery=``: seconds from ``kill -9`` of one of three members in the middle of a round to
  the survivors' next outer step (the digits MLP with 0.05 s per inner step, H=10, heartbeat
  TTL 1 s); with ``lost_inner_steps=`` (the survivors' inner steps of that round trained again:
  0 when their finished work was kept) and ``exactly_once=`` from the ledgers;
- ``link=``: the link the figures were taken on (``loopback``; a rate-limited link between
  network namespaces is the harness's, issue 38 item 8).
"""

from __future__ import annotations

import argparse
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


def build() -> TrainingSetup:
    """The bench's entrypoint (``bench.diloco:build``)."""
    model = make_model()
    return TrainingSetup(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                         dataset=DigitGlyphs(train=True),
                         loss_fn=lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum"))


def build_small() -> TrainingSetup:
    """The loss comparison's entrypoint (``bench.diloco:build_small``): the digits example's
    MLP (64-128-64-10) with AdamW, cheap enough to train for tens of outer steps."""
    torch.manual_seed(0)
    model = make_small_model()
    return TrainingSetup(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                         dataset=DigitGlyphs(train=True),
                         loss_fn=lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum"))


def make_small_model() -> nn.Module:
    torch.manual_seed(0)
    return digits_model()


def test_loss(path: Path, make=make_model) -> float:
    """The mean cross-entropy of the weights at ``path`` on the 1000 test digits."""
    model = make()
    model.load_state_dict(torch.load(path, weights_only=True))
    data = DigitGlyphs(train=False)
    x = torch.stack([data[i][0] for i in range(len(data))])
    y = torch.stack([torch.as_tensor(data[i][1]) for i in range(len(data))])
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x), y))


def _spec(job: str, epochs: int, h: int | None, entrypoint: str = "bench.diloco:build", **kw) -> JobSpec:
    sync = dict(sync="diloco", diloco={"inner_steps": h}) if h else {}
    return JobSpec(**(dict(name=job, entrypoint=entrypoint, global_batch_size=BATCH, epochs=epochs,
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
            "comm": statistics.median(e["comm"] for e in steady), "loss": test_loss(finals[0], make),
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


def main() -> int:
    ap = argparse.ArgumentParser(description="DiLoCo vs synchronous data parallelism")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="interleaved rounds of the throughput runs")
    ap.add_argument("--loss-epochs", type=int, default=20, help="epochs of the loss comparison")
    ap.add_argument("--quick", action="store_true", help="2 epochs, 1 round")
    ap.add_argument("--recovery-only", action="store_true", help="only the kill -9 run")
    ap.add_argument("--loss-only", action="store_true", help="only the loss comparison")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="the loss comparison's outer learning rate")
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="the loss comparison's outer momentum")
    args = ap.parse_args()
    if args.quick:
        args.epochs, args.repeat, args.loss_epochs = 2, 1, 12
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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
    print(f"  test loss after {args.loss_epochs} epochs of the digits example's MLP (equal samples; outer lr "
          f"{args.outer_lr}, momentum {args.outer_momentum}): " + ", ".join(f"{n} {v:.4f}" for n, v in loss.items()))
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
