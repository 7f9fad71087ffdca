"""The digits example as a plain torchrun + DDP script, for comparison with examples/digits.py.

    torchrun --nproc_per_node=2 -m shoal.examples.torchrun_ddp

Same data, model, optimizer, global batch (64) and epochs as ``examples/job.yaml``. It needs
shoal installed only for the shared data and model (``python3 scripts/dev.py`` sets that up).
Unlike the shoal version it cannot lose or gain a worker: if one process dies, torchrun
tears the whole job down.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from shoal.examples.digits import DigitGlyphs, evaluate, make_model

GLOBAL_BATCH, EPOCHS, SEED = 64, 3, 0


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(SEED)
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    dataset = DigitGlyphs(train=True)
    sampler = DistributedSampler(dataset, seed=SEED)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // dist.get_world_size(), sampler=sampler)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
        if dist.get_rank() == 0:
            metrics = evaluate(model.module)
            print(f"epoch {epoch}: test loss {metrics['loss']:.4f}  test accuracy {metrics['accuracy']:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
