"""The prefetching input pipeline (worker/prefetch.py): its plan and keys, against a real
small dataset whose samples name their own index, so any wrong or stale batch shows.

Loaders run for real: forked processes and the thread mode. No Redis."""

from __future__ import annotations

import os
import signal

import numpy as np
import psutil
import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

from shoal.worker.data import DataOrder, NormalRanges, micro_batches
from shoal.worker.engine import StepEngine
from shoal.worker.errors import UserCodeError
from shoal.worker.prefetch import INLINE_TENSOR_BYTES, PLAN_MEMO_STEPS, ItemKey, Prefetcher, _BatchPickler, plan
from tests.helpers import wait_until

N, B, SEED = 50, 8, 7


class Indexed(torch.utils.data.Dataset):
    """Sample ``i`` is ``(tensor([i.]), i)``: a batch says which samples it holds."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), torch.tensor(i)


class CorruptAt(Indexed):
    def __getitem__(self, i: int):
        if i == self.bad:
            raise ValueError(f"corrupt sample {i}")  # the line the message must name
        return super().__getitem__(i)

    def __init__(self, bad: int) -> None:
        self.bad = bad


def indices_of(batch) -> list[int]:
    return batch[1].tolist()


def expected(cursor: int, ranges, micro_batch: int | None, *, n: int = N, seed: int = SEED,
             b: int = B) -> list[list[int]]:
    local = DataOrder(n, seed, b).batch(cursor).for_rank(ranges)
    return [c.tolist() for c in micro_batches(local, micro_batch)]


@pytest.fixture(params=["fork", "thread"])
def make(request):
    made: list[Prefetcher] = []

    def build(dataset=None, **kw) -> Prefetcher:
        kw = {"micro_batch": 3, "steps": 2, "workers": 2 if request.param != "thread" else 0} | kw
        p = Prefetcher(dataset if dataset is not None else Indexed(), default_collate, num_samples=N, seed=SEED,
                       global_batch=B, start_method=request.param if request.param != "thread" else None, **kw)
        made.append(p)
        return p

    yield build
    for p in made:
        p.close()


def run_step(p: Prefetcher, cursor: int, ranges, later=None, micro_batch: int | None = 3) -> list[list[int]]:
    """What a step of the engine fetches: every micro-batch of this rank's slice, in order."""
    p.start_step(cursor, ranges, later)
    return [indices_of(p.fetch(chunk)) for chunk in expected(cursor, ranges, micro_batch)]


# ---- the plan ---------------------------------------------------------------------------------

def test_the_plan_splits_a_slice_as_the_engine_does() -> None:
    ranges = [[1, 8, 1]]
    local = DataOrder(N, SEED, B).batch(0).for_rank(ranges)
    asked: list[list[int]] = []

    def recording(indices):
        asked.append(list(indices))
        return default_collate([Indexed()[i] for i in indices])

    model = nn.Linear(1, N)
    engine = StepEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), Indexed(), micro_batch=3,
                        loss_fn=nn.CrossEntropyLoss(reduction="sum"), require_group=False)
    engine.fetcher = recording
    engine.step(local, len(local), 0)  # alone: its slice is the whole step
    planned = plan(DataOrder(N, SEED, B), 0, ranges, 1, 3)
    assert asked == [list(idx) for _, idx in planned] and len(asked) == 3  # 7 samples: 3 + 3 + 1
    assert [k for k, _ in planned] == [ItemKey(0, ((1, 8, 1),), m) for m in range(3)]


def test_the_plan_follows_the_cursor_across_an_epochs_short_last_batch() -> None:
    order = DataOrder(N, SEED, B)  # 50 samples, batches of 8: the 7th step of an epoch has 2
    items = plan(order, 40, [[0, 4, 1]], 4, None, end=70)
    cursors = [k.cursor for k, _ in items]
    assert cursors == [40, 48, 50, 58]  # 48 + 2 (short) = 50: the next epoch starts at its offset 0
    assert [list(idx) for _, idx in items] == [expected(c, [[0, 4, 1]], None)[0] for c in cursors]
    assert len(items[1][1]) == 2  # this rank's part of the short batch: the 2 positions that exist
    assert [k.cursor for k, _ in plan(order, 40, [[0, 4, 1]], 4, None, end=50)] == [40, 48]  # not past the end
    assert plan(order, 48, [[4, 8, 1]], 1, None) == []  # a short batch can leave a rank nothing


