"""A short fingerprint of a model's weights, published with every heartbeat.

Workers of one generation apply bit-identical updates (the all-reduced gradient is the same on
every rank), so after each committed step their digests must be equal; a differing digest
means a worker diverged (missed a state broadcast, applied a step others aborted, ...). The
digest covers ``model.state_dict()`` - parameters and persistent buffers - in its (stable,
registration) order, including each entry's name, dtype and shape, so a structural difference
changes it too. An elastic HSDP member's digest covers its shards only (a sharded tensor's local
part): the members with the same shard index of every replica group must agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from shoal.worker import torch_compat as tc

DIGEST_CHARS = 16


def _raw(t: torch.Tensor):
    """A buffer over ``t``'s raw bytes (a view when ``t`` is a contiguous CPU tensor)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def state_digest(model: torch.nn.Module, *, length: int = DIGEST_CHARS) -> str:
    """sha256 over ``model.state_dict()`` (name, dtype, shape, bytes of each entry), as the
    first ``length`` hex characters. Equal models give equal digests; any bit that differs
    changes it. Costs one pass over the weights (plus a device->host copy on GPU)."""
    return digest_of(model.state_dict(), length=length)


def digest_of(state: Mapping[str, torch.Tensor], *, length: int = DIGEST_CHARS) -> str:
    """:func:`state_digest` of a ``state_dict()`` (or a copy of one): equal for equal models."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in state.items():
            t = tc.local(t)
            h.update(name.encode())
            h.update(f"|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(_raw(t))  # no copy for a contiguous CPU tensor
    return h.hexdigest()[:length]
