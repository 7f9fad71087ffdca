"""Where a node's workers train: each worker's GPU, its model's device and the group backend.

torchrun's model, made safe by default. ``shoal agent J --workers gpu`` starts one worker per
visible GPU (torchrun's ``--nproc-per-node gpu``), and the agent gives every slot a
``CUDA_VISIBLE_DEVICES`` of its own (slot ``i`` gets the node's GPU ``i`` modulo their
number), so a worker sees exactly one GPU, ``cuda:0``, and two workers share a GPU only when
the node has more workers than GPUs. The agent then chooses, once for the node
(:func:`choose`), from the job spec's ``backend`` and ``device``:

================  =======================  ==================================================
GPUs visible      ``backend: auto``        ``backend: nccl`` / ``device: cuda``
================  =======================  ==================================================
none              gloo, model on the CPU   refused: no GPU
one per worker    NCCL, model on its GPU   as asked
fewer than the    gloo, model on its GPU   ``nccl``: refused, one line naming the fix
workers           (shared)                 (``--workers gpu`` or ``backend: gloo``)
================  =======================  ==================================================

``device: cpu`` puts the model on the CPU whatever the node has (gloo; its workers get an
empty ``CUDA_VISIBLE_DEVICES``, so none creates a CUDA context). gloo all-reduces, broadcasts
and all-gathers CUDA tensors; its point-to-point send and receive do not, so
:mod:`shoal.worker.process_group` stages those through host memory when the model is on a GPU.

The choice travels to each worker in its environment (:data:`BACKEND_ENV`,
:data:`DEVICE_ENV`, :data:`REASON_ENV`); a worker started without an agent makes the same
choice itself from ``LOCAL_WORLD_SIZE`` (torchrun's variable; default 1) and the GPUs it sees
(:func:`for_worker`). The worker logs its placement, sends it with its join (the coordinator
refuses a joiner whose backend differs from the generation's) and ``shoal status`` shows it
per worker.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shoal.events import envvars
from shoal.core.errors import ConfigError

#: The backend, device and reason a node agent chose for its workers (set per slot).
BACKEND_ENV = envvars.BACKEND
DEVICE_ENV = envvars.DEVICE
REASON_ENV = envvars.PLACEMENT
#: torchrun's variables: a worker's number among its node's workers, and their count.
LOCAL_RANK_ENV = "LOCAL_RANK"
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


class PlacementRefused(ConfigError):
    """The job's ``backend``/``device`` cannot be honoured on this node (one line, with the fix)."""


@dataclass(frozen=True)
class Placement:
    """One worker's (or one node's) choice: ``backend`` (``nccl``/``gloo``), ``device``
    (``cuda``/``cpu``), ``reason`` for people, and ``gpu``: the node's name of the worker's GPU
    (a ``CUDA_VISIBLE_DEVICES`` entry; None: the CPU, or a node-wide choice)."""

    backend: str
    device: str
    reason: str
    gpu: str | None = None

    def describe(self) -> str:
        """E.g. ``gloo, model on GPU 0 (3 workers share 1 GPU: ...)``."""
        where = "the CPU" if self.device == "cpu" else (f"GPU {self.gpu}" if self.gpu is not None else "its GPU")
        return f"{self.backend}, model on {where} ({self.reason})"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def choose(backend: str, device: str, *, gpus: int, workers: int, node: str = "") -> Placement:
    """The placement of ``workers`` workers of one node that sees ``gpus`` GPUs, for the job
    spec's ``backend`` (auto/nccl/gloo) and ``device`` (auto/cuda/cpu); see the module's
    table. Pure. PlacementRefused (one line naming the fix) when it cannot be honoured."""
    on = f" on node {node}" if node else ""
    if device == "cpu":
        if backend == "nccl":
            raise PlacementRefused("backend nccl needs the model on a GPU: use device cuda (or auto), or backend gloo")
        return Placement("gloo", "cpu", "device: cpu")
    if gpus <= 0:
        if backend == "nccl" or device == "cuda":
            asked = "backend: nccl" if backend == "nccl" else "device: cuda"
            raise PlacementRefused(f"{asked} but no GPU is visible{on} (CUDA_VISIBLE_DEVICES, drivers): "
                                   "run on a GPU node, or use backend: auto and device: auto (CPU, gloo)")
        return Placement("gloo", "cpu", f"no GPU visible{on}")
    if workers <= gpus:
        own = (f"each of the {workers} workers{on} has a GPU of its own" if workers > 1
               else f"the worker has a GPU of its own{on}")
        if backend == "gloo":
            return Placement("gloo", "cuda", f"backend: gloo; {own}")
        return Placement("nccl", "cuda", own)
    share = f"{_plural(workers, 'worker')} share {_plural(gpus, 'GPU')}{on}"
    if backend == "nccl":
        raise PlacementRefused(f"backend: nccl with {share}: NCCL needs one GPU per worker: start one worker per "
                               "GPU (--workers gpu) or use backend: gloo")
    if backend == "gloo":
        return Placement("gloo", "cuda", f"backend: gloo; {share}")
    return Placement("gloo", "cuda", f"{share}; NCCL needs one GPU per worker, gloo takes CUDA tensors")


