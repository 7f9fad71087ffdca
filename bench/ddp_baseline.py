"""Plain torchrun + DDP training of bench.models for a fixed number of steps; prints JSON
with the wall time of every step after the first (for the side-by-side comparison).

    torchrun --standalone --nproc_per_node=2 -m bench.ddp_baseline --steps 200 --batch 64   (from the repository root)
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from bench.models import make_model, make_optimizer
from shoal.examples.digits import DigitGlyphs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    t_launch = time.time()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(make_model())
    opt = make_optimizer(model)
    data = DigitGlyphs(train=True)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(data, batch_size=args.batch // world, sampler=sampler)
    times, step, epoch = [], 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
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
