"""Every call shoal makes into torch.distributed's private or low-level surface, in one place,
checked against the torch versions it was written for.

shoal drives process groups as objects (:class:`shoal.worker.process_group.Group`): it calls
a torch ``ProcessGroup``'s own collective methods (``allreduce``, ``broadcast``, ``send``,
``recv``, ``barrier`` with their option structs) instead of the ``torch.distributed``
functions, so the same code works on the registered default group of a generation and on a
standalone gloo group that torch never registers (the cross-replica groups of elastic HSDP,
one per generation and shard index: registering and destroying them per generation breaks
torch's name lookups). It also resets torch's group counter, aborts an NCCL communicator and
sets a backend's collective timeout: private attributes, tested here on each torch version in
:data:`SUPPORTED` (``pyproject.toml`` asks for torch >= 2.10; CI runs 2.13, the GPU machine
2.11). A torch outside the range logs one warning at import and is tried anyway.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: (lowest, highest) torch release (major, minor) this module was checked against.
SUPPORTED = ((2, 10), (2, 14))


def _version() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


if not SUPPORTED[0] <= _version() <= SUPPORTED[1]:  # pragma: no cover - depends on the installed torch
    log.warning("torch %s is outside the versions shoal's process groups were checked against (%s to %s)",
                torch.__version__, ".".join(map(str, SUPPORTED[0])), ".".join(map(str, SUPPORTED[1])))


# --- collectives on a ProcessGroup object -------------------------------------------------------
def allreduce(group: dist.ProcessGroup, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType):
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return group.allreduce([tensor], opts)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int):
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)


def allgather(group: dist.ProcessGroup, outputs: list[torch.Tensor], tensor: torch.Tensor):
    """Every rank's ``tensor`` into ``outputs`` (one per rank, in rank order)."""
    return group.allgather([outputs], [tensor])


def send(group: dist.ProcessGroup, tensor: torch.Tensor, dst: int):
    return group.send([tensor], dst, 0)


def recv(group: dist.ProcessGroup, tensor: torch.Tensor, src: int):
    return group.recv([tensor], src, 0)


def barrier(group: dist.ProcessGroup):
    return group.barrier(dist.BarrierOptions())


# --- the default group ----------------------------------------------------------------------------
def default_group() -> dist.ProcessGroup:
    """The registered default group (``init_process_group``'s)."""
    return dist.group.WORLD


def set_timeout(group: dist.ProcessGroup, device: torch.device, seconds: float) -> None:
    """Give ``group``'s backend for ``device`` the collective timeout ``seconds``."""
    backend = group._get_backend(device) if hasattr(group, "_get_backend") else group  # a standalone backend
    backend._set_default_timeout(timedelta(seconds=seconds))


def reset_group_counter() -> None:
    """torch names an unnamed default group by a per-process counter that it bumps before
    connecting and resets only in ``destroy_process_group`` of an initialised group; a member
    whose rendezvous failed would count one ahead of members that never tried that
    generation (see ``process_group._reset_group_names``)."""
    from torch.distributed import distributed_c10d as c10d

    c10d._world.group_count = 0


def abort_default_nccl() -> None:
    """``ncclCommAbort`` of the default group: its kernels stop, its work fails."""
    from torch.distributed import distributed_c10d as c10d

    c10d._abort_process_group()


# --- standalone groups ------------------------------------------------------------------------------
def new_gloo_group(store: dist.Store, rank: int, size: int, timeout: float, address: str = "") -> dist.ProcessGroup:
    """A gloo group torch does not register (no name, no ``destroy_process_group``): its
    owner drops it. ``address``: the local address its sockets bind to and advertise ("" :
    the host name's)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address) if address
                     else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, opts)


# --- FSDP2 ------------------------------------------------------------------------------------------
def mesh_of_default_group(device_type: str):
    """A 1-D ``DeviceMesh`` over the registered default group (an HSDP replica group's shard
    group), for ``fully_shard``."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dist.group.WORLD, device_type=device_type)


def fully_shard(module: torch.nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard as _fully_shard

    _fully_shard(module, mesh=mesh)


def fsdp_modules(model: torch.nn.Module) -> list:
    """The modules ``fully_shard`` made into FSDP units (the root's last)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def like_param(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a local shard shaped like ``param``'s) as a DTensor laid out like
    ``param`` when ``param`` is one; else ``value`` as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and not isinstance(value, DTensor) and value.shape == param.to_local().shape:
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    return value



# --- state dicts for checkpoints (torch.distributed.checkpoint's helpers) ---------------------------
_MODEL, _OPTIM = "model/", "optim/"


def flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The model's and the optimizer's state as one flat dict keyed ``model/<fqn>`` and
    ``optim/state.<fqn>.<name>`` / ``optim/param_groups.<fqn>.<name>`` (DCP's flattened
    optimizer keys: by parameter name, whatever the layout). Sharded parameters and their
    optimizer state come as DTensors, the rest as plain tensors and values. An optimizer
    without state gets it initialised (a zero step, as DCP does). No collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {**{_MODEL + k: v for k, v in msd.items()}, **{_OPTIM + k: v for k, v in osd.items()}}


def flat_keys(flat: dict, *, optimizer: bool = True, groups: bool = True) -> set[str]:
    """The keys of a :func:`flat_state` dict that are the model's, and with ``optimizer`` the
    optimizer's: its per-parameter state, and with ``groups`` its parameter groups'
    hyperparameters (learning rate, betas...) too."""
    state = _OPTIM + "state."
    return {k for k in flat if k.startswith(_MODEL)
            or (optimizer and k.startswith(_OPTIM) and (groups or k.startswith(state)))}


def set_flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, flat: dict) -> None:
    """Load a dict shaped like :func:`flat_state`'s into ``model`` and ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    msd = {k[len(_MODEL):]: v for k, v in flat.items() if k.startswith(_MODEL)}
    osd = {k[len(_OPTIM):]: v for k, v in flat.items() if k.startswith(_OPTIM)}
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(flatten_optimizer_state_dict=True))


def flatten_whole(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict,
                  optimizer_sd: dict | None) -> dict:
    """A data-parallel checkpoint's ``model.state_dict()`` and ``optimizer.state_dict()``
    (parameters by index) in :func:`flat_state`'s keys, the indices named after the
    parameters ``optimizer`` holds, in order (the same optimizer, built alike, sharded or not)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    flat = {_MODEL + k: v for k, v in model_sd.items()}
    if optimizer_sd is None:
        return flat
    for group in optimizer_sd.get("param_groups", []):
        for index in group["params"]:
            if not isinstance(index, int) or not 0 <= index < len(order) or order[index] is None:
                raise ValueError(f"the checkpoint's optimizer names parameter {index!r}, which this optimizer "
                                 f"({len(order)} parameters) does not have")
            fqn = order[index]
            for k, v in group.items():
                if k != "params":
                    flat[f"{_OPTIM}param_groups.{fqn}.{k}"] = v
            for k, v in optimizer_sd.get("state", {}).get(index, {}).items():
                flat[f"{_OPTIM}state.{fqn}.{k}"] = v
    return flat


def chunk_of(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]] | None:
    """(local values, offsets in the global tensor, global size) of a DTensor's shard; None
    for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None
    (chunk,) = t.__create_chunk_list__()
    return t.to_local(), tuple(chunk.offsets), tuple(t.shape)


# --- dynamo's counters ----------------------------------------------------------------------------
def compiled_frames() -> int:
    """Frames dynamo compiled in this process so far (its ``counters["frames"]["ok"]``): a new
    one after warm-up is a recompile (a new shape, a guard that failed)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])
