"""DiLoCo's pieces on their own: the spec's options and refusals, the outer Nesterov step
against torch's SGD, the outer gradient's wire formats (their error against fp32, bounded),
and one round of the layout on a real gloo group of one (the round's arithmetic and its
rollback when the outer exchange fails)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from shoal.core.errors import ConfigError
from shoal.core.jobspec import parse_spec
from shoal.worker import outer
from shoal.worker.layout_diloco import OUTER_STATE, inner_batches, inner_step_count
from tests.entrypoints import Points

BASE = {"name": "d", "sync": "diloco"}


# --- the spec ---------------------------------------------------------------------------------
def test_diloco_defaults_and_a_round_of_samples() -> None:
    spec = parse_spec(dict(BASE, global_batch_size=32))
    options = spec.diloco_options
    assert (options.inner_steps, options.outer_lr, options.outer_momentum, options.outer_dtype) == (50, 0.7, 0.9, "fp32")
    assert spec.step_samples == spec.shard_space == 50 * 32
    custom = parse_spec(dict(BASE, global_batch_size=32, diloco={"inner_steps": 4, "outer_dtype": "int8"}))
    assert custom.step_samples == 128 and custom.diloco_options.outer_dtype == "int8"
    plain = parse_spec({"name": "p", "global_batch_size": 32})
    assert plain.diloco_options is None and plain.step_samples == plain.shard_space == 32


@pytest.mark.parametrize(("fields", "says"), [
    ({"shard_size": 2, "min_workers": 2, "max_workers": 4}, "sync: diloco needs shard_size 1"),
    ({"precision": "fp16"}, "precision fp16"),
    ({"compile": True}, "compile is not supported with sync: diloco"),
    ({"diloco": {"inner_steps": 0}}, "inner_steps"),
    ({"diloco": {"outer_dtype": "int4"}}, "outer_dtype"),
    ({"diloco": {"outer_momentum": 1.0}}, "outer_momentum"),
    ({"diloco": {"inner_step": 5}}, "inner_step"),
    ({"sync": "step", "diloco": {"inner_steps": 5}}, "diloco options apply to sync: diloco"),
    ({"sync": "gossip"}, "sync"),
])
def test_a_bad_diloco_spec_is_refused_in_one_line(fields: dict, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_spec(dict(BASE, **fields))
    message = str(caught.value)
    assert says in message and "\n" not in message, message


# --- the outer optimizer ----------------------------------------------------------------------------
def test_the_outer_step_is_torchs_nesterov_sgd() -> None:
    g = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=g)
    ref = nn.Parameter(start.clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    mine, buf = start.clone(), torch.zeros(1000)
    for _ in range(5):
        grad = torch.randn(1000, generator=g)
        ref.grad = grad.clone()
        sgd.step()
        outer.nesterov_step(mine, grad, buf, lr=0.7, momentum=0.9)
        torch.testing.assert_close(mine, ref.detach(), rtol=0, atol=0)
        torch.testing.assert_close(buf, sgd.state[ref]["momentum_buffer"], rtol=0, atol=0)


# --- the wire formats ---------------------------------------------------------------------------------
#: the bound each format's relative L2 error must stay under (measured: see the test's output)
BOUNDS = {"fp32": 0.0, "bf16": 4e-3, "int8": 3e-2}


def _deltas(members: int = 3, n: int = 200_003) -> list[torch.Tensor]:
    """Outer-gradient-like vectors: heavy-tailed values whose scale varies along the vector."""
    g = torch.Generator().manual_seed(7)
    scale = torch.exp(torch.randn(n, generator=g))
    return [torch.randn(n, generator=g) * scale * 1e-3 for _ in range(members)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_each_wire_format_round_trips_within_its_bound(dtype: str) -> None:
    delta = _deltas(1)[0]
    back = outer.decode(outer.encode(delta, dtype, 256), dtype, 256, delta.numel())
    error = outer.relative_error(back, delta)
    print(f"outer_dtype={dtype} relative_error={error:.3g} bytes_per_value="
          f"{outer.wire_bytes(delta.numel(), dtype, 256) / delta.numel():.3f}")
    assert error <= BOUNDS[dtype]
    if dtype == "int8":  # per value: at most half a step of its block's scale
        blocks = torch.nn.functional.pad(delta, (0, -delta.numel() % 256)).view(-1, 256)
        step = (blocks.abs().amax(1) / 127).repeat_interleave(256)[: delta.numel()]
        assert bool(((back - delta).abs() <= step / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_the_weighted_mean_of_three_members_is_within_the_bound(dtype: str) -> None:
    deltas, counts = _deltas(3), [40.0, 40.0, 20.0]
    exact = sum(c * d.double() for c, d in zip(counts, deltas)) / sum(counts)
    messages = [outer.pack(d, torch.tensor([0.0, 1.5, c]), dtype, 256) for d, c in zip(deltas, counts)]
    total, tails = outer.combine(messages, dtype, 256, deltas[0].numel())
    assert tails.tolist() == [0.0, 4.5, 100.0]
    error = outer.relative_error(total / tails[-1], exact.float())
    print(f"outer_dtype={dtype} mean_of_3_relative_error={error:.3g}")
    assert error <= max(BOUNDS[dtype], 1e-6)
    # the same messages give the same bits (every member sums them in rank order)
    again, _ = outer.combine([m.clone() for m in messages], dtype, 256, deltas[0].numel())
    assert torch.equal(again, total)


def test_a_member_with_no_samples_adds_nothing() -> None:
    delta = torch.ones(10)
    messages = [outer.pack(delta, torch.tensor([0.0, 0.0, 0.0]), "int8", 16),
                outer.pack(delta * 2, torch.tensor([1.0, 3.0, 5.0]), "int8", 16)]
    total, tails = outer.combine(messages, "int8", 16, 10)
    torch.testing.assert_close(total, delta * 10)
    assert tails.tolist() == [1.0, 3.0, 5.0]


def test_a_slice_is_cut_in_h_inner_batches() -> None:
    assert inner_batches(list(range(10)), 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert inner_batches([5, 6], 4) == [[5], [6]]
    assert inner_batches([], 3) == []
    assert inner_batches([1, 2], 0) == []


def test_a_short_round_keeps_the_inner_batch_size() -> None:
    # H=50, global batch 64: a full round's slice of 3 members is 50 inner steps
    assert [inner_step_count(n, 3, 64, 50) for n in (1066, 1067)] == [50, 50]
    # an epoch's short last round (200 samples over 2 members): ~32 a step, not 50 steps of 2
    assert inner_step_count(100, 2, 64, 50) == 3
    # a dead member's third taken over by 2 survivors, half each: about half a round
    assert inner_step_count(533, 2, 64, 50) == 17
    assert inner_step_count(0, 2, 64, 50) == 0 and inner_step_count(3, 2, 64, 50) == 1


# --- one round on a real gloo group of one ------------------------------------------------------
def _layout(group, **diloco):
    from shoal.core.jobspec import DilocoOptions
    from shoal.worker.layout import LayoutOptions
    from shoal.worker.layout_diloco import Diloco

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    options = LayoutOptions(device=torch.device("cpu"), diloco=DilocoOptions(**diloco), global_batch=6)
    layout = Diloco(model, torch.optim.AdamW(model.parameters(), lr=0.01), Points(48),
                    options=options, loss_fn=nn.CrossEntropyLoss(reduction="sum"))
    layout.group = group
    return layout


def _reference_round(layout, indices: list[int], h: int, buf: torch.Tensor | None):
    """The same round by hand: H AdamW steps on a copy, then torch's Nesterov SGD."""
    model = copy.deepcopy(layout.model)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = copy.deepcopy(layout.optimizer.state_dict())  # load_state_dict would share its tensors
    inner.load_state_dict({"state": {k: v for k, v in state["state"].items() if k != OUTER_STATE},
                           "param_groups": state["param_groups"]})
    start = [p.detach().clone() for p in model.parameters()]
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    for part in inner_batches(indices, h):
        x = torch.stack([layout.dataset[i][0] for i in part])
        y = torch.stack([layout.dataset[i][1] for i in part])
        (loss_fn(model(x), y) / len(part)).backward()
        inner.step()
        inner.zero_grad()
    global_params = [nn.Parameter(s.clone()) for s in start]
    sgd = torch.optim.SGD(global_params, lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    if buf is not None:
        offset = 0
        for p in global_params:
            sgd.state[p]["momentum_buffer"] = buf[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
    for p, s, local in zip(global_params, start, model.parameters()):
        p.grad = s - local.detach()
    sgd.step()
    return torch.cat([p.detach().reshape(-1) for p in global_params])


@pytest.fixture
def solo_group(tmp_path):
    """A real gloo group of one rank (a FileStore), closed after the test."""
    import torch.distributed as dist

    from shoal.worker import torch_compat as tc
    from shoal.worker.process_group import Group

    store = dist.FileStore(str(tmp_path / "store"), 1)
    torch_group = tc.new_gloo_group(store, 0, 1, 30.0, "127.0.0.1")
    group = Group("j", 1, 0, 1, "gloo", torch.device("cpu"), store, 30.0, torch_group, registered=False)
    yield group
    group.close()


def test_two_rounds_match_a_reference_computation(solo_group) -> None:
    layout = _layout(solo_group, inner_steps=4)
    buf = None
    for cursor in (0, 24):
        indices = list(range(cursor, cursor + 24))
        want = _reference_round(layout, indices, 4, buf)
        result = layout.step(indices, 24, 1, base_generation=1, world_size=1)
        assert result.count == 24 and result.local_count == 24
        torch.testing.assert_close(layout._flat(), want, rtol=1e-5, atol=1e-6)
        buf = layout.optimizer.state[OUTER_STATE]["momentum_buffer"].clone()
        assert buf.abs().sum() > 0
    # the outer momentum travels with the optimizer's state dict (catch-up, checkpoints)
    assert OUTER_STATE in layout.optimizer.state_dict()["state"]


def test_a_failed_outer_exchange_rolls_the_whole_round_back(solo_group) -> None:
    from shoal.worker.errors import StepAborted

    layout = _layout(solo_group, inner_steps=3, outer_dtype="int8")
    layout.step(list(range(12)), 12, 1, base_generation=1, world_size=1)  # a first round: state exists
    before = copy.deepcopy(layout.optimizer.state_dict())
    weights = layout._flat()
    solo_group.request_abort("a peer died (test)")
    with pytest.raises(StepAborted, match="round aborted, nothing applied"):
        layout.step(list(range(12, 24)), 12, 1, base_generation=1, world_size=1)
    assert torch.equal(layout._flat(), weights)
    after = layout.optimizer.state_dict()
    for key, state in before["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(after["state"][key][name]), torch.as_tensor(value)), (key, name)


def test_the_outer_momentum_survives_a_checkpoint_in_a_real_store(solo_group, tmp_path) -> None:
    """The outer state rides in the optimizer's state dict: a checkpoint written to a file://
    store and loaded back (weights_only, verified) restores it into another layout, which then
    takes the same next round bit for bit."""
    from shoal.storage.checkpoint import load_latest, save_checkpoint
    from shoal.storage.uri import open_store

    layout = _layout(solo_group, inner_steps=3)
    layout.step(list(range(12)), 12, 1, base_generation=1, world_size=1)
    store = open_store(f"file://{tmp_path / 'ckpt'}")
    save_checkpoint(store, layout.checkpoint(0, step=1, epoch=0, data_cursor=12, generation=1, world_size=1),
                    hmac_key=None)
    state, _ = load_latest(store, hmac_key=None)
    other = _layout(solo_group, inner_steps=3)
    torch.nn.init.zeros_(other.model[0].weight)  # not the saved weights: the resume must bring them
    other.resume(state, lambda: state)
    assert torch.equal(other.optimizer.state[OUTER_STATE]["momentum_buffer"],
                       layout.optimizer.state[OUTER_STATE]["momentum_buffer"])
    layout.step(list(range(12, 24)), 12, 1, base_generation=1, world_size=1)
    other.step(list(range(12, 24)), 12, 1, base_generation=1, world_size=1)
    assert torch.equal(other._flat(), layout._flat())


# --- the exchange in pieces -----------------------------------------------------------------------
def _both_ranks(fn, timeout: float = 60) -> None:
    """Run ``fn(0)`` and ``fn(1)`` in two threads (the two members of a group) and wait for both."""
    threads = [threading.Thread(target=fn, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def test_a_piece_is_what_the_floor_rate_carries_in_the_collective_timeout() -> None:
    assert outer.piece_bytes(65.0) == 65 * outer.FLOOR_RATE  # the default step_timeout's groups
    assert outer.piece_bytes(0.5) == outer.MIN_PIECE and outer.piece_bytes(86400.0) == outer.MAX_PIECE
    with pytest.raises(ValueError, match="must be positive"):
        outer.piece_bytes(0.0)
    assert outer.spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert outer.spans(8, 4) == [(0, 4), (4, 8)] and outer.spans(0, 4) == []
    # only gloo's ring all-reduce waits piece by piece on its own
    assert outer.waits_by_segment("gloo", "fp32")
    assert not any(outer.waits_by_segment(b, d) for b, d in (("gloo", "bf16"), ("gloo", "int8"), ("nccl", "fp32")))


@pytest.fixture
def pair_groups(tmp_path, request):
    """Two real gloo groups of one group of two ranks (one FileStore), closed after the test;
    each rank's collective timeout from an indirect parameter (default 30 s each)."""
    import torch.distributed as dist

    from shoal.worker import torch_compat as tc
    from shoal.worker.process_group import Group

    timeouts = getattr(request, "param", (30.0, 30.0))
    made: dict[int, Group] = {}

    def make(rank: int) -> None:
        store = dist.FileStore(str(tmp_path / "store"), 2)
        tg = tc.new_gloo_group(store, rank, 2, timeouts[rank], "127.0.0.1")
        made[rank] = Group("j", 1, rank, 2, "gloo", torch.device("cpu"), store, timeouts[rank], tg, registered=False)

    _both_ranks(make)
    assert len(made) == 2, "the group of two did not form"
    yield made[0], made[1]
    for g in made.values():
        g.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_an_exchange_in_pieces_is_the_exchange_in_one(pair_groups, monkeypatch, dtype: str) -> None:
    """Two ranks exchange outer gradients in pieces of 1 KB (a few hundred collectives): each
    rank gets the same sum, and the same bits as the whole messages combined at once."""
    calls = {"all_reduce": 0, "all_gather": 0}
    for g in pair_groups:
        for name in calls:
            real = getattr(g, name)

            def counted(*args, _real=real, _name=name, **kwargs):
                calls[_name] += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(g, name, counted)
    monkeypatch.setattr(outer, "piece_bytes", lambda timeout: 1024)
    # gloo's fp32 all-reduce goes whole (it waits segment by segment on its own): its pieces
    # are NCCL's, cut here over gloo
    monkeypatch.setattr(outer, "waits_by_segment", lambda backend, dtype: False)
    gen = torch.Generator().manual_seed(3)
    deltas = [torch.randn(50_000, generator=gen) for _ in range(2)]
    counts = [7.0, 5.0]
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def exchange(rank: int) -> None:
        layout = _layout(pair_groups[rank], inner_steps=2, outer_dtype=dtype, outer_block=64)
        tail = torch.tensor([0.0, 1.5, counts[rank]])
        results[rank] = layout._reduce(pair_groups[rank], deltas[rank].clone(), tail)

    _both_ranks(exchange, 120)
    assert len(results) == 2
    (total0, tails0), (total1, tails1) = results[0], results[1]
    assert torch.equal(total0, total1) and torch.equal(tails0, tails1)
    assert tails0.tolist() == [0.0, 3.0, 12.0]
    if dtype == "fp32":
        assert calls["all_reduce"] == 2 * -(-(50_000 + outer.TAIL) * 4 // 1024)
        torch.testing.assert_close(total0, deltas[0] * 7 + deltas[1] * 5)
    else:
        messages = [outer.pack(deltas[r], torch.tensor([0.0, 1.5, counts[r]]), dtype, 64) for r in (0, 1)]
        assert calls["all_gather"] == 2 * -(-messages[0].numel() // 1024)
        want, _ = outer.combine(messages, dtype, 64, 50_000)
        assert torch.equal(total0, want)


@pytest.mark.parametrize("pair_groups", [(3.0, 100.0)], indirect=True, ids=["3s-100s"])
def test_members_whose_groups_have_different_timeouts_cut_the_same_pieces(pair_groups) -> None:
    """A group's timeout has a part scaled by each member's own state (a joiner without
    optimizer state gets a smaller one): the pieces follow the spec's collective timeout,
    the same on every member. Cut by each group's own (375 KB vs 12.5 MB here), the members'
    collectives would not match."""
    from shoal.worker.layout import GroupSettings

    delta = torch.ones(800_000)  # 800 KB in int8: 3 pieces at 3 s, 1 at 100 s
    results: dict[int, torch.Tensor] = {}

    def exchange(rank: int) -> None:
        layout = _layout(pair_groups[rank], inner_steps=2, outer_dtype="int8")
        layout.groups = GroupSettings(rendezvous=None, keys=None, worker_id=lambda: "", rdzv_timeout=1.0,
                                      collective_timeout=3.0)
        results[rank] = layout._reduce(pair_groups[rank], delta.clone(), torch.tensor([0.0, 0.0, 1.0]))[0]

    _both_ranks(exchange)
    assert len(results) == 2, "the exchange failed: the members cut different pieces"
    assert torch.equal(results[0], torch.full((800_000,), 2.0)) and torch.equal(results[1], results[0])