def _device_count() -> int:
    """CUDA devices this process sees (0 without a CUDA build of torch or a driver)."""
    import torch

    try:
        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - a broken driver is "no GPU"
        return 0


def visible_gpus(environ: Mapping[str, str] | None = None, *, count: int | None = None) -> list[str]:
    """The GPUs this process may use, named as ``CUDA_VISIBLE_DEVICES`` names them (indices or
    UUIDs; ``"0"``, ``"1"``, ... when it is not set). Entries after the first that is empty
    or negative are hidden, as CUDA hides them; ``count`` (default: torch's device count)
    caps the list to the devices that exist. An empty ``CUDA_VISIBLE_DEVICES`` is no GPU,
    without asking torch."""
    env = os.environ if environ is None else environ
    value = env.get(VISIBLE_ENV)
    if value is None:
        return [str(i) for i in range(_device_count() if count is None else count)]
    names: list[str] = []
    for part in value.split(","):
        part = part.strip()
        if not part or part.startswith("-"):
            break
        names.append(part)
    if not names:
        return []
    return names[: _device_count() if count is None else count]


def slot_gpus(workers: int, gpus: list[str]) -> list[str | None]:
    """The GPU of each of ``workers`` slots: slot ``i`` gets ``gpus[i % len(gpus)]`` (so two
    slots share one only when there are more slots than GPUs); None for all without GPUs."""
    return [gpus[i % len(gpus)] if gpus else None for i in range(workers)]


def slot_env(choice: Placement, slot: int, workers: int, gpu: str | None) -> dict[str, str]:
    """The environment a node agent gives slot ``slot`` of ``workers`` for the node's
    ``choice``: the backend, device and reason, torchrun's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE``, and ``CUDA_VISIBLE_DEVICES``: the slot's GPU alone, or empty for a
    CPU placement on a node with GPUs (no CUDA context in a CPU worker)."""
    env = {BACKEND_ENV: choice.backend, DEVICE_ENV: choice.device, REASON_ENV: choice.reason,
           LOCAL_RANK_ENV: str(slot), LOCAL_WORLD_SIZE_ENV: str(workers)}
    if choice.device == "cuda" and gpu is not None:
        env[VISIBLE_ENV] = gpu
    elif gpu is not None:
        env[VISIBLE_ENV] = ""
    return env


def for_worker(backend: str, device: str, environ: Mapping[str, str] | None = None) -> Placement:
    """This worker's placement: the one its node agent chose (:func:`slot_env`), else chosen
    here from the GPUs it sees and ``LOCAL_WORLD_SIZE`` (default 1) workers on its node, its
    GPU picked by ``LOCAL_RANK``. PlacementRefused when the spec cannot be honoured."""
    env = os.environ if environ is None else environ
    chosen = env.get(BACKEND_ENV)
    gpus = visible_gpus(env) if device != "cpu" or chosen else []
    local = env.get(LOCAL_RANK_ENV, "")
    mine = gpus[int(local) % len(gpus)] if gpus and local.isdigit() else (gpus[0] if gpus else None)
    if chosen in ("nccl", "gloo") and env.get(DEVICE_ENV) in ("cuda", "cpu"):
        where = env[DEVICE_ENV]
        if where == "cuda" and not gpus:
            raise PlacementRefused(f"the node agent placed this worker on a GPU ({VISIBLE_ENV}="
                                   f"{env.get(VISIBLE_ENV)!r}) but it sees none")
        return Placement(chosen, where, env.get(REASON_ENV, "chosen by the node agent"),
                         mine if where == "cuda" else None)
    workers = env.get(LOCAL_WORLD_SIZE_ENV, "")
    choice = choose(backend, device, gpus=len(gpus), workers=int(workers) if workers.isdigit() and int(workers) else 1)
    return Placement(choice.backend, choice.device, choice.reason, mine if choice.device == "cuda" else None)


def local_device(kind: str):
    """The ``torch.device`` of this process for a device kind (``cuda``/``cpu``): for CUDA,
    GPU ``LOCAL_RANK`` modulo the visible GPUs when several are visible (made the current
    device: NCCL and every CUDA call without a device use it), else the current one."""
    import torch

    if kind != "cuda":
        return torch.device("cpu")
    local = os.environ.get(LOCAL_RANK_ENV, "")
    count = torch.cuda.device_count()
    if local.isdigit() and count > 1:
        torch.cuda.set_device(int(local) % count)
    return torch.device("cuda", torch.cuda.current_device())
