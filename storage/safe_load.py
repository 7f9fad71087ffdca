"""The only way state files are deserialized: ``torch.load(weights_only=True)``.

Nothing in shoal unpickles checkpoint data any other way. On top of torch's restricted
unpickler, files that are not torch zip archives (the legacy raw-pickle format, which we
never write) are refused without being parsed. :func:`check_saveable` is the save-side mirror:
it refuses, before anything is written, state holding objects the loader would refuse, so a
checkpoint cannot be written that later fails to load.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from typing import Any

import torch

from shoal.storage.errors import CheckpointCorrupt, UnsafeCheckpoint

_ZIP_MAGIC = b"PK\x03\x04"
_SCALARS = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size)


def load_state_bytes(data: bytes, *, where: str) -> Any:
    """Deserialize one state file (CPU tensors, plain containers).

    Raises UnsafeCheckpoint when the file is not a torch zip archive or holds any object
    the weights-only unpickler does not allow (nothing of it is executed); CheckpointCorrupt
    when the archive is unreadable.
    """
    if not data.startswith(_ZIP_MAGIC):
        raise UnsafeCheckpoint(f"{where}: not a torch zip archive; refusing to unpickle it")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "weights only" in str(exc).lower():
            raise UnsafeCheckpoint(f"{where}: refused by the weights-only unpickler: {first}") from exc
        raise CheckpointCorrupt(f"{where}: unreadable pickle data: {first}") from exc
    except (RuntimeError, EOFError, KeyError, ValueError, OSError) as exc:
        raise CheckpointCorrupt(f"{where}: not a readable torch file: {type(exc).__name__}: {exc}") from exc


def check_saveable(obj: Any, where: str = "state") -> None:
    """Raise ``ValueError`` naming the path of the first value ``torch.load(weights_only=True)``
    would refuse (anything but tensors, numbers, strings, bytes, None, dtypes, devices, sizes
    and dict/OrderedDict/list/tuple/set of those)."""
    stack: list[tuple[str, Any]] = [(where, obj)]
    while stack:
        path, value = stack.pop()
        if type(value) in (torch.Tensor, torch.nn.Parameter) or isinstance(value, _SCALARS):
            continue
        if type(value) in (dict, OrderedDict):
            for k, v in value.items():
                if not isinstance(k, (str, int)):
                    raise ValueError(f"{path}: dict key {k!r} is not a str or int")
                stack.append((f"{path}[{k!r}]", v))
            continue
        if type(value) in (list, tuple, set):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
            continue
        raise ValueError(
            f"{path}: {type(value).__module__}.{type(value).__qualname__} cannot be loaded back "
            "with torch.load(weights_only=True); store tensors, numbers, strings or containers"
        )
