"""The training step (worker/engine.py), state transfer (worker/transfer.py), digest, user API and the example.

In-process tests cover the local contracts (mean-loss semantics, micro-batching, rollback,
errors). The multi-process test runs this file as a script in 4 real processes (gloo over
RedisStore): an elastic 3-process run in which a rank dies mid-training and a fresh worker
with a different initial model replaces it; its trajectory is compared with an uninterrupted
single-process reference computed in the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn


from tests.entrypoints import Points
from tests.helpers import run_ranks
from shoal.worker.digest import state_digest  # noqa: E402
from shoal.worker.engine import StepEngine  # noqa: E402
from shoal.worker.transfer import _decode, _encode  # noqa: E402
from shoal.worker.errors import EntrypointError, InconsistentStep, StepAborted, UserCodeError  # noqa: E402
from shoal.worker.userapi import TrainingSetup, load_entrypoint  # noqa: E402

GLOBAL_BATCH = 64


def small_setup(seed: int = 0, batchnorm: bool = False, **kw) -> TrainingSetup:
    torch.manual_seed(seed)
    layers = [nn.Linear(5, 8)] + ([nn.BatchNorm1d(8)] if batchnorm else []) + [nn.ReLU(), nn.Linear(8, 2)]
    model = nn.Sequential(*layers)
    return TrainingSetup(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        dataset=Points(),
        loss_fn=kw.pop("loss_fn", nn.CrossEntropyLoss(reduction="sum")),
        **kw,
    )


# --- the step, in one process -------------------------------------------------------------------
def test_step_is_the_mean_loss_gradient_and_micro_batching_does_not_change_it():
    """Summed per-sample losses / global count == the plain mean-loss step, with or without
    micro-batches (gradient accumulation), to float tolerance."""
    idx = list(range(3, 26))  # 23 samples
    results = []
    for micro in (None, 5):
        s = small_setup(micro_batch=micro)
        engine = StepEngine.from_setup(s, require_group=False)
        res = engine.step(idx, len(idx), generation=7)
        assert res.count == 23 and res.local_count == 23 and res.max_generation == 7
        results.append((res, [p.detach().clone() for p in s.model.parameters()]))
    plain = small_setup()
    x, y = plain.dataset.x[idx], plain.dataset.y[idx]
    loss = nn.functional.cross_entropy(plain.model(x), y)
    loss.backward()
    plain.optimizer.step()
    for res, params in results:
        assert res.loss == pytest.approx(loss.item(), rel=1e-5)
        for p, q in zip(params, plain.model.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)
    # and the step changed something
    assert state_digest(plain.model) != state_digest(small_setup().model)


def test_a_generation_seen_during_the_step_is_carried_by_it_when_newest_seen_is_set():
    """Slices by speed: the tail takes the newest generation seen right before the last
    backward (``newest_seen``), not only the one the step started with."""
    engine = StepEngine.from_setup(small_setup(), require_group=False)
    assert engine.step(range(8), 8, 5, base_generation=5).max_generation == 5
    seen = iter([5, 6])
    engine.newest_seen = lambda: next(seen)  # a table published while the step ran
    assert engine.step(range(8), 8, 5, base_generation=5).max_generation == 5
    assert engine.step(range(8), 8, 5, base_generation=5).max_generation == 6  # base + 1: "switch after it"


def test_custom_step_fn_and_scheduler_are_used():
    s = small_setup(loss_fn=None)
    calls = []

    def step_fn(model, batch):
        x, y = batch
        calls.append(len(y))
        return nn.functional.cross_entropy(model(x), y, reduction="sum")

    s.step_fn = step_fn
    s.lr_scheduler = torch.optim.lr_scheduler.StepLR(s.optimizer, step_size=1, gamma=0.5)
    engine = StepEngine.from_setup(s, require_group=False)
    engine.step(range(10), 10, 0)
    assert calls == [10]
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(0.005)


def test_failed_step_applies_nothing_and_restores_buffers():
    """A user error after the forward pass (BatchNorm stats already updated) leaves weights,
    buffers, optimizer state and grads as before the step."""
    s = small_setup(batchnorm=True)
    engine = StepEngine.from_setup(s, require_group=False)
    engine.step(range(8), 8, 0)
    before, opt_before = state_digest(s.model), json.dumps(_encode(s.optimizer.state_dict(), []))
    steps_before = [float(v["step"]) for v in s.optimizer.state.values()]

    def broken(out, target):
        raise ValueError("boom")

    engine.loss_fn = broken
    with pytest.raises(UserCodeError, match="boom"):
        engine.step(range(8, 16), 8, 0)
    assert state_digest(s.model) == before
    assert all(p.grad is None for p in s.model.parameters())
    assert [float(v["step"]) for v in s.optimizer.state.values()] == steps_before
    assert json.dumps(_encode(s.optimizer.state_dict(), [])) == opt_before

    engine.loss_fn = nn.CrossEntropyLoss(reduction="sum")
    with pytest.raises(InconsistentStep):  # this rank's slice does not add up to the count
        engine.step(range(8, 12), 8, 0)
    assert state_digest(s.model) == before

    engine.loss_fn = lambda out, target: nn.functional.cross_entropy(out, target, reduction="none")
    with pytest.raises(UserCodeError, match="scalar"):
        engine.step(range(8, 16), 8, 0)
    assert state_digest(s.model) == before

    def refuse() -> None:  # the training worker's fence, once it was declared failed
        raise StepAborted("evicted")

    engine.loss_fn = nn.CrossEntropyLoss(reduction="sum")
    engine.commit_guard = refuse
    with pytest.raises(StepAborted, match="evicted"):
        engine.step(range(8, 16), 8, 0)
    assert state_digest(s.model) == before
    assert [float(v["step"]) for v in s.optimizer.state.values()] == steps_before
    engine.commit_guard = None
    engine.step(range(8, 16), 8, 0)
    assert state_digest(s.model) != before


def test_step_outside_a_group_is_aborted_when_a_group_is_required():
    s = small_setup()
    engine = StepEngine.from_setup(s)
    before = state_digest(s.model)
    with pytest.raises(StepAborted, match="not in a process group"):
        engine.step(range(4), 4, 0)
    assert state_digest(s.model) == before


def test_state_encoding_round_trips_adam_and_scheduler_state():
    s = small_setup(batchnorm=True)
    sched = torch.optim.lr_scheduler.StepLR(s.optimizer, step_size=2, gamma=0.1)
    s.lr_scheduler = sched
    StepEngine.from_setup(s, require_group=False).step(range(6), 6, 0)
    tensors: list[torch.Tensor] = []
    blob = json.dumps(
        {"opt": _encode(s.optimizer.state_dict(), tensors), "sched": _encode(sched.state_dict(), tensors),
         "extra": _encode({"step": 1, "t": (1, 2.5), "none": None}, tensors)}
    )
    back = json.loads(blob)
    opt = _decode(back["opt"], tensors)
    assert opt["param_groups"][0]["betas"] == s.optimizer.param_groups[0]["betas"]  # tuple kept
    assert set(opt["state"]) == set(s.optimizer.state_dict()["state"])  # int keys kept
    assert torch.equal(opt["state"][0]["exp_avg"], s.optimizer.state_dict()["state"][0]["exp_avg"])
    assert _decode(back["sched"], tensors) == sched.state_dict()
    assert _decode(back["extra"], tensors) == {"step": 1, "t": (1, 2.5), "none": None}
    with pytest.raises(TypeError):
        _encode({"bad": object()}, [])


# --- digest --------------------------------------------------------------------------------------
def test_digest_is_stable_and_sees_one_bit():
    a, b = small_setup().model, small_setup().model
    assert state_digest(a) == state_digest(b) and len(state_digest(a)) == 16
    with torch.no_grad():
        w = b[0].weight
        w.view(-1).view(torch.int32)[3] ^= 1  # flip the lowest mantissa bit of one weight
    assert state_digest(a) != state_digest(b)
    assert state_digest(small_setup(seed=1).model) != state_digest(a)


# --- user API -----------------------------------------------------------------------------------
def _bad_setup():
    return TrainingSetup(model=nn.Linear(2, 2), optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1),
                         dataset=Points(), loss_fn=nn.MSELoss())


def _not_a_setup():
    return {"model": None}


def _raises():
    raise RuntimeError("cannot build")


def _needs_args(x):
    return x


@pytest.mark.parametrize(
    "entrypoint, message",
    [
        ("shoal.examples.digits", "module:function"),
        ("no_such_module_xyz:build", "cannot import"),
        ("shoal.examples.digits:nope", "no attribute"),
        ("tests.processes.test_engine:GLOBAL_BATCH", "not callable"),
        ("tests.processes.test_engine:_needs_args", "missing argument .x.: _needs_args\\(x\\) has no default"),
        ("tests.processes.test_engine:_raises", "cannot build"),
        ("tests.processes.test_engine:_not_a_setup", "expected shoal.TrainingSetup"),
        ("tests.processes.test_engine:_bad_setup", "not parameters of the model"),
    ],
)
def test_load_entrypoint_errors(entrypoint, message):
    with pytest.raises(EntrypointError, match=message):
        load_entrypoint(entrypoint, 0)


def test_load_entrypoint_seeds_identically():
    a = load_entrypoint("shoal.examples.digits:build", 3)
    b = load_entrypoint("shoal.examples.digits:build", 3)
    c = load_entrypoint("shoal.examples.digits:build", 4)
    assert state_digest(a.model) == state_digest(b.model) != state_digest(c.model)
    assert len(a.dataset) == 5000


def test_digits_example_learns():
    from shoal.examples.digits import train_locally

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only contend on a shared box
    try:
        history = train_locally(epochs=2, log=lambda line: None)
    finally:
        torch.set_num_threads(threads)
    assert history[1]["train_loss"] < history[0]["train_loss"] < 2.3  # ln(10): chance level
    assert history[1]["loss"] < 1.0
    assert history[1]["accuracy"] > 0.7  # chance is 0.1


# --- real processes: 1 vs 3 ranks, a death, a joiner ---------------------------------------------
STEPS, FAIL_AT = 9, 4


def _child(role: str, rank: int, job: str, outdir: str) -> None:
    from shoal.core.connection import connect
    from shoal.worker import process_group as pg
    from shoal.worker.data import DataOrder, contiguous_table, round_robin_table
    from shoal.worker.transfer import broadcast_state, resync_state
    from shoal.worker.errors import StateMismatch

    torch.set_num_threads(1)  # 4 processes share 2 cores: intra-op threads only contend
    client = connect(os.environ["REDIS_URL"], timeout=10)
    rendezvous = pg.Rendezvous(client, job)
    setup = load_entrypoint("shoal.examples.digits:build", 99 if role == "joiner" else 0)
    engine = StepEngine.from_setup(setup)
    order = DataOrder(len(setup.dataset), 0, GLOBAL_BATCH)
    out: dict[str, object] = {"role": role, "rank": rank, "initial": state_digest(setup.model)}
    state = {"step": 0, "cursor": 0}

    def run(until: int, generation: int, table) -> None:
        while state["step"] < until:
            batch = order.batch(state["cursor"])
            engine.step(batch.for_rank(table[dist_rank()]), batch.count, generation)
            state["step"], state["cursor"] = state["step"] + 1, batch.next_cursor

    def dist_rank() -> int:
        return engine.group.rank

    def save(name: str) -> None:
        torch.save(setup.model.state_dict(), os.path.join(outdir, name))

    if role == "elastic":
        engine.group = rendezvous.join(1, rank, 3, 90, collective_timeout=30)
        run(FAIL_AT, 1, contiguous_table(GLOBAL_BATCH, 3))
        out["digest_k"] = state_digest(setup.model)
        if rank == 0:
            save("el_k.pt")
        if rank == 2:
            os._exit(17)  # dies while its peers are in step FAIL_AT
        t0 = time.monotonic()
        try:
            run(FAIL_AT + 1, 1, contiguous_table(GLOBAL_BATCH, 3))
            out["abort"] = "step was applied"
        except StepAborted as exc:
            out["abort"] = type(exc).__name__
        out["abort_s"] = time.monotonic() - t0
        out["after_abort"] = state_digest(setup.model)
        out["grads_none"] = all(p.grad is None for p in setup.model.parameters())
        out["step_after_abort"] = state["step"]
        rendezvous.close_joined()

    # generation 2: the two survivors keep ranks 0 and 1, the fresh joiner is rank 2
    engine.group = rendezvous.join(2, rank, 3, 90, collective_timeout=30)
    committed = state["step"] if role == "elastic" else -1
    src, extra = resync_state(setup.model, setup.optimizer, dict(state), committed, group=engine.group)
    state.update(step=extra["step"], cursor=extra["cursor"])
    out.update(src=src, extra=extra, resynced=state_digest(setup.model))
    table = round_robin_table(GLOBAL_BATCH, 3)
    batch = order.batch(state["cursor"])
    stale = [] if rank == 0 else batch.for_rank(table[rank])  # rank 0 acts on a stale table
    try:
        engine.step(stale, batch.count, 2)
        out["inconsistent"] = "applied"
    except InconsistentStep:
        out["inconsistent"] = "InconsistentStep"
    out["after_inconsistent"] = state_digest(setup.model)
    # slices that add up to the batch, but rank 1 took its own from another generation's table
    # (a re-slice it switched to alone): the table check in the tail refuses it on every rank
    try:
        engine.step(batch.for_rank(table[rank]), batch.count, 3 if rank == 1 else 2,
                    base_generation=3 if rank == 1 else 2)
        out["mixed_tables"] = "applied"
    except InconsistentStep:
        out["mixed_tables"] = "InconsistentStep"
    out["after_mixed_tables"] = state_digest(setup.model)
    res = engine.step(batch.for_rank(table[rank]), batch.count, 3 if rank == 1 else 2)
    out["max_generation"] = res.max_generation
    state["step"], state["cursor"] = state["step"] + 1, batch.next_cursor
    run(STEPS, 2, table)
    out["final"] = state_digest(setup.model)
    if rank == 0:
        save("el_n.pt")
    # a receiver whose model differs in structure: everyone refuses, nobody hangs
    other = nn.Linear(3, 3) if role == "joiner" else setup.model
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1) if role == "joiner" else setup.optimizer
    try:
        broadcast_state(other, other_opt, {}, src=0, group=engine.group)
        out["mismatch"] = "accepted"
    except StateMismatch:
        out["mismatch"] = "StateMismatch"
    out["after_mismatch"] = state_digest(setup.model)
    rendezvous.close_joined()
    print("RESULT " + json.dumps(out), flush=True)


def _reference_run(outdir: Path) -> dict[str, str]:
    """The uninterrupted single-process run (no process group: plain local math)."""
    from shoal.worker.data import DataOrder

    setup = load_entrypoint("shoal.examples.digits:build", 0)
    engine = StepEngine.from_setup(setup, require_group=False)
    order = DataOrder(len(setup.dataset), 0, GLOBAL_BATCH)
    out, cursor = {"initial": state_digest(setup.model)}, 0
    torch.save(setup.model.state_dict(), outdir / "init.pt")
    for step in range(STEPS):
        if step == FAIL_AT:
            torch.save(setup.model.state_dict(), outdir / "ref_k.pt")
        batch = order.batch(cursor)
        engine.step(batch.indices, batch.count, 0)
        cursor = batch.next_cursor
    torch.save(setup.model.state_dict(), outdir / "ref_n.pt")
    out["final"] = state_digest(setup.model)
    return out


@pytest.mark.slow
def test_elastic_three_rank_training_matches_one_process(job_id, subprocess_env, tmp_path):
    """1 process vs 3 processes: same parameters (rtol 1e-4) after FAIL_AT steps; then rank 2
    dies during a step: the survivors abort it without applying anything, a new worker with
    different initial weights joins generation 2, receives the survivors' state, the step is
    redone, and after STEPS steps the parameters still match the uninterrupted 1-process run."""
    roles = [("elastic", r) for r in range(3)] + [("joiner", 2)]
    env = dict(subprocess_env, OMP_NUM_THREADS="1")
    procs = [
        (role, rank, subprocess.Popen(
            [sys.executable, "-m", __name__, "child", role, str(rank), job_id, str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
        for role, rank in roles
    ]
    results: dict[tuple[str, int], dict] = {}
    try:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            ref = _reference_run(tmp_path)  # while the children start up
        finally:
            torch.set_num_threads(threads)
        for role, rank, p in procs:
            stdout, stderr = p.communicate(timeout=150)
            if (role, rank) == ("elastic", 2):
                assert p.returncode == 17, stderr[-3000:]
                continue
            assert p.returncode == 0, f"{role} {rank}: {stderr[-3000:]}"
            line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1]
            results[(role, rank)] = json.loads(line[len("RESULT "):])
    finally:
        for _, _, p in procs:
            if p.poll() is None:
                p.kill()

    init = torch.load(tmp_path / "init.pt")

    def close(a: str, b: str) -> None:
        sa, sb = torch.load(tmp_path / a), torch.load(tmp_path / b)
        assert sa.keys() == sb.keys() == init.keys()
        for k in sa:
            assert torch.allclose(sa[k], sb[k], rtol=1e-4, atol=1e-6), k
        # stricter, relative to how far training moved the weights (a 1/64 error in the
        # gradient scale would be ~1e-2 of the movement; float summation order gives ~1e-6)
        moved = max((sa[k] - init[k]).abs().max().item() for k in sa)
        off = max((sa[k] - sb[k]).abs().max().item() for k in sa)
        assert moved > 1e-3 and off <= 1e-4 * moved, (off, moved)

    survivors = [results[("elastic", 0)], results[("elastic", 1)]]
    joiner = results[("joiner", 2)]
    gen2 = survivors + [joiner]
    assert ref["final"] != ref["initial"]  # training moved the weights
    assert survivors[0]["initial"] == ref["initial"]
    close("ref_k.pt", "el_k.pt")  # 1 vs 3 ranks, no failure
    for s in survivors:
        assert s["abort"] == "StepAborted"
        assert s["abort_s"] < 20, "death must be noticed from the closed connection, not the 30 s timeout"
        assert s["after_abort"] == s["digest_k"] and s["grads_none"] and s["step_after_abort"] == FAIL_AT
    assert survivors[0]["digest_k"] == survivors[1]["digest_k"]
    assert joiner["initial"] != survivors[0]["initial"]  # the joiner really started elsewhere
    for g in gen2:
        assert g["src"] == 0 and g["extra"] == {"step": FAIL_AT, "cursor": FAIL_AT * GLOBAL_BATCH}
        assert g["resynced"] == survivors[0]["digest_k"]
        assert g["inconsistent"] == "InconsistentStep" and g["after_inconsistent"] == g["resynced"]
        assert g["mixed_tables"] == "InconsistentStep" and g["after_mixed_tables"] == g["resynced"]
        assert g["max_generation"] == 3
        assert g["mismatch"] == "StateMismatch" and g["after_mismatch"] == g["final"]
    assert len({g["final"] for g in gen2}) == 1  # replicas bit-identical
    close("ref_n.pt", "el_n.pt")  # the failure and the joiner did not change the trajectory


# --- catch_up_state: only the ranks behind receive, the others go on ---------------------------
def _catchup_child(rank: int, job: str) -> None:
    from shoal.core.connection import connect
    from shoal.worker import process_group as pg
    from shoal.worker.data import contiguous_table
    from shoal.worker.transfer import catch_up_state
    from shoal.worker.errors import StateMismatch

    torch.set_num_threads(1)
    client = connect(os.environ["REDIS_URL"], timeout=10)
    s = small_setup(seed=7 if rank == 2 else 0)  # rank 2 joins with other weights, no optimizer state
    engine = StepEngine.from_setup(s, require_group=True)
    step = -1 if rank == 2 else 3
    if rank < 2:  # two survivors with identical histories (the same local steps)
        local = StepEngine.from_setup(s, require_group=False)
        for i in range(3):
            local.step(list(range(8 * i, 8 * i + 8)), 8, 0)
    out: dict[str, object] = {"rank": rank}
    rendezvous = pg.Rendezvous(client, job)
    group = engine.group = rendezvous.join(1, rank, 3, 60, collective_timeout=30)
    src, extra, behind = catch_up_state(s.model, s.optimizer, {"step": step, "cursor": 7 * (step + 1)}, step,
                                        group=group)
    out.update(src=src, extra=extra, behind=behind, caught_up=state_digest(s.model))
    # the first step: the ranks behind take no samples, the others split the batch
    ready = [r for r in range(3) if r not in behind]
    ranges = [] if rank in behind else contiguous_table(16, len(ready))[ready.index(rank)]
    from shoal.worker.data import rank_slice

    engine.step(rank_slice(list(range(16)), ranges), 16, 1)
    engine.step(rank_slice(list(range(16, 32)), contiguous_table(16, 3)[rank]), 16, 1)
    out["trained"] = state_digest(s.model)
    out["adam_steps"] = sorted({int(v["step"]) for v in s.optimizer.state.values()})
    # everyone equal: nothing moves
    _, _, out["behind_when_equal"] = catch_up_state(s.model, s.optimizer, {"step": 5}, 5, group=group)
    # a rank whose model differs in structure: every rank refuses, nobody hangs
    other = nn.Linear(3, 3) if rank == 1 else s.model
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1) if rank == 1 else s.optimizer
    try:
        catch_up_state(other, other_opt, {"step": 6}, 6 if rank == 0 else 5, group=group)
        out["mismatch"] = "accepted"
    except StateMismatch:
        out["mismatch"] = "StateMismatch"
    out["after_mismatch"] = state_digest(s.model)
    rendezvous.close_joined()
    print("RESULT " + json.dumps(out), flush=True)


@pytest.mark.slow
def test_catch_up_moves_state_only_to_the_ranks_behind(job_id, subprocess_env):
    results = run_ranks(__name__, "catchup", 3, job_id, subprocess_env)
    survivors, joiner = results[:2], results[2]
    for r in results:
        assert r["src"] == 0 and r["behind"] == [2] and r["behind_when_equal"] == []
        assert r["caught_up"] == survivors[0]["caught_up"]  # the joiner holds the survivors' state
        assert r["trained"] == survivors[0]["trained"]  # and stays bit-identical while training
        assert r["mismatch"] == "StateMismatch" and r["after_mismatch"] == r["trained"]
        assert r["adam_steps"] == [5]  # optimizer state (Adam's step counts) came along
    assert joiner["extra"] == {"step": 3, "cursor": 28}  # the source's extra
    assert survivors[1]["extra"] == {"step": 3, "cursor": 28}


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "child":
        _child(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    elif len(sys.argv) == 4 and sys.argv[1] == "catchup":
        _catchup_child(int(sys.argv[2]), sys.argv[3])
    else:
        sys.exit("usage: test_engine.py child ROLE RANK JOB_ID OUTDIR")