def test_a_memo_cuts_each_steps_slice_once_and_plans_the_same_items(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefetcher plans the next steps again after every commit: with its memo each step's
    slice is cut once (a streaming dataset's per-step ranges made that a visible cost), and
    the items are those planned without it - whatever the ranges, an epoch's end included."""
    import shoal.worker.data as data_mod

    order = DataOrder(N, SEED, B)
    cuts: list[int] = []
    real = data_mod.rank_slice
    monkeypatch.setattr(data_mod, "rank_slice", lambda batch, ranges: cuts.append(1) or real(batch, ranges))
    per_step = lambda batch: NormalRanges((((batch.cursor // B) % 3, 8, 2),))  # noqa: E731 - changes per step
    memo: dict = {}
    cursor, steps = 0, 0
    while cursor < 3 * N:
        first = [[0, 5, 1]] if steps % 4 == 0 else None
        for ranges in (per_step, [[1, 7, 1]]):
            with_memo = plan(order, cursor, ranges, 3, 2, first_ranges=first, memo=memo)
            assert with_memo == plan(order, cursor, ranges, 3, 2, first_ranges=first)
        cursor, steps = order.batch(cursor).next_cursor, steps + 1
    assert len(memo) <= PLAN_MEMO_STEPS
    cuts.clear()
    plan(order, 0, [[1, 7, 1]], 3, 2, memo=memo)
    plan(order, 0, [[1, 7, 1]], 3, 2, memo=memo)
    assert len(cuts) == 3  # the first call cut the 3 steps (the memo had moved on); the second none


def test_the_first_step_of_a_generation_has_its_own_ranges() -> None:
    items = plan(DataOrder(N, SEED, B), 8, [[0, 4, 1]], 2, None, first_ranges=[])
    assert [k for k, _ in items] == [ItemKey(16, ((0, 4, 1),), 0)]  # nothing at 8: a member catching up


# ---- keys and invalidation, with real loaders ----------------------------------------------------

def test_steady_steps_are_all_served_by_the_loaders(make) -> None:
    p = make()
    ranges, cursor = [[0, 7, 1]], 0
    for _ in range(8):  # through an epoch boundary (50 = 6 x 8 + 2)
        assert run_step(p, cursor, ranges) == expected(cursor, ranges, 3)
        cursor = DataOrder(N, SEED, B).batch(cursor).next_cursor
        p.aim(cursor, ranges)  # after the commit
    assert p.misses == 0 and p.hits == sum(len(expected(c, ranges, 3)) for c in (0, 8, 16, 24, 32, 40, 48, 50))


def test_a_generation_change_never_feeds_the_old_slice(make) -> None:
    p = make()
    p.aim(16, [[0, 4, 1]])  # prefetching for rank 0 of 2...
    wait_until(lambda: all(i.state.value == "ready" for i in p._items.values()), 30, "the plan to be fetched")
    # ...but the next generation made this worker rank 1 of 3: same cursor, other positions
    assert run_step(p, 16, [[3, 5, 1]]) == expected(16, [[3, 5, 1]], 3)
    assert p.dropped >= 2  # the old slice's items were dropped, not served
    assert run_step(p, 24, [[3, 5, 1]]) == expected(24, [[3, 5, 1]], 3)


def test_a_redone_step_with_other_ranges_gets_its_new_slice(make) -> None:
    p = make()
    ranges = [[0, 8, 2]]  # round robin, rank 0 of 2
    p.start_step(0, ranges)
    first = expected(0, ranges, 3)[0]
    assert indices_of(p.fetch(first)) == first  # the step aborts after its first micro-batch
    # redone in the next generation, alone: the whole batch; then again with the old ranges
    assert run_step(p, 0, [[0, 8, 1]]) == expected(0, [[0, 8, 1]], 3)
    assert run_step(p, 0, ranges) == expected(0, ranges, 3)  # a consumed item is fetched again


def test_a_request_outside_the_plan_is_fetched_inline(make) -> None:
    p = make()
    p.start_step(0, [[0, 4, 1]])
    stray = [3, 1, 4, 1, 5]
    assert indices_of(p.fetch(stray)) == stray and p.misses == 1


def test_without_prefetch_every_batch_is_inline() -> None:
    p = Prefetcher(Indexed(), default_collate, num_samples=N, seed=SEED, global_batch=B, steps=0, workers=2)
    assert p.mode == "inline" and p.pids == []
    assert run_step(p, 0, [[0, 8, 1]]) == expected(0, [[0, 8, 1]], 3) and p.misses == 3 and p.hits == 0
    p.close()


# ---- errors, dead loaders, shutdown ---------------------------------------------------------------

def _step_error(dataset, fetcher) -> str:
    model = nn.Linear(1, N)
    engine = StepEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset,
                        loss_fn=nn.CrossEntropyLoss(reduction="sum"), require_group=False, micro_batch=3)
    engine.fetcher = fetcher
    local = DataOrder(N, SEED, B).batch(0).indices
    with pytest.raises(UserCodeError) as err:
        engine.step(local, B, 0)
    return str(err.value)


def test_a_dataset_error_in_a_loader_names_the_users_line_as_inline(make) -> None:
    bad = int(DataOrder(N, SEED, B).batch(0).indices[4])
    p = make(CorruptAt(bad))
    p.start_step(0, [[0, B, 1]])
    wait_until(lambda: any(i.state.value == "failed" for i in p._items.values()), 30, "the loader to fail")
    message = _step_error(CorruptAt(bad), p.fetch)
    line = CorruptAt.__getitem__.__code__.co_firstlineno + 2
    assert message == f"training step raised ValueError: corrupt sample {bad} (at {__file__}:{line} in __getitem__)"
    assert message == _step_error(CorruptAt(bad), None)  # word for word what inline fetching says
    assert p.hits == 2  # both from the loaders: the first micro-batch, then the second's error


def test_an_error_in_a_batch_never_consumed_is_never_raised(make) -> None:
    bad = int(DataOrder(N, SEED, B).batch(8).indices[0])
    p = make(CorruptAt(bad))
    p.aim(0, [[0, 4, 1]])  # steps at 0 and 8: the one at 8 fails in a loader
    wait_until(lambda: any(i.state.value == "failed" for i in p._items.values()), 30, "the loader to fail")
    assert run_step(p, 0, [[0, 4, 1]]) == expected(0, [[0, 4, 1]], 3)
    assert run_step(p, 8, [[4, 8, 1]]) == expected(8, [[4, 8, 1]], 3)  # re-planned: another rank has it


def test_a_dead_loader_process_falls_back_to_inline_fetching() -> None:
    p = Prefetcher(Indexed(), default_collate, num_samples=N, seed=SEED, global_batch=B, micro_batch=3,
                   workers=2, steps=2, start_method="fork")
    try:
        assert run_step(p, 0, [[0, 8, 1]]) == expected(0, [[0, 8, 1]], 3)
        os.kill(p.pids[0], signal.SIGKILL)
        wait_until(lambda: p._broken is not None, 30, "the pipeline to see its loader die")
        for cursor in (8, 16):
            assert run_step(p, cursor, [[0, 8, 1]]) == expected(cursor, [[0, 8, 1]], 3)
        assert p.misses >= 3
    finally:
        p.close()


def test_close_ends_every_loader_process() -> None:
    p = Prefetcher(Indexed(), default_collate, num_samples=N, seed=SEED, global_batch=B, workers=3, steps=2,
                   start_method="fork")
    pids = p.pids
    me = psutil.Process()
    assert len(pids) == 3 and {c.pid for c in me.children()} >= set(pids)
    p.start_step(0, [[0, 8, 1]])
    p.close()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
    assert indices_of(p.fetch([1, 2])) == [1, 2]  # closed: inline
    np.testing.assert_array_equal(p.fetch([5])[0].numpy(), [[5.0]])


# ---- visible: the input wait in the heartbeat, status and the progress history -------------------

def test_the_input_wait_reaches_status_and_the_progress_history() -> None:
    import fakeredis

    from shoal.core.jobspec import JobSpec
    from shoal.core.registry import create_job
    from shoal.events.keys import job_keys
    from shoal.events.models import Heartbeat
    from shoal.events.records import WorkerRecord
    from shoal.events.states import WorkerState
    from shoal.ops.status import format_status, job_status
    from shoal.worker.heartbeat import Heartbeater
    from shoal.worker.progress import ProgressRecorder

    r = fakeredis.FakeRedis()
    keys = job_keys("iw")
    create_job(r, JobSpec(name="iw", entrypoint="simulate"))
    r.hset(keys.workers, "w0", WorkerRecord("w0", WorkerState.ACTIVE, pid=5).to_json())
    r.zadd(keys.last_seen, {"w0": 1})
    r.hset(keys.state, mapping={"state": "running", "generation": "1"})
    hb = Heartbeater(r, keys, "w0", interval=0.2, ttl=2.0)
    # what the training worker publishes after a step
    hb.update(step=3, input_wait_time=0.0125, compute_time=0.04, exposed_comm_time=0.002)
    assert hb.beat()
    s = job_status(r, "iw")
    assert s["workers"][0]["input_wait_time"] == 0.0125 and s["workers"][0]["exposed_comm_time"] == 0.002
    assert "w0 40.0 / 12.5 / 2.0" in format_status(s)
    r.set(keys.heartbeat("w0"), Heartbeat(worker_id="w0", step=3).model_dump_json())  # an older worker's
    assert job_status(r, "iw")["workers"][0]["input_wait_time"] is None
    assert "last step, ms" not in format_status(job_status(r, "iw"))
    progress = ProgressRecorder(r, keys)
    assert progress.record(3, 0.5, 1, 2, input_wait=0.25) and progress.record(4, 0.4, 2, 2)
    entries = [f for _id, f in r.xrange(keys.progress)]
    assert entries[0][b"input_wait"] == b"0.25" and b"input_wait" not in entries[1]


def test_a_dataset_spawn_cannot_pickle_gets_one_loader_thread() -> None:
    ds = Indexed()
    ds.transform = lambda x: x  # noqa: E731 - a lambda does not pickle
    p = Prefetcher(ds, default_collate, num_samples=N, seed=SEED, global_batch=B, micro_batch=3, workers=2,
                   start_method="spawn")
    try:
        assert p.mode == "thread" and p.pids == []
        assert run_step(p, 0, [[0, 8, 1]]) == expected(0, [[0, 8, 1]], 3) and p.misses == 0
    finally:
        p.close()


@pytest.mark.parametrize("field", ["loader_workers", "prefetch_steps"])
def test_a_setup_may_override_the_pipeline_within_bounds(field) -> None:
    from shoal.worker.errors import EntrypointError
    from shoal.worker.userapi import TrainingSetup

    model = nn.Linear(1, 2)
    setup = TrainingSetup(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=Indexed(),
                          loss_fn=nn.CrossEntropyLoss(reduction="sum"), **{field: 0})
    setup.validate()
    setattr(setup, field, -1)
    with pytest.raises(EntrypointError, match=field):
        setup.validate()


class Mixed(torch.utils.data.Dataset):
    """Samples holding a small tensor of each kind and one over the inline limit."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        big = torch.full((INLINE_TENSOR_BYTES // 4 + 1,), float(i))  # just over the limit
        return {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3).t() + i,  # not contiguous
                "h": torch.tensor([i], dtype=torch.bfloat16), "flag": torch.tensor(i % 2 == 0),
                "empty": torch.zeros(0, 3, dtype=torch.int64), "big": big, "id": i}


def test_small_tensors_travel_by_value_and_large_ones_through_shared_memory() -> None:
    import pickle

    batch = default_collate([Mixed()[i] for i in range(2)])
    got = pickle.loads(bytes(_BatchPickler.dumps(batch)))
    for k, v in batch.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    assert not got["x"].is_shared() and got["big"].is_shared()  # by value / shared memory
    got["x"].add_(1)  # a writable copy
    lazy = torch.randn(3, dtype=torch.complex64).conj()  # a lazy conjugate: resolved, not lost
    assert torch.equal(pickle.loads(bytes(_BatchPickler.dumps(lazy))), lazy)

    p = Prefetcher(Mixed(), default_collate, num_samples=4, seed=0, global_batch=2, workers=1, steps=2,
                   start_method="fork")
    try:
        p.start_step(0, [[0, 2, 1]])
        (chunk,) = expected(0, [[0, 2, 1]], None, n=4, seed=0, b=2)
        out = p.fetch(chunk)
        assert p.misses == 0  # from the loader process, not inline
        assert out["id"].tolist() == chunk and out["big"].is_shared() and not out["x"].is_shared()
    finally:
        p.close()
