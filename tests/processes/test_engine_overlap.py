"""The step engine's overlapped gradient reduction (worker/reducer.py), mixed precision and clipping
(worker/engine.py).

In-process tests run the engine in a real one-rank gloo group (``Rendezvous.join`` through Redis),
where every bucket is a real asynchronous collective: bucket layout and launch order, one
reduction per step whatever the micro-batches, unused parameters, an abort while backward
runs, fp16 overflow steps, clipping, and the loss scale through a checkpoint. One two-process
test (gloo over RedisStore) checks what needs peers: replicas bit-identical with and without
overlap, data-dependent unused parameters, clipping equal for 1 and 2 ranks, an overflow on one
rank skipped by both, the loss scale through a catch-up, an abort while buckets are in flight,
and a peer killed mid-backward (nothing applied, the step redone). CUDA variants run where a
GPU is.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

from shoal.storage.checkpoint import load_checkpoint, save_checkpoint
from shoal.storage.memory import MemoryStore
from shoal.storage.train_state import TrainState
from shoal.worker import process_group as pg
from shoal.worker.digest import state_digest
from shoal.worker.engine import StepEngine, plan_buckets
from shoal.worker.errors import StepAborted, UserCodeError
from shoal.worker.precision import LossScale
from shoal.worker.userapi import TrainingSetup

TINY_BUCKETS = 1e-6  # MiB: one byte, so every parameter gets its own bucket


class Points(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x[:, :3].sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class TwoHeads(nn.Module):
    """A trunk and two heads; a micro-batch uses one head, chosen by its data (so which
    parameters get a gradient differs between micro-batches and between ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head_a = nn.Linear(16, 2)
        self.head_b = nn.Linear(16, 2)
        self.spare = nn.Linear(16, 2)  # never used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        return self.head_a(h) if float(x[0, 0]) > 0 else self.head_b(h)


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def setup_for(model: nn.Module, opt: str = "adam", lr: float = 0.01, **kw) -> TrainingSetup:
    optimizer = (torch.optim.Adam(model.parameters(), lr=lr) if opt == "adam"
                 else torch.optim.SGD(model.parameters(), lr=lr))
    kw.setdefault("loss_fn", nn.CrossEntropyLoss(reduction="sum"))
    return TrainingSetup(model=model, optimizer=optimizer, dataset=Points(), **kw)


def void(_value: object) -> None:
    """A tensor hook's return value (None: the gradient is left as it is)."""


def batches(steps: int, size: int = 16):
    return [list(range(size * s, size * s + size)) for s in range(steps)]


class OneRank:
    """Real one-rank gloo groups, one generation after another (their collectives are real,
    asynchronous gloo work): calling it joins the next generation (closing the previous one)
    and returns its number; :attr:`current` is its group."""

    def __init__(self, r, job_id: str) -> None:
        self.rendezvous = pg.Rendezvous(r, job_id)
        self._gens = iter(range(1, 100))
        self.current: pg.Group | None = None

    def __call__(self) -> int:
        gen = next(self._gens)
        self.rendezvous.close_joined()
        self.current = self.rendezvous.join(gen, 0, 1, 20, collective_timeout=20)
        return gen


@pytest.fixture
def group(r, job_id):
    joiner = OneRank(r, job_id)
    yield joiner
    joiner.rendezvous.close_joined()


class Launches:
    """Records every all-reduce the engine starts (through ``Group.all_reduce_async``), with when:
    ``"during"`` backward, or outside it ``"before"`` any of the engine's hooks fired in the
    step, or ``"after"``."""

    def __init__(self, monkeypatch, engine: StepEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[str, str]] = []
        real = pg.Group.all_reduce_async

        def spy(group, tensor, op=torch.distributed.ReduceOp.SUM, what="all_reduce"):
            in_backward = torch._C._current_graph_task_id() != -1
            fired = self.engine.reducer._fired or not self.engine.overlap  # no overlap: hooks stay unarmed
            self.calls.append((what, "during" if in_backward else "after" if fired else "before"))
            return real(group, tensor, op, what)

        monkeypatch.setattr(pg.Group, "all_reduce_async", spy)

    def buckets(self) -> list[int]:
        return [int(w.rsplit(" ", 1)[1]) for w, _ in self.calls if "bucket" in w]


# --- layout ----------------------------------------------------------------------------------
def test_buckets_are_planned_in_reverse_registration_order_with_a_small_first_bucket():
    mib = 2**20
    sizes = [4 * mib, 1000, 3 * mib, 2000, 500]
    # reversed: 500, 2000, 3 MiB, 1000, 4 MiB; the first bucket closes at 1 MiB (with the
    # parameter that crossed it, as DDP's), the rest at 5 MiB
    assert plan_buckets(sizes, 5 * mib) == [[4, 3, 2], [1, 0]]
    assert plan_buckets(sizes, 6 * mib, first_bytes=1000) == [[4, 3], [2, 1, 0]]
    assert plan_buckets(sizes, 1000) == [[4, 3], [2], [1], [0]]  # large params alone
    assert plan_buckets(sizes, 100 * mib, first_bytes=100 * mib) == [[4, 3, 2, 1, 0]]


# --- one rank, real gloo -----------------------------------------------------------------------
def test_overlap_is_bit_identical_to_no_overlap_and_to_a_local_run_and_reduces_once_per_step(group, monkeypatch):
    """Tiny buckets, 4 micro-batches: every bucket is reduced once per step, all of them launched
    while backward still runs, in index order; the parameters equal those of overlap=False and
    of a run without any group, bit for bit (one rank: the reduction adds nothing)."""
    gen = group()
    digests = {}
    for name, kw in {"overlap": {}, "after": {"overlap": False}, "local": {"require_group": False}}.items():
        model = mlp()
        engine = StepEngine.from_setup(setup_for(model, micro_batch=5), bucket_cap_mb=TINY_BUCKETS, **kw,
                                       group=None if name == "local" else group.current)  # local: no group at all
        spy = Launches(monkeypatch, engine)
        for idx in batches(3):
            res = engine.step(idx, len(idx), gen, base_generation=gen)
            assert res.count == 16 and not res.skipped and res.grad_norm is None
        digests[name] = state_digest(model)
        n = engine.bucket_count
        assert n == 6  # 3 Linear layers x (weight, bias)
        if name == "overlap":
            assert spy.buckets() == list(range(n)) * 3  # once per step, in order, whatever the micro-batches
            # gloo: one collective in flight at a time, so a bucket may wait for its predecessor
            # past the end of backward; the first one always goes while backward runs
            assert [when for _, when in spy.calls][::n] == ["during"] * 3
        elif name == "after":
            assert spy.buckets() == list(range(n)) * 3 and {when for _, when in spy.calls} == {"after"}
        else:
            assert spy.calls == []
    assert digests["overlap"] == digests["after"] == digests["local"] != state_digest(mlp())


def test_unused_parameters_do_not_block_and_are_found_in_the_graph_from_then_on(group, monkeypatch):
    gen = group()
    model = TwoHeads()
    torch.manual_seed(0)
    spare_before = [p.detach().clone() for p in model.spare.parameters()]
    engine = StepEngine.from_setup(setup_for(model, opt="sgd", lr=0.1, micro_batch=4), bucket_cap_mb=TINY_BUCKETS,
                                   group=group.current)
    spy = Launches(monkeypatch, engine)
    assert not engine.find_unused
    engine.step(list(range(16)), 16, gen, base_generation=gen)
    # the spare head's buckets (0, 1: registered last) waited for the end of backward, and so
    # did every bucket after them: launch order is bucket order
    assert spy.buckets() == list(range(engine.bucket_count))
    assert {when for _, when in spy.calls} == {"after"}
    assert engine.find_unused  # from now on the autograd graph tells which parameters are unused
    for p, q in zip(model.spare.parameters(), spare_before):
        assert torch.equal(p, q)  # a zero gradient: SGD did not move it
    for idx in batches(3):
        spy.calls.clear()
        engine.step(idx, len(idx), gen, base_generation=gen)
        assert spy.buckets() == list(range(engine.bucket_count))
        assert spy.calls[0][1] == "before"  # the spare head's bias: before backward started


def test_an_abort_while_backward_runs_applies_nothing_and_the_step_is_redone(group):
    """The coordinator's eviction (``request_abort``) lands during backward: the buckets not
    yet launched fail to start, the step raises StepAborted with nothing applied and new
    buckets; redone in the next generation it gives what a local step gives."""
    gen = group()
    model = mlp()
    s = setup_for(model, micro_batch=4)
    engine = StepEngine.from_setup(s, bucket_cap_mb=TINY_BUCKETS, group=group.current)
    engine.step(list(range(16)), 16, gen, base_generation=gen)
    before = state_digest(model)
    adam_steps = [int(v["step"]) for v in s.optimizer.state.values()]
    old = [b.flat for b in engine.reducer.buckets]
    abort_in_backward = {"armed": True}

    def step_fn(m, batch):
        x, y = batch
        h = m[0](x)
        if abort_in_backward["armed"]:  # runs in backward, after the later layers' buckets launched
            h.register_hook(lambda g: void(group.rendezvous.request_abort(gen, "evicted w9 (test)")))
        return nn.functional.cross_entropy(m[4](m[3](m[2](m[1](h)))), y, reduction="sum")

    engine.loss_fn, engine.step_fn = None, step_fn
    with pytest.raises(StepAborted, match="evicted w9"):
        engine.step(list(range(16, 32)), 16, gen, base_generation=gen)
    assert state_digest(model) == before
    assert all(p.grad is None for p in model.parameters())
    assert [int(v["step"]) for v in s.optimizer.state.values()] == adam_steps
    assert all(a.data_ptr() != b.flat.data_ptr() for a, b in zip(old, engine.reducer.buckets))  # reallocated
    abort_in_backward["armed"] = False
    gen = group()
    engine.group = group.current  # the next generation's group
    engine.step(list(range(16, 32)), 16, gen, base_generation=gen)
    ref_model = mlp()
    ref = StepEngine.from_setup(setup_for(ref_model, micro_batch=4, loss_fn=None, step_fn=step_fn), require_group=False)
    for idx in batches(2):
        ref.step(idx, 16, 0)
    assert state_digest(model) == state_digest(ref_model)


def test_a_gradient_arriving_twice_in_one_backward_is_summed_without_a_group():
    """Reentrant activation checkpointing of a shared layer accumulates its gradient twice in
    one backward: without a group nothing read the bucket yet, so the result is exact."""
    from torch.utils.checkpoint import checkpoint

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.mid, self.out = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for _ in range(2):
                h = checkpoint(lambda t: torch.tanh(self.mid(t)), h, use_reentrant=True)
            return self.out(h)

    digests = []
    for overlap in (True, False):
        torch.manual_seed(0)
        model = Shared()
        engine = StepEngine.from_setup(setup_for(model, opt="sgd", lr=0.1), require_group=False,
                                       bucket_cap_mb=TINY_BUCKETS, overlap=overlap)
        engine.step(list(range(16)), 16, 0)
        digests.append(state_digest(model))
    assert digests[0] == digests[1]


# --- precision ---------------------------------------------------------------------------------
def test_bf16_trains_on_cpu():
    model = mlp()
    engine = StepEngine.from_setup(setup_for(model, lr=0.02), require_group=False, precision="bf16")
    losses = [engine.step(idx, 16, 0).loss for idx in batches(4) * 6]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(losses[-4:]) < 0.6 * sum(losses[:4])


def test_fp16_overflow_step_is_skipped_the_scale_halves_and_training_goes_on(group):
    gen = group()
    model = mlp()
    s = setup_for(model, lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(s.optimizer, step_size=1, gamma=0.9)
    s.lr_scheduler = sched
    engine = StepEngine.from_setup(s, precision="fp16", group=group.current)
    first = engine.step(list(range(16)), 16, gen, base_generation=gen)
    assert not first.skipped and first.loss_scale == 2.0**16 and engine.scaler.growth_tracker == 1
    assert first.grad_norm is not None and first.grad_norm > 0
    before, adam_steps = state_digest(model), [int(v["step"]) for v in s.optimizer.state.values()]
    poison = {"on": True}

    def loss_fn(out, y):
        loss = nn.functional.cross_entropy(out, y, reduction="sum")
        return loss * float("inf") if poison["on"] else loss

    engine.loss_fn = loss_fn
    res = engine.step(list(range(16, 32)), 16, gen, base_generation=gen)
    assert res.skipped and res.loss_scale == 2.0**16 and not torch.isfinite(torch.tensor(res.grad_norm))
    assert engine.scaler.scale == 2.0**15 and engine.scaler.growth_tracker == 0
    assert state_digest(model) == before  # no optimizer step
    assert [int(v["step"]) for v in s.optimizer.state.values()] == adam_steps
    assert sched.last_epoch == 2  # the step committed: the schedule moves as with GradScaler
    assert all(p.grad is None for p in model.parameters())
    poison["on"] = False
    losses = [engine.step(idx, 16, gen, base_generation=gen).loss for idx in batches(4) * 4]
    assert state_digest(model) != before and losses[-1] < losses[0]
    assert engine.scaler.scale == 2.0**15 and engine.scaler.growth_tracker == 16


def test_loss_scale_policy_and_its_state():
    sc = LossScale(scale=8.0, growth_interval=2)
    sc.update(found_inf=False)
    assert (sc.scale, sc.growth_tracker) == (8.0, 1)
    sc.update(found_inf=False)
    assert (sc.scale, sc.growth_tracker) == (16.0, 0)
    sc.update(found_inf=True)
    assert (sc.scale, sc.growth_tracker) == (8.0, 0)
    other = LossScale()
    other.load_state_dict(json.loads(json.dumps(sc.state_dict())))
    assert other.state_dict() == {"scale": 8.0, "growth_tracker": 0}
    with pytest.raises(ValueError):
        other.load_state_dict({"scale": float("nan"), "growth_tracker": 0})


def test_loss_scale_round_trips_through_a_checkpoint_and_state_extras():
    model = mlp()
    s = setup_for(model)
    engine = StepEngine.from_setup(s, require_group=False, precision="fp16")
    engine.step(list(range(16)), 16, 0)
    engine.scaler.scale, engine.scaler.growth_tracker = 512.0, 7
    store = MemoryStore()
    save_checkpoint(store, TrainState.capture(model, s.optimizer, step=1, scaler=engine.scaler).snapshot())
    state, _ = load_checkpoint(store, 1)
    fresh = StepEngine.from_setup(setup_for(mlp(seed=3)), require_group=False, precision="fp16")
    state.restore(fresh.model, fresh.optimizer, scaler=fresh.scaler)
    assert fresh.scaler.state_dict() == {"scale": 512.0, "growth_tracker": 7}
    assert state_digest(fresh.model) == state_digest(model)
    # a checkpoint of an fp32 run: an fp16 engine keeps its initial scale
    fp32 = TrainState.capture(model, s.optimizer, step=2, scaler=None)
    assert fp32.scaler is None and "scaler.pt" not in fp32.components()
    other = StepEngine.from_setup(setup_for(mlp()), require_group=False, precision="fp16")
    fp32.restore(other.model, other.optimizer, scaler=other.scaler)
    assert other.scaler.scale == 2.0**16
    # what a state transfer carries in its extra
    extras = json.loads(json.dumps(engine.state_extras()))
    other.load_state_extras({"step": 3, **extras})
    assert other.scaler.state_dict() == engine.scaler.state_dict()
    assert StepEngine.from_setup(setup_for(mlp()), require_group=False).state_extras() == {}


def test_clipping_bounds_the_reduced_mean_gradient():
    """SGD with lr 1: the update is the clipped gradient; its norm is max_grad_norm, and the
    reported pre-clip norm is torch's for the plain mean loss."""
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    engine = StepEngine.from_setup(setup_for(model, opt="sgd", lr=1.0, micro_batch=6), require_group=False,
                                   max_grad_norm=0.05)
    res = engine.step(list(range(16)), 16, 0)
    plain = mlp()
    d = Points()
    nn.functional.cross_entropy(plain(d.x[:16]), d.y[:16]).backward()
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
    assert res.grad_norm == pytest.approx(float(norm), rel=1e-5) and res.grad_norm > 0.05
    update = torch.sqrt(sum(((p.detach() - q) ** 2).sum() for p, q in zip(model.parameters(), before)))
    assert float(update) == pytest.approx(0.05, rel=1e-4)
    for p, q, b in zip(model.parameters(), plain.parameters(), before):
        assert torch.allclose(p, b - q.grad, rtol=1e-5, atol=1e-7)


def test_options_are_checked():
    with pytest.raises(ValueError, match="precision"):
        StepEngine.from_setup(setup_for(mlp()), require_group=False, precision="fp8")
    with pytest.raises(ValueError, match="max_grad_norm"):
        StepEngine.from_setup(setup_for(mlp()), require_group=False, max_grad_norm=0)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        StepEngine.from_setup(setup_for(mlp()), require_group=False, bucket_cap_mb=0)


def test_a_user_error_in_backward_applies_nothing():
    model = mlp()
    engine = StepEngine.from_setup(setup_for(model), require_group=False, bucket_cap_mb=TINY_BUCKETS)
    engine.step(list(range(16)), 16, 0)
    before = state_digest(model)

    def step_fn(m, batch):
        x, y = batch
        h = m[0](x)
        h.register_hook(lambda g: (_ for _ in ()).throw(ValueError("backward boom")))
        return nn.functional.cross_entropy(m[4](m[3](m[2](m[1](h)))), y, reduction="sum")

    engine.loss_fn, engine.step_fn = None, step_fn
    with pytest.raises(UserCodeError, match="backward boom"):
        engine.step(list(range(16, 32)), 16, 0)
    assert state_digest(model) == before and all(p.grad is None for p in model.parameters())


# --- CUDA (where a GPU is) -----------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_cuda_overlap_and_precision_match_the_cpu_step_without_a_sync_per_micro_batch(r, job_id):
    """A one-rank NCCL group on the GPU: overlapped buckets under fp32, bf16 and fp16 give the
    CPU engine's parameters (same precision, to float tolerance), and a step makes as many
    host syncs with 4 micro-batches as with one."""
    import threading
    import traceback
    import warnings

    tolerance = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 5e-3}
    reference = {}
    for precision in tolerance:  # on the CPU first: no group may exist for a local engine
        cpu = mlp()
        c = StepEngine.from_setup(setup_for(cpu, opt="sgd", lr=0.1, micro_batch=4), require_group=False,
                                  device="cpu", precision=precision)
        losses = [c.step(idx, 16, 0).loss for idx in batches(3)]
        reference[precision] = (losses, cpu.state_dict())
    rendezvous = pg.Rendezvous(r, job_id, backend="nccl")
    nccl = rendezvous.join(1, 0, 1, 60, collective_timeout=60)
    try:
        for precision, tol in tolerance.items():
            gpu = mlp()
            g = StepEngine.from_setup(setup_for(gpu, opt="sgd", lr=0.1, micro_batch=4), precision=precision,
                                      bucket_cap_mb=TINY_BUCKETS, group=nccl)
            assert g.device.type == "cuda" and g.bucket_count == 6
            losses = [g.step(idx, 16, 1, base_generation=1).loss for idx in batches(3)]
            assert losses == pytest.approx(reference[precision][0], rel=tol, abs=tol)
            for k, v in gpu.state_dict().items():
                assert torch.allclose(v.cpu(), reference[precision][1][k], rtol=tol, atol=tol), (precision, k)
        syncs, outside = {}, {}
        for micro in (16, 4):  # one micro-batch, four
            e = StepEngine.from_setup(setup_for(mlp(), micro_batch=micro), bucket_cap_mb=TINY_BUCKETS, group=nccl)
            e.step(list(range(16)), 16, 1, base_generation=1)  # warm-up (allocations, optimizer state)
            torch.cuda.synchronize()
            found, before = syncs[micro], outside[micro] = [], []

            def seen(message, category, filename, lineno, file=None, line=None, found=found, before=before):
                # where each sync was made: the line that called into torch, its thread and stack.
                # Only the step's count: on an H200 one sync was flagged inside the call that
                # turned the warnings on, before the step began (with one micro-batch only)
                if "synchroniz" in str(message):
                    stack = traceback.extract_stack()[:-1]
                    where = f"{filename}:{lineno} (thread {threading.current_thread().name}):\n" \
                        + "".join(traceback.format_list(stack[-14:]))
                    in_step = any(f.name == "step" and f.filename.endswith("engine.py") for f in stack)
                    (found if in_step else before).append(where)

            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = seen
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    e.step(list(range(16, 32)), 16, 1, base_generation=1)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        # the design's one host read per step (loss, sample count and the overflow/clipping
        # decision in one), whatever the number of micro-batches
        assert all(len(found) == 1 for found in syncs.values()), "\n".join(
            f"{micro} sample(s) a micro-batch: {len(found)} syncs in the step, {len(outside[micro])} outside it\n"
            + "\n".join(found + outside[micro]) for micro, found in syncs.items())
    finally:
        rendezvous.close_joined()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_on_two_gpus(job_id, subprocess_env):
    """The two-process scenarios with NCCL, one GPU per rank (``LOCAL_RANK``)."""
    _check_pair(*_run_pair(job_id, subprocess_env, backend="nccl"))


# --- two real processes -------------------------------------------------------------------------
STEPS = 3
CLIP = 0.05


def _pair_child(rank: int, job: str, backend: str) -> None:
    from shoal.core.connection import connect
    from shoal.worker.data import rank_slice, round_robin_table
    from shoal.worker.transfer import catch_up_state

    torch.set_num_threads(1)
    if backend == "nccl":
        os.environ["LOCAL_RANK"] = str(rank)
    client = connect(os.environ["REDIS_URL"], timeout=10)
    out: dict[str, object] = {}
    rendezvous = pg.Rendezvous(client, job, backend=backend)
    g1 = rendezvous.join(1, rank, 2, 60, collective_timeout=20)

    def mine(idx: list[int]) -> list[int]:
        return rank_slice(idx, round_robin_table(len(idx), 2)[rank])

    # a. overlap vs launched after backward, data-dependent unused heads: bit-identical
    for name, kw in (("overlap", {}), ("after", {"overlap": False})):
        torch.manual_seed(0)
        model = TwoHeads()
        engine = StepEngine.from_setup(setup_for(model, micro_batch=3), bucket_cap_mb=TINY_BUCKETS, **kw, group=g1)
        for idx in batches(STEPS):
            engine.step(mine(idx), len(idx), 1, base_generation=1)
        out[name] = state_digest(model)

    # b. clipping on the reduced gradient (the test compares with one process)
    model = mlp()
    engine = StepEngine.from_setup(setup_for(model, micro_batch=5), max_grad_norm=CLIP, group=g1)
    out["norms"] = [engine.step(mine(idx), len(idx), 1, base_generation=1).grad_norm for idx in batches(STEPS)]
    out["clipped"] = {k: v.tolist() for k, v in model.state_dict().items()}

    # c. fp16: rank 1 alone overflows in step 1; both skip it
    model = mlp()
    engine = StepEngine.from_setup(setup_for(model), precision="fp16", bucket_cap_mb=TINY_BUCKETS, group=g1)
    poison = {"on": False}
    base = nn.CrossEntropyLoss(reduction="sum")
    engine.loss_fn = lambda o, y: base(o, y) * (float("inf") if poison["on"] else 1.0)
    fp16 = []
    for step, idx in enumerate(batches(STEPS)):
        poison["on"] = step == 1 and rank == 1
        before = state_digest(model)
        res = engine.step(mine(idx), len(idx), 1, base_generation=1)
        fp16.append([res.skipped, res.loss_scale, state_digest(model) == before])
    out["fp16"] = fp16
    out["fp16_final"] = [state_digest(model), engine.scaler.state_dict()]

    # d. the loss scale travels with a catch-up: rank 1 joins with a fresh engine
    if rank == 1:
        model = mlp(seed=5)
        engine = StepEngine.from_setup(setup_for(model), precision="fp16", group=g1)
    extra = {"step": 4, "cursor": 64, **engine.state_extras()}
    _, got, behind = catch_up_state(model, engine.optimizer, extra, 4 if rank == 0 else -1, group=g1)
    engine.load_state_extras(got)
    out["caught_up"] = [behind, state_digest(model), engine.scaler.state_dict()]

    # e. an abort (an eviction) while buckets are in flight: rank 1 stalls in its backward; the
    # coordinator's table evicting it reaches rank 0 after 0.3 s, rank 1 itself during its stall
    model = mlp()
    engine = StepEngine.from_setup(setup_for(model), bucket_cap_mb=TINY_BUCKETS, group=g1)
    engine.step(mine(list(range(16))), 16, 1, base_generation=1)
    stall = {"s": 1.5 if rank == 1 else 0.0}

    def stalled(_grad: torch.Tensor) -> None:
        threading.Timer(1.0, rendezvous.request_abort, (1, "evicted w1 (test)")).start()
        time.sleep(stall["s"])

    def step_fn(m, batch):
        x, y = batch
        h = m[0](x)
        if stall["s"]:
            h.register_hook(stalled)
        return nn.functional.cross_entropy(m[4](m[3](m[2](m[1](h)))), y, reduction="sum")

    engine.loss_fn, engine.step_fn = None, step_fn
    if rank == 0:
        engine.before_collectives = lambda: threading.Timer(0.3, rendezvous.request_abort, (1, "evicted w1 (test)")).start()
    before, flats = state_digest(model), [b.flat.data_ptr() for b in engine.reducer.buckets]
    t0 = time.monotonic()
    try:
        engine.step(mine(list(range(16, 32))), 16, 1, base_generation=1)
        out["abort"] = "committed"
    except StepAborted as exc:
        out["abort"] = "StepAborted: " + str(exc)[:200]
    out["abort_s"] = time.monotonic() - t0
    out["abort_applied"] = state_digest(model) != before
    out["abort_new_buckets"] = all(a != b.flat.data_ptr() for a, b in zip(flats, engine.reducer.buckets))
    engine.before_collectives = None
    stall["s"] = 0.0
    rendezvous.close_joined()

    # f. a peer killed mid-backward (some buckets launched), the step redone alone
    print("PART " + json.dumps(out), flush=True)  # rank 1 dies below
    g2 = rendezvous.join(2, rank, 2, 60, collective_timeout=20)
    model = mlp()
    s = setup_for(model)
    engine = StepEngine.from_setup(s, bucket_cap_mb=TINY_BUCKETS, group=g2)
    engine.step(mine(list(range(16))), 16, 2, base_generation=2)

    def dying(m, batch):
        x, y = batch
        h = m[0](x)
        if rank == 1:
            h.register_hook(lambda g: os._exit(17))
        return nn.functional.cross_entropy(m[4](m[3](m[2](m[1](h)))), y, reduction="sum")

    engine.loss_fn, engine.step_fn = None, dying
    ref = mlp()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    ref_opt.load_state_dict(copy.deepcopy(s.optimizer.state_dict()))
    before = (state_digest(model), _opt_state(s.optimizer))
    out["kill_serial"] = g2.serial_collectives()
    t0 = time.monotonic()
    try:
        engine.step(mine(list(range(16, 32))), 16, 2, base_generation=2)
        out["kill"] = "committed"
    except StepAborted as exc:
        out["kill"] = "StepAborted: " + str(exc)[:200]
    out["kill_s"] = time.monotonic() - t0
    out["kill_applied"] = (state_digest(model), _opt_state(s.optimizer)) != before
    rendezvous.close_joined()
    engine.group = rendezvous.join(3, 0, 1, 60, collective_timeout=20)
    engine.step(list(range(16, 32)), 16, 3, base_generation=3)  # the same global batch, redone alone
    out["redone"] = state_digest(model)
    ref_engine = StepEngine(ref, ref_opt, Points(), step_fn=dying, require_group=False)
    ref_engine.step(list(range(16, 32)), 16, 0)
    out["reference"] = state_digest(ref)
    rendezvous.close_joined()
    print("RESULT " + json.dumps(out), flush=True)


def _opt_state(opt: torch.optim.Optimizer) -> list:
    return [[float(v["step"]), float(v["exp_avg"].abs().sum())] for v in opt.state.values()]


def _run_pair(job_id: str, env: dict, backend: str = "gloo") -> tuple[dict, dict]:
    """Run :func:`_pair_child` as ranks 0 and 1; their results (rank 1's up to its death)."""
    env = dict(env, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", __name__, "pair", str(r), job_id, backend], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outputs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            outputs.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    def last(stdout: str, tag: str) -> dict:
        return json.loads([ln for ln in stdout.splitlines() if ln.startswith(tag)][-1][len(tag):])

    (rc0, out0, err0), (rc1, out1, err1) = outputs
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 17, err1[-3000:]  # it killed itself mid-backward in scenario f
    return last(out0, "RESULT "), last(out1, "PART ")


def _one_process_clipped() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = mlp()
    engine = StepEngine.from_setup(setup_for(model, micro_batch=5), require_group=False, max_grad_norm=CLIP)
    norms = [engine.step(idx, len(idx), 0).grad_norm for idx in batches(STEPS)]
    return norms, model.state_dict()


def _check_pair(r0: dict, r1: dict) -> None:
    for r in (r0, r1):
        assert r["overlap"] == r["after"]  # overlap changes nothing, bit for bit (2 ranks: a + b)
    assert r0["overlap"] == r1["overlap"]  # replicas bit-identical, heads used differently per rank
    # clipping: identical on both ranks, and as with one process (to float tolerance)
    assert r0["norms"] == r1["norms"] and r0["clipped"] == r1["clipped"]
    norms, ref = _one_process_clipped()
    assert r0["norms"] == pytest.approx(norms, rel=1e-5) and min(norms) > CLIP  # clipping did bite
    for k, v in ref.items():
        assert torch.allclose(torch.tensor(r0["clipped"][k]), v, rtol=1e-5, atol=1e-6), k
    # fp16: rank 1's overflow is skipped by both; the scale halves on both
    assert r0["fp16"] == r1["fp16"] == [[False, 2.0**16, False], [True, 2.0**16, True], [False, 2.0**15, False]]
    assert r0["fp16_final"] == r1["fp16_final"]
    assert r0["fp16_final"][1] == {"scale": 2.0**15, "growth_tracker": 1}
    # the catch-up brought rank 0's weights and loss scale to the fresh rank 1
    assert r0["caught_up"] == r1["caught_up"] and r0["caught_up"][0] == [1]
    # an abort while buckets were in flight: nothing applied, new buckets, no wait for the peer
    for r in (r0, r1):
        assert r["abort"].startswith("StepAborted") and "evicted w1" in r["abort"], r["abort"]
        assert not r["abort_applied"] and r["abort_new_buckets"]
    assert r0["abort_s"] < 1.4, "the abort must end the wait, not the peer's 1.5 s stall"
    # a peer killed mid-backward: nothing applied; redone alone it equals a local step
    assert r0["kill"].startswith("StepAborted"), r0["kill"]
    assert r0["kill_serial"] is False
    # two ranks: buckets in flight together (serial_collectives is False), and still every
    # collective of the survivor fails at once when its only peer dies
    assert not r0["kill_applied"] and r0["kill_s"] < 3, r0["kill_s"]
    assert r0["redone"] == r0["reference"]


@pytest.mark.slow
def test_two_ranks_overlap_precision_clipping_abort_and_kill(job_id, subprocess_env):
    """Two gloo processes, one scenario after another (see the module docstring)."""
    _check_pair(*_run_pair(job_id, subprocess_env))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "pair":
        _pair_child(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        sys.exit("usage: test_engine_overlap.py pair RANK JOB_ID BACKEND")
