"""DiLoCo re-implemented in one process (no Redis, no workers), to check the loss figures of
``bench/diloco.py`` against the algorithm itself (issue 38): the digits example's MLP, AdamW
(lr 1e-3), global batch 64, 2 members each training its half of a round's samples in inner
batches of about 32 (as :func:`shoal.worker.layout_diloco.inner_step_count` cuts them), the
pseudo-gradient ``global - local`` averaged by sample count, then the outer Nesterov SGD - the
paper's and torchft's step. Its data order is its own (a seeded permutation per epoch).

    python3 scripts/dev.py python -m bench.diloco_reference --epochs 30 --schedule cosine \\
        --h 1 25 50 --outer 0.7,0.9 0.7,0.5 1.0,0

Prints the synchronous run's test loss, then one line per (H, outer lr, momentum): test loss,
accuracy and the gap (DiLoCo / synchronous - 1).

``--delayed``: each line also for the **one-round-delayed outer step** - what overlapping a
round's outer exchange with the next round's inner steps gives when every round still starts
from the same global weights on every member: round r trains from the global weights that
hold the outer steps of rounds up to r - 2, and round r - 1's outer step is applied when round
r ends (its exchange ran during round r); the last one is applied at the end. Not built in
shoal (docs/training.md: a round is the unit of commit); this measures what it would cost in
loss before anyone builds it.
"""

from __future__ import annotations

import argparse
import copy
import itertools

import torch
from torch import nn

from bench.diloco import warmup_cosine
from shoal.examples.digits import DigitGlyphs, make_model

BATCH, MEMBERS = 64, 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--schedule", choices=("constant", "cosine"), default="cosine")
    ap.add_argument("--h", type=int, nargs="+", default=[25, 50])
    ap.add_argument("--outer", nargs="+", default=["0.7,0.9", "0.7,0.5", "1.0,0"], help="LR,MOMENTUM pairs")
    ap.add_argument("--delayed", action="store_true", help="also the one-round-delayed outer step (see above)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    train, test = DigitGlyphs(train=True), DigitGlyphs(train=False)
    x, y, xt, yt = train.x, train.y, test.x, test.y
    total = args.epochs * -(-len(x) // BATCH)
    gen = torch.Generator().manual_seed(1)
    orders = [torch.randperm(len(x), generator=gen) for _ in range(args.epochs)]

    def optimizer(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return opt, (warmup_cosine(opt, total) if args.schedule == "cosine" else None)

    def train_step(model, opt, sched, idx):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        if sched is not None:
            sched.step()

    def evaluate(model):
        with torch.no_grad():
            out = model(xt)
            return float(nn.functional.cross_entropy(out, yt)), float((out.argmax(1) == yt).float().mean())

    torch.manual_seed(0)
    model = make_model()
    opt, sched = optimizer(model)
    for order in orders:
        for i in range(0, len(order), BATCH):
            train_step(model, opt, sched, order[i:i + BATCH])
    sync = evaluate(model)
    print(f"sync: loss {sync[0]:.4f} accuracy {sync[1]:.3f} ({args.epochs} epochs, {args.schedule} lr)", flush=True)
    for h, pair, delayed in itertools.product(args.h, args.outer, (False, True) if args.delayed else (False,)):
        lr, momentum = (float(v) for v in pair.split(","))
        torch.manual_seed(0)
        glob = make_model()
        members = [copy.deepcopy(glob) for _ in range(MEMBERS)]
        opts = [optimizer(m) for m in members]
        bufs = [torch.zeros_like(p) for p in glob.parameters()]
        rounds = 0
        pending = None  # --delayed: the averaged pseudo-gradient whose exchange is in flight

        def outer_step(mean):
            with torch.no_grad():
                for j, g in enumerate(glob.parameters()):
                    bufs[j].mul_(momentum).add_(mean[j])
                    g.add_(mean[j].add(bufs[j], alpha=momentum), alpha=-lr)

        for order in orders:
            for r in range(0, len(order), h * BATCH):
                part, deltas, counts = order[r:r + h * BATCH], [], []
                for k, (m, (o, s)) in enumerate(zip(members, opts)):
                    mine = part[k * len(part) // MEMBERS:(k + 1) * len(part) // MEMBERS]
                    m.load_state_dict(glob.state_dict())
                    for idx in torch.tensor_split(mine, max(1, min(h, round(len(mine) * MEMBERS / BATCH)))):
                        train_step(m, o, s, idx)
                    deltas.append([g.detach() - p.detach() for g, p in zip(glob.parameters(), m.parameters())])
                    counts.append(len(mine))
                mean = [sum(c * dl[j] for c, dl in zip(counts, deltas)) / sum(counts) for j in range(len(bufs))]
                if delayed:  # round r-1's exchange ends with round r: its outer step now
                    if pending is not None:
                        outer_step(pending)
                    pending = mean
                else:
                    outer_step(mean)
                rounds += 1
        if pending is not None:
            outer_step(pending)
        loss, acc = evaluate(glob)
        print(f"H={h} outer lr {lr} momentum {momentum}{' delayed' if delayed else ''}: loss {loss:.4f} "
              f"accuracy {acc:.3f} ({rounds} outer steps) gap={loss / sync[0] - 1:+.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
