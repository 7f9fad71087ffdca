"""The NCCL paths of worker/process_group.py, without a GPU: multi-rank NCCL cannot run on the
one-GPU machines lent to this project, and CI has none, so the abort path is driven here with
stand-ins for NCCL's work objects (what torch's ``WorkNCCL`` offers: ``is_completed()`` that
asks the GPU without blocking, ``wait()`` that orders the stream, no useful future).

- a wait on NCCL work polls it, and an abort from another thread (the watcher seeing an
  eviction) ends the wait at once with CollectiveFailed;
- past the collective timeout the wait aborts the group itself (NCCL's own timeout does not
  end a host wait);
- leaving an aborted NCCL group calls ``ncclCommAbort`` (through torch) before dropping it,
  so a dead NCCL peer never hangs the survivors; leaving a healthy one does not.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from shoal.worker import process_group as pg
from shoal.worker.errors import CollectiveFailed


class FakeNcclWork:
    """Stands in for torch's WorkNCCL: completes when ``done`` is set."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waited = 0
        self.polls = 0

    def is_completed(self) -> bool:
        self.polls += 1
        return self.done.is_set()

    def wait(self) -> bool:
        self.waited += 1
        return True

    def get_future(self):  # pragma: no cover - a polled wait never asks for it
        raise AssertionError("an NCCL wait must poll, not wait on the future")


def _group(backend: str = "nccl", timeout: float = 30.0, *, torch_group: object = None,
           registered: bool = False) -> pg.Group:
    """A group of generation 7 with no real backend behind it."""
    return pg.Group("j", 7, 0, 2, backend, torch.device("cpu"), None, timeout, torch_group, registered=registered)


@pytest.fixture
def rendezvous():
    """A rendezvous whose joined group is an NCCL group of generation 7 (no real backend)."""
    rdv = pg.Rendezvous(None, "j", backend="nccl")
    rdv._joined = _group()
    yield rdv


@pytest.fixture
def nccl_group(rendezvous):
    yield rendezvous.joined


def test_a_wait_on_nccl_work_polls_it_and_returns_once_it_completed(nccl_group) -> None:
    work = FakeNcclWork()
    threading.Timer(0.05, work.done.set).start()
    nccl_group._wait(work, "all_reduce of gradient bucket 0")
    assert work.polls > 1 and work.waited == 1  # polled, then wait() orders the stream after it


def test_an_abort_from_another_thread_ends_the_wait_at_once(rendezvous, nccl_group) -> None:
    work = FakeNcclWork()  # never completes: a peer is dead or hung
    threading.Timer(0.1, rendezvous.request_abort, args=(7, "generation 8 evicted w1")).start()
    t0 = time.monotonic()
    with pytest.raises(CollectiveFailed, match=r"aborted \(generation 8 evicted w1\)"):
        nccl_group._wait(work, "all_reduce of gradient bucket 0")
    assert time.monotonic() - t0 < 5  # at once, not at the 30 s collective timeout
    assert nccl_group._abandoned == [work] and work.waited == 0  # kept until the group is freed, never waited on


def test_past_the_collective_timeout_the_wait_aborts_the_group() -> None:
    group = _group(timeout=0.2)
    work = FakeNcclWork()
    with pytest.raises(CollectiveFailed, match="took longer than 0 s"):
        group._wait(work, "broadcast from rank 0")
    assert group.abort_reason.startswith("broadcast from rank 0 took longer than")
    # every later collective of the group fails before it starts
    with pytest.raises(CollectiveFailed, match="aborted"):
        group._wait(FakeNcclWork(), "all_reduce")


def test_a_work_that_ended_before_a_late_abort_is_not_dropped() -> None:
    """Issue 34: a step's cross-replica reduces all arrived, then the table evicting the other
    replica group aborted the group; the wait for the next (already complete) reduce raised, so
    this group redid a step the other group had committed - the step committed twice."""
    group = _group()
    ended = FakeNcclWork()
    ended.done.set()
    group.request_abort("generation 8 evicted w2")
    group._wait(ended, "all_reduce of a gradient shard")  # its data is here: the wait succeeds
    assert ended.waited == 1 and group._abandoned == []
    with pytest.raises(CollectiveFailed, match=r"aborted \(generation 8 evicted w2\)"):
        group._wait(FakeNcclWork(), "all_reduce of the next shard")  # one still in flight fails at once


def test_leaving_an_aborted_nccl_group_aborts_the_communicator_first(rendezvous, nccl_group, monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(pg.tc, "abort_default_nccl", lambda: calls.append("ncclCommAbort"))
    monkeypatch.setattr(pg.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(pg.dist, "destroy_process_group", lambda: calls.append("destroy"))
    nccl_group.registered = True
    assert rendezvous.request_abort(7, "generation 8 evicted w1")
    rendezvous.close_joined()
    assert calls == ["ncclCommAbort", "destroy"]
    assert rendezvous.joined is None and nccl_group.closed


def test_leaving_a_healthy_nccl_group_does_not_abort_it(rendezvous, nccl_group, monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(pg.tc, "abort_default_nccl", lambda: calls.append("ncclCommAbort"))
    monkeypatch.setattr(pg.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(pg.dist, "destroy_process_group", lambda: calls.append("destroy"))
    nccl_group.registered = True
    rendezvous.close_joined()
    assert calls == ["destroy"]


def test_only_nccl_work_is_polled() -> None:
    work = FakeNcclWork()
    assert _group("nccl")._polled(work)
    assert not _group("gloo")._polled(work)  # gloo's future completes when the collective does

