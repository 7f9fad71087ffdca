"""A compiled model's artifacts, shared through the checkpoint store (issue 37).

Each node keeps inductor's own on-disk cache (``TORCHINDUCTOR_CACHE_DIR``): a worker restarted
on the same node compiles from it. Workers on other nodes - or on a node whose local cache is
gone - can start from the first worker's compile through the job's checkpoint store: after its
warm-up, a worker that finds no entry for its key saves torch's portable cache
(``torch.compiler.save_cache_artifacts``) as ``compile-cache/<key>.bin`` there; before its
warm-up, a worker loads the entry for its key (``torch.compiler.load_cache_artifacts``).

**Keyed so that nothing stale is ever loaded**: the key is a SHA-256 over the torch and
Python versions, the machine and device kind, the precision, the compile options, the fixed
micro-batch, every parameter's name, shape and dtype, and the bytes of the entrypoint's module
source. A different torch, model code or shape is a different key.

**Signed, because it holds code**: those artifacts are compiled kernels and pickled graphs,
so loading one executes what it says. An entry is written with its HMAC-SHA256 under the
checkpoint HMAC key (``SHOAL_CHECKPOINT_HMAC_KEY``, as for manifests) and loaded only when it
verifies; without a key the store is not used at all (local caches only) - shoal never
unpickles anything from storage it cannot authenticate.
"""

from __future__ import annotations

import hashlib
import hmac as _hmac
import json
import logging
import platform
import sys
from typing import Any

import torch

from shoal.storage.backend import ObjectStore
from shoal.storage.errors import StorageError
from shoal.storage.manifest import HMAC_ENV, hmac_key_from_env

log = logging.getLogger("shoal.worker")

PREFIX = "compile-cache"


def cache_key(model: torch.nn.Module, *, entrypoint: str, precision: str, options: Any, shape: int,
              device: torch.device) -> str:
    """The key of a compile's artifacts (see the module docstring)."""
    module = sys.modules.get(entrypoint.split(":", 1)[0])
    try:
        source = open(module.__file__, "rb").read() if module is not None and module.__file__ else b""
    except OSError:
        source = b""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    facts = {
        "torch": torch.__version__, "python": sys.version.split()[0], "machine": platform.machine(),
        "device": device.type, "device_name": device_name, "precision": precision,
        "options": options.model_dump() if hasattr(options, "model_dump") else repr(options), "shape": shape,
        "params": [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()],
        "source": hashlib.sha256(source).hexdigest(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def load(store: ObjectStore, key: str) -> str:
    """Load the artifacts of ``key`` from ``store`` into torch's caches, if there are any that
    verify. Returns what happened, for the log: ``"loaded"``, ``"none"``, or why not."""
    secret = hmac_key_from_env()
    if secret is None:
        return f"not shared: the store's entries are loaded only with {HMAC_ENV} set (they hold code)"
    try:
        if not store.exists(f"{PREFIX}/{key}.bin"):
            return "none"
        data = store.get_bytes(f"{PREFIX}/{key}.bin")
        signature = store.get_bytes(f"{PREFIX}/{key}.sig").decode().strip()
    except (StorageError, OSError, UnicodeDecodeError) as exc:
        return f"not read ({exc})"
    if not _hmac.compare_digest(signature, _hmac.new(secret, data, hashlib.sha256).hexdigest()):
        log.warning("the compile cache entry %s in %s does not verify (tampered, or another key): not loaded",
                    key, store.uri)
        return "refused (its HMAC does not verify)"
    torch.compiler.load_cache_artifacts(data)
    return "loaded"


def save(store: ObjectStore, key: str) -> bool:
    """Save what this process compiled as ``key``'s entry, unless one exists (the first worker
    to compile writes it) or there is no HMAC key. True when written. Never raises: a cache is
    an optimisation."""
    secret = hmac_key_from_env()
    if secret is None:
        return False
    try:
        if store.exists(f"{PREFIX}/{key}.bin"):
            return False
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        data, _info = saved
        store.put_bytes(f"{PREFIX}/{key}.sig", _hmac.new(secret, data, hashlib.sha256).hexdigest().encode())
        store.put_bytes(f"{PREFIX}/{key}.bin", data)
        return True
    except Exception as exc:  # noqa: BLE001 - a cache is an optimisation only
        log.warning("the compile cache could not be saved to %s: %s", store.uri, exc)
        return False
