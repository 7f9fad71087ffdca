"""The one place that reads meaning out of torch/gloo/NCCL/CUDA error text
(worker/classify.py): one test per class, with the messages those libraries print."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shoal.events.models import FormationError
from shoal.worker import process_group as pg
from shoal.worker.classify import connect_cause, formation_error, peer_connect_failed, timed_out
from shoal.worker.errors import CollectiveFailed, InterfaceUnavailable, RendezvousFailed, RendezvousTimeout

NCCL_DUPLICATE = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3690, invalid usage (run with "
    "NCCL_DEBUG=WARN for details), NCCL version 2.28.9\nncclInvalidUsage: This usually reflects invalid usage of NCCL "
    "library.\nLast error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000")


def test_nccl_invalid_usage_is_a_configuration_error() -> None:
    exc = dist.DistBackendError(NCCL_DUPLICATE)
    assert formation_error(exc) is FormationError.NCCL_INVALID_USAGE
    # through the translation every failure of the worker's side goes through
    err = pg.translate_error(exc, "catching up", rendezvous=False)
    assert isinstance(err, CollectiveFailed) and err.formation_error is FormationError.NCCL_INVALID_USAGE
    assert formation_error(err) is FormationError.NCCL_INVALID_USAGE


def test_cuda_out_of_memory_by_type_and_by_text() -> None:
    assert formation_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) is \
        FormationError.CUDA_OUT_OF_MEMORY
    text = RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")
    assert formation_error(text) is FormationError.CUDA_OUT_OF_MEMORY


@pytest.mark.parametrize("message", [
    "CUDA error: invalid device ordinal\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    "No CUDA GPUs are available",
    "Found no NVIDIA driver on your system.",
    "Torch not compiled with CUDA enabled",
])
def test_a_device_that_does_not_exist(message: str) -> None:
    assert formation_error(RuntimeError(message)) is FormationError.NO_DEVICE


def test_an_interface_without_an_address_is_typed() -> None:
    err = InterfaceUnavailable("interface 'nosuch0' (--iface/SHOAL_IFACE) has no IPv4 address on this host")
    assert isinstance(err, RendezvousFailed) and formation_error(err) is FormationError.NO_INTERFACE_ADDRESS


@pytest.mark.parametrize("exc", [
    dist.DistStoreError("RedisStore: timed out after 5 s waiting for key 'rank/2/addr'"),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:144] Connection reset by peer"),
    RuntimeError("[gloo/transport/tcp/pair.cc:755] connect [10.0.0.5]:4242: Connection refused"),
    RuntimeError("Timed out waiting 5000ms for send operation to complete"),
    RendezvousFailed("rendezvous of generation 4 (rank 1/3): aborted (generation 5 evicted w2)"),
])
def test_timeouts_resets_refusals_and_aborts_are_transient(exc: BaseException) -> None:
    assert formation_error(exc) is FormationError.TRANSIENT
    err = pg.translate_error(exc, "rendezvous of generation 4", rendezvous=True)
    assert err.formation_error is FormationError.TRANSIENT


def test_a_configuration_error_is_never_a_rendezvous_timeout_and_the_cause_chain_is_read() -> None:
    # a store wait that timed out because NCCL refused the group (the message says both)
    exc = RuntimeError("timed out: " + NCCL_DUPLICATE)
    err = pg.translate_error(exc, "rendezvous", rendezvous=True)
    assert type(err) is RendezvousFailed and err.formation_error is FormationError.NCCL_INVALID_USAGE
    plain = pg.translate_error(RuntimeError("Socket Timeout"), "rendezvous", rendezvous=True)
    assert type(plain) is RendezvousTimeout
    try:
        try:
            raise RuntimeError(NCCL_DUPLICATE)
        except RuntimeError as inner:
            raise ValueError("catch-up failed") from inner
    except ValueError as outer:
        assert formation_error(outer) is FormationError.NCCL_INVALID_USAGE


def test_the_connect_texts() -> None:
    assert timed_out("Socket Timeout") and timed_out("connect timed out") and not timed_out("Connection refused")
    assert connect_cause("connect [1.2.3.4]:5: Connection refused") == "Connection refused"
    assert connect_cause("Connect timeout [remote=[10.0.0.2]:4242]") == "timed out"
    assert connect_cause("something else") == "failed"
    assert peer_connect_failed("Connect timeout [remote=[10.0.0.2]:4242]")
    assert not peer_connect_failed("RedisStore: could not connect: no key")
