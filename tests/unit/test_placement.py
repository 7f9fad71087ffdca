"""Where a node's workers train (worker/placement.py): the backend and device chosen from the
job spec and the node's GPUs, each slot's GPU, and what a worker reads back."""

from __future__ import annotations

import pytest

from shoal.core.jobspec import JobSpec
from shoal.core.errors import ConfigError
from shoal.worker import placement as pl


@pytest.mark.parametrize("backend,device,gpus,workers,expected", [
    ("auto", "auto", 0, 3, ("gloo", "cpu")),
    ("auto", "auto", 4, 4, ("nccl", "cuda")),
    ("auto", "auto", 8, 2, ("nccl", "cuda")),
    ("auto", "auto", 1, 3, ("gloo", "cuda")),  # the H100 demo: three workers share the GPU over gloo
    ("gloo", "auto", 2, 2, ("gloo", "cuda")),
    ("gloo", "auto", 0, 2, ("gloo", "cpu")),
    ("auto", "cpu", 4, 4, ("gloo", "cpu")),
    ("nccl", "auto", 2, 2, ("nccl", "cuda")),
    ("nccl", "cuda", 2, 1, ("nccl", "cuda")),
    ("auto", "cuda", 1, 2, ("gloo", "cuda")),
])
def test_choose(backend, device, gpus, workers, expected) -> None:
    got = pl.choose(backend, device, gpus=gpus, workers=workers, node="n1")
    assert (got.backend, got.device) == expected and got.reason


def test_the_reasons_say_why() -> None:
    assert pl.choose("auto", "auto", gpus=1, workers=3, node="n1").reason == (
        "3 workers share 1 GPU on node n1; NCCL needs one GPU per worker, gloo takes CUDA tensors")
    assert pl.choose("auto", "auto", gpus=4, workers=4).reason == "each of the 4 workers has a GPU of its own"
    assert pl.choose("auto", "auto", gpus=0, workers=1, node="n1").reason == "no GPU visible on node n1"


@pytest.mark.parametrize("backend,device,gpus,workers,words", [
    ("nccl", "auto", 1, 3, "backend: nccl with 3 workers share 1 GPU on node n1: NCCL needs one GPU per worker: "
                           "start one worker per GPU (--workers gpu) or use backend: gloo"),
    ("nccl", "auto", 0, 1, "backend: nccl but no GPU is visible on node n1"),
    ("auto", "cuda", 0, 1, "device: cuda but no GPU is visible on node n1"),
    ("nccl", "cpu", 2, 2, "backend nccl needs the model on a GPU"),
])
def test_refusals_are_one_line_naming_the_fix(backend, device, gpus, workers, words) -> None:
    with pytest.raises(pl.PlacementRefused) as info:
        pl.choose(backend, device, gpus=gpus, workers=workers, node="n1")
    assert str(info.value).startswith(words) and "\n" not in str(info.value)
    assert isinstance(info.value, ConfigError)  # the CLI: one line, exit 2


def test_the_spec_refuses_nccl_on_the_cpu() -> None:
    with pytest.raises(ValueError, match="backend nccl needs the model on a GPU"):
        JobSpec(name="j", backend="nccl", device="cpu")
    spec = JobSpec(name="j")
    assert (spec.backend, spec.device) == ("auto", "auto")


@pytest.mark.parametrize("value,count,expected", [
    ("0,1,2", 8, ["0", "1", "2"]),
    ("2,-1,3", 8, ["2"]),  # CUDA hides what follows an invalid entry
    ("GPU-aaaa,GPU-bbbb", 8, ["GPU-aaaa", "GPU-bbbb"]),
    ("0,1,2,3", 2, ["0", "1"]),  # only the devices that exist
    ("", 8, []),
    (None, 3, ["0", "1", "2"]),
])
def test_visible_gpus(value, count, expected) -> None:
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert pl.visible_gpus(env, count=count) == expected


def test_slots_get_distinct_gpus_until_there_are_more_slots_than_gpus() -> None:
    assert pl.slot_gpus(4, ["0", "1", "2", "3"]) == ["0", "1", "2", "3"]
    assert pl.slot_gpus(2, ["5", "7", "9"]) == ["5", "7"]
    assert pl.slot_gpus(3, ["0"]) == ["0", "0", "0"]
    assert pl.slot_gpus(2, []) == [None, None]


def test_slot_env_and_what_the_worker_reads_back() -> None:
    choice = pl.choose("auto", "auto", gpus=2, workers=2)
    env = pl.slot_env(choice, 1, 2, "1")
    assert env == {"SHOAL_BACKEND": "nccl", "SHOAL_DEVICE": "cuda", "SHOAL_PLACEMENT": choice.reason,
                   "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "1"}
    # the worker sees its one GPU (the agent's CUDA_VISIBLE_DEVICES; count 1 stands for torch's answer)
    assert pl.visible_gpus(env, count=1) == ["1"]
    assert pl.Placement("nccl", "cuda", choice.reason, "1").describe() == f"nccl, model on GPU 1 ({choice.reason})"
    cpu = pl.slot_env(pl.choose("auto", "cpu", gpus=2, workers=2), 0, 2, "0")
    assert cpu["CUDA_VISIBLE_DEVICES"] == "" and cpu["SHOAL_DEVICE"] == "cpu"  # no CUDA context in a CPU worker
    assert "CUDA_VISIBLE_DEVICES" not in pl.slot_env(pl.choose("auto", "auto", gpus=0, workers=1), 0, 1, None)


def test_a_worker_without_an_agent_chooses_for_itself(monkeypatch) -> None:
    monkeypatch.setattr(pl, "_device_count", lambda: 1)
    alone = pl.for_worker("auto", "auto", {"CUDA_VISIBLE_DEVICES": "3"})
    assert (alone.backend, alone.device, alone.gpu) == ("nccl", "cuda", "3")
    shared = pl.for_worker("auto", "auto", {"CUDA_VISIBLE_DEVICES": "3", "LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": "2"})
    assert (shared.backend, shared.device, shared.gpu) == ("gloo", "cuda", "3")
    agent = pl.for_worker("nccl", "auto", {"SHOAL_BACKEND": "gloo", "SHOAL_DEVICE": "cuda", "SHOAL_PLACEMENT": "why",
                                           "CUDA_VISIBLE_DEVICES": "0"})
    assert (agent.backend, agent.device, agent.reason, agent.gpu) == ("gloo", "cuda", "why", "0")  # the agent's word
    monkeypatch.setattr(pl, "_device_count", lambda: 0)
    assert pl.for_worker("auto", "auto", {}).device == "cpu"
    with pytest.raises(pl.PlacementRefused, match="sees none"):
        pl.for_worker("auto", "auto", {"SHOAL_BACKEND": "nccl", "SHOAL_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "0"})
