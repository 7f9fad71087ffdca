"""Plain torchrun + DDP training for a fixed number of steps; prints JSON with the wall time of
every step after the first (for the side-by-side comparison).

    torchrun --standalone --nproc_per_node=2 -m bench.ddp_baseline --steps 200 --batch 64   (from the repository root)

By default it trains bench.models (the digits MLP) with an in-process loader. With
``--entrypoint module:function`` it trains the same ``TrainingSetup`` a shoal job would
(model, optimizer, LR scheduler, dataset, collate function; its summed loss divided by the
local batch, which DDP's gradient averaging turns into the global mean), seeded like shoal
seeds it, through a ``DataLoader`` with ``--loader-workers`` worker processes and
``--prefetch-factor`` batches each (persistent across epochs). With NCCL each rank uses
``cuda:LOCAL_RANK``, pinned memory and non-blocking copies.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, default_collate

from bench.models import make_model, make_optimizer
from shoal.examples.digits import DigitGlyphs

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _to(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


def _batch_len(batch) -> int:
    """Samples in a collated batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if not isinstance(batch, (list, tuple, dict)):
        return 0
    for part in batch.values() if isinstance(batch, dict) else batch:
        n = _batch_len(part)
        if n:
            return n
    return 0


def _digits(args):
    torch.manual_seed(0)
    model = make_model()
    return model, make_optimizer(model), None, DigitGlyphs(train=True), None, None, None


def _from_setup(args):
    from shoal.worker.userapi import load_entrypoint

    s = load_entrypoint(args.entrypoint, 0)  # seeds every RNG first, as a shoal worker does
    return s.model, s.optimizer, s.lr_scheduler, s.dataset, s.collate_fn, s.loss_fn, s.step_fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    ap.add_argument("--entrypoint", help="module:function returning a shoal TrainingSetup (default: bench.models)")
    ap.add_argument("--loader-workers", type=int, default=0, help="DataLoader worker processes (with --entrypoint)")
    ap.add_argument("--prefetch-factor", type=int, default=2, help="batches each loader worker keeps ready")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"], help="autocast (with --entrypoint)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the DDP model (DDPOptimizer's bucketed graphs)")
    args = ap.parse_args()
    t_launch = time.time()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    model, opt, sched, data, collate, loss_fn, step_fn = (_from_setup if args.entrypoint else _digits)(args)
    model = DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    if args.compile:
        model = torch.compile(model)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    workers = args.loader_workers if args.entrypoint else 0
    loader = DataLoader(data, batch_size=args.batch // world, sampler=sampler, collate_fn=collate or default_collate,
                        num_workers=workers, prefetch_factor=args.prefetch_factor if workers else None,
                        persistent_workers=workers > 0, pin_memory=device.type == "cuda")
    amp = (torch.autocast(device.type, dtype=_AUTOCAST[args.precision])
           if args.entrypoint and args.precision in _AUTOCAST else nullcontext())
    scaler = torch.amp.GradScaler(device.type) if args.entrypoint and args.precision == "fp16" else None
    times, step, epoch = [], 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            opt.zero_grad()
            if not args.entrypoint:
                x, y = batch
                loss = nn.functional.cross_entropy(model(x), y)
            else:
                batch = _to(batch, device)
                with amp:
                    if step_fn is not None:
                        summed = step_fn(model, batch)
                    else:
                        summed = loss_fn(model(batch[0]), batch[1])
                loss = summed / _batch_len(batch)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            if sched is not None:
                sched.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # a step's time is when its work is done
            times.append(time.time())
            step += 1
            if step >= args.steps:
                break
        epoch += 1
    if rank == 0:
        print(json.dumps({"times": times, "init_done": t_launch}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
