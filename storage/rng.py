"""Capture and restore the random number generator states a training step depends on.

Covers torch's CPU generator (and every CUDA device's when CUDA is available), numpy's
legacy global generator (``np.random.*``) and Python's :mod:`random`. The state is encoded
with tensors, ints, floats, strings, lists and dicts only, so it round-trips through
``torch.save``/``torch.load(weights_only=True)`` without allowing any other class; numpy's
``ndarray`` key becomes an int64 tensor. Generators owned by user code (``np.random.
default_rng()``, ``torch.Generator()`` objects) are the user's to save.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """The current global RNG states as a weights_only-safe dict."""
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np.asarray(np_state["state"]["key"], dtype=np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the global RNGs from :func:`capture_rng` output. A malformed state raises
    ``ValueError``/``KeyError``/``TypeError`` before any generator was changed (CUDA states
    are skipped when this process has no CUDA)."""
    py = state["python"]
    py_state = (int(py["version"]), tuple(int(x) for x in py["internal"]), py["gauss_next"])
    n = state["numpy"]
    np_state = {
        "bit_generator": str(n["bit_generator"]),
        "state": {"key": n["key"].numpy().astype(np.uint32), "pos": int(n["pos"])},
        "has_gauss": int(n["has_gauss"]),
        "gauss": float(n["gauss"]),
    }
    torch_state = state["torch"]
    if not isinstance(torch_state, torch.Tensor) or torch_state.dtype != torch.uint8:
        raise TypeError("rng state 'torch' must be a uint8 tensor")
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.set_rng_state(torch_state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
