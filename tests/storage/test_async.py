"""Async checkpointing: snapshot isolation, one save in flight, failures reported, LATEST safe."""

from __future__ import annotations

import threading

import pytest
import torch
from tests.storage.support import HookedStore, tiny_state

from shoal.storage.async_saver import AsyncCheckpointer
from shoal.storage.checkpoint import load_latest, save_checkpoint
from shoal.storage.errors import StorageError
from shoal.storage.latest_object import read_latest_step
from shoal.storage.layout import MANIFEST, manifest_key
from shoal.storage.memory import MemoryStore
from shoal.storage.train_state import TrainState

TIMEOUT = 20.0


class Gate:
    """``before_write`` hook: the first write blocks until :meth:`open` is called."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.released = threading.Event()

    def __call__(self, key: str) -> None:
        self.reached.set()
        if not self.released.wait(TIMEOUT):
            raise TimeoutError("test gate never opened")

    def open(self) -> None:
        self.released.set()


def test_save_runs_in_background_and_publishes() -> None:
    gate = Gate()
    store = HookedStore(MemoryStore(), before_write=gate)
    saved = []
    saver = AsyncCheckpointer(store, on_saved=saved.append)
    assert saver.save_async(tiny_state(1)) is True
    assert gate.reached.wait(TIMEOUT)  # the writer thread is blocked inside the store...
    assert saver.in_flight and read_latest_step(store.inner) is None  # ...and we are not
    assert saver.wait(0.05) is False
    gate.open()
    assert saver.wait(TIMEOUT)
    assert saver.last_error is None and saver.saved == 1
    assert [m.step for m in saved] == [1]
    assert load_latest(store)[0].step == 1


def test_snapshot_is_isolated_from_training_mutations() -> None:
    gate = Gate()
    store = HookedStore(MemoryStore(), before_write=gate)
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    expected_w = model.weight.detach().clone()
    expected_buf = opt.state[model.weight]["momentum_buffer"].clone()

    saver = AsyncCheckpointer(store)
    assert saver.save_async(TrainState.capture(model, opt, step=1))
    assert gate.reached.wait(TIMEOUT)
    with torch.no_grad():  # training continues while the save is blocked
        model.weight.add_(100.0)
    opt.state[model.weight]["momentum_buffer"].mul_(-5)
    gate.open()
    assert saver.wait(TIMEOUT) and saver.last_error is None
    state, _ = load_latest(store)
    assert torch.equal(state.model["weight"], expected_w)
    assert torch.equal(state.optimizer["state"][0]["momentum_buffer"], expected_buf)


def test_second_request_is_skipped_while_one_is_in_flight() -> None:
    gate = Gate()
    store = HookedStore(MemoryStore(), before_write=gate)
    saver = AsyncCheckpointer(store)
    assert saver.save_async(tiny_state(1))
    assert gate.reached.wait(TIMEOUT)
    assert saver.save_async(tiny_state(2)) is False
    assert saver.save_async(tiny_state(3), wait_s=0.05) is False
    assert saver.skipped == 2
    gate.open()
    assert saver.save_async(tiny_state(4), wait_s=TIMEOUT) is True  # waits for #1, then runs
    assert saver.wait(TIMEOUT)
    assert saver.saved == 2
    assert load_latest(store)[0].step == 4
    assert store.inner.list("step-000000002") == [] and store.inner.list("step-000000003") == []


def test_failed_save_is_reported_and_latest_not_moved() -> None:
    inner = MemoryStore()
    save_checkpoint(inner, tiny_state(1))

    def fail_on_manifest(key: str) -> None:
        if key.endswith(MANIFEST):
            raise StorageError(f"injected failure writing {key}")

    errors: list[BaseException] = []
    saver = AsyncCheckpointer(HookedStore(inner, before_write=fail_on_manifest), on_error=errors.append)
    assert saver.save_async(tiny_state(2))
    assert saver.wait(TIMEOUT)
    assert isinstance(saver.last_error, StorageError) and "injected" in str(saver.last_error)
    assert errors == [saver.last_error] and saver.failed == 1 and saver.saved == 0
    assert read_latest_step(inner) == 1
    assert not inner.exists(manifest_key(2))
    assert load_latest(inner)[0].step == 1


def test_failing_on_saved_hook_counts_as_failure() -> None:
    def publish(_manifest) -> None:
        raise StorageError("redis down")

    saver = AsyncCheckpointer(MemoryStore(), on_saved=publish)
    assert saver.save_async(tiny_state(1)) and saver.wait(TIMEOUT)
    assert saver.failed == 1 and "redis down" in str(saver.last_error)


def test_close_waits_then_refuses_new_saves() -> None:
    gate = Gate()
    saver = AsyncCheckpointer(HookedStore(MemoryStore(), before_write=gate))
    assert saver.save_async(tiny_state(1))
    assert gate.reached.wait(TIMEOUT)
    assert saver.close(0.05) is False
    gate.open()
    assert saver.close(TIMEOUT) is True
    with pytest.raises(RuntimeError, match="closed"):
        saver.save_async(tiny_state(2))


def test_snapshot_buffers_are_reused_only_when_compatible() -> None:
    live = TrainState(step=1, model={"w": torch.ones(1000), "b": torch.zeros(3)})
    first = live.snapshot()
    assert first.model["w"].data_ptr() != live.model["w"].data_ptr()
    live.model["w"].mul_(3)
    live.model["b"] = torch.zeros(4)  # shape changed: must not reuse
    second = live.snapshot(reuse=first)
    assert second.model["w"].data_ptr() == first.model["w"].data_ptr()
    assert torch.equal(second.model["w"], torch.full((1000,), 3.0))
    assert second.model["b"].shape == (4,)
    # never "reuse" the live tensor itself as the staging buffer
    third = live.snapshot(reuse=live)
    assert third.model["w"].data_ptr() != live.model["w"].data_ptr()


def test_consecutive_async_saves_with_reused_buffers_keep_each_step() -> None:
    store = MemoryStore()
    saver = AsyncCheckpointer(store, keep_last=None)
    model = torch.nn.Linear(64, 64)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(float(step))
        assert saver.save_async(TrainState.capture(model, step=step), wait_s=TIMEOUT)
    assert saver.wait(TIMEOUT) and saver.last_error is None
    from shoal.storage.checkpoint import load_checkpoint

    for step in (1, 2, 3):
        assert torch.equal(load_checkpoint(store, step)[0].model["weight"], torch.full((64, 64), float(step)))


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_copy_tensors_handles_chunks_odd_sizes_and_strided_views(threads: int) -> None:
    from shoal.storage.memcopy import CHUNK, copy_tensors

    srcs = [
        torch.randn(CHUNK // 4 * 3 + 7),  # several chunks, ragged tail
        torch.randn(5, 7).t(),  # strided: falls back to copy_
        torch.randn(3, dtype=torch.complex64).conj(),  # lazy conjugate: copy_
        torch.arange(11, dtype=torch.int16),
        torch.zeros(0),
        torch.tensor(True),
    ]
    dsts = [torch.empty(s.shape, dtype=s.dtype) for s in srcs]
    copy_tensors(list(zip(dsts, srcs, strict=True)), threads=threads)
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s)
        assert d.numel() == 0 or d.data_ptr() != s.data_ptr()
