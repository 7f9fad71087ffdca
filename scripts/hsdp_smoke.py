#!/usr/bin/env python3
"""Elastic HSDP's engine on one GPU (the GPU check's ``hsdp`` part): 3 processes share the GPU,
each its own replica group of shard_size 1 - a 1-rank NCCL shard group made by shoal's
``Rendezvous.join``, FSDP2 over it (``ShardedEngine.shard``) - and one gloo cross-replica group over
the 3 (``Rendezvous.standalone``) carrying the CUDA gradient shards from FSDP's all-reduce hook.
After 8 steps of a global batch of 48 digits the 3 replicas must be bit-identical and allclose
to one process training the plain model on the same global batches.

    python3 scripts/hsdp_smoke.py            # on a GPU machine (NCCL inside, gloo across)
    python3 scripts/hsdp_smoke.py --cpu      # the same on CPU (gloo inside), for a dry run

Prints one line: ``hsdp-smoke: replicas identical, max |diff| to one process X`` and exits 0,
or the failure and exits 1. Multi-GPU shard groups (shard_size > 1 on NCCL) were not run on
the machines shoal was built on: they need a GPU per member.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPLICAS, BATCH, STEPS = 3, 48, 8


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _setup(device: str):
    from shoal.examples.digits import DigitGlyphs
    from shoal.worker.userapi import TrainingSetup

    model = _model()
    return TrainingSetup(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
                         dataset=DigitGlyphs(train=True),
                         loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="sum"))


def _member(replica: int, url: str, device: str, out: str) -> None:
    import redis

    import shoal.worker.process_group as pg
    from shoal.worker.sharded_engine import ShardedEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    client = redis.Redis.from_url(url)
    dev = torch.device(device)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    rendezvous = pg.Rendezvous(client, "smoke", backend=backend)
    shard_group = rendezvous.join(1, 0, 1, 60.0, device=dev, prefix=f"smoke:replica{replica}")
    engine = ShardedEngine.from_setup(_setup(device), device=dev)
    engine.shard(shard_group)
    cross = rendezvous.standalone("smoke:cross", replica, REPLICAS, 60.0, generation=1, device=dev,
                                  name="the cross-replica group")
    engine.set_cross(cross)
    per = BATCH // REPLICAS
    for step in range(STEPS):
        engine.step(range(step * BATCH + replica * per, step * BATCH + (replica + 1) * per), BATCH, 1,
                    world_size=REPLICAS)
    torch.save({k: v.cpu() for k, v in engine.full_state_dict().items()}, f"{out}/replica{replica}.pt")
    # leave as a worker does (TrainingWorker.cleanup): a process that exits with its NCCL group
    # and the gloo group alive can die of SIGSEGV in the interpreter's teardown (seen on an
    # H200: 2 runs in 6, after every member had saved)
    engine.set_cross(None)
    cross.close()
    rendezvous.close_joined()


def _one_process(device: str) -> dict[str, torch.Tensor]:
    setup = _setup(device)
    model, opt = setup.model.to(device), setup.optimizer
    for step in range(STEPS):
        xs, ys = zip(*(setup.dataset[i] for i in range(step * BATCH, (step + 1) * BATCH)))
        loss = setup.loss_fn(model(torch.stack(xs).to(device)), torch.as_tensor(ys).to(device)) / BATCH
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="gloo inside too, model on the CPU")
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("hsdp-smoke: no CUDA device (use --cpu for a dry run)")
        return 1
    from shoal.ops.embedded import start_server

    with tempfile.TemporaryDirectory(prefix="shoal-hsdp-smoke-") as tmp:
        server = start_server(Path(tmp) / "redis", appendonly=False)
        try:
            mp.start_processes(_member, args=(server.url, device, tmp), nprocs=REPLICAS, start_method="spawn")
        finally:
            server.stop()
        finals = [torch.load(f"{tmp}/replica{r}.pt", weights_only=True) for r in range(REPLICAS)]
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = _one_process(device)
    identical = all(torch.equal(f[k], finals[0][k]) for f in finals for k in f)
    diff = max((finals[0][k].double() - reference[k].double()).abs().max().item() for k in reference)
    ok = identical and diff < 1e-4
    print(f"hsdp-smoke: {REPLICAS} replica groups of shard_size 1 on {device} "
          f"({'NCCL' if device == 'cuda' else 'gloo'} inside, gloo across): replicas "
          f"{'identical' if identical else 'DIFFER'}, max |diff| to one process {diff:.2e}"
          f"{'' if ok else ' (FAIL)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
