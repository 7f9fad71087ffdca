"""Plain torchrun + FSDP2 HSDP, no elasticity: the baseline of ``bench/hsdp.py``. Prints JSON
with the wall time of every step.

    torchrun --standalone --nproc_per_node=4 -m bench.hsdp_baseline --steps 200 --batch 64 --shard 2

A 2-D device mesh (replicate x shard) over the ranks, ``fully_shard`` of each Linear of
``bench.models`` then of the root (shoal's default units for that model), the same optimizer
(SGD with momentum), the digits data split evenly: the layout of a shoal job with
``shard_size: 2`` and two replica groups, without its elasticity (no votes, no cross-replica
groups per generation, no heartbeats).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bench.models import make_model, make_optimizer
from shoal.examples.digits import DigitGlyphs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--shard", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.shard, args.shard), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = make_model()
    for unit in model:
        if isinstance(unit, nn.Linear):
            fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer(model)
    data = DigitGlyphs(train=True)
    local = args.batch // world
    times = []
    for step in range(args.steps):
        start = (step * args.batch + rank * local) % (len(data) - local)
        xs, ys = zip(*(data[i] for i in range(start, start + local)))
        loss = nn.functional.cross_entropy(model(torch.stack(xs)), torch.as_tensor(ys))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.time())
    if rank == 0:
        print(json.dumps({"times": times}))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
