"""A compiled model's artifacts: kept per node, shared through the checkpoint store (issue 37).

Inductor keeps what it compiled in a cache directory (``TORCHINDUCTOR_CACHE_DIR``): generated
kernels, their built shared objects, the FX and AOT-autograd graphs. A worker compiles from it
in seconds where a cold compile takes minutes. shoal gives each model its own directory,
``<SHOAL_HOME>/compile/<key>`` (unless the user set ``TORCHINDUCTOR_CACHE_DIR``), so a worker
restarted on the same node is warm at once. Other nodes - or a node whose directory is gone -
are warmed through the job's checkpoint store: after its warm-up, the first worker to compile
a key packs the directory as ``compile-cache/<key>.tar.gz``; a worker whose directory is empty
unpacks it before its warm-up. (torch's portable cache, ``torch.compiler.save_cache_artifacts``,
was tried first: on the CPU it carries the generated code but not the built kernels, and a
worker loading it compiled as long as a cold one - 26 s against 25 s for the digits model,
3.4 s from the directory.)

**Keyed so that nothing stale is ever loaded**: the key is a SHA-256 over the torch and
Python versions, the platform and processor, the device, the precision, the compile options,
the fixed micro-batch, every parameter's name, shape and dtype, and the bytes of the
entrypoint's module source. A different torch, model code or shape is a different key.

**Signed, because it holds code**: the directory holds built kernels and pickled graphs, so
unpacking one and using it executes what it says. An entry is written with its HMAC-SHA256
under the checkpoint HMAC key (``SHOAL_CHECKPOINT_HMAC_KEY``, as for manifests) and used only
when it verifies, unpacked with tarfile's ``data`` filter (no links out, no absolute paths);
without a key the store is not used (per-node caches only) - shoal never runs anything from
storage it cannot authenticate.
"""

from __future__ import annotations

import hashlib
import hmac as _hmac
import io
import json
import logging
import os
import platform
import sys
import tarfile
from pathlib import Path
from typing import Any

import torch

from shoal.events import envvars
from shoal.storage.backend import ObjectStore
from shoal.storage.errors import StorageError
from shoal.storage.manifest import HMAC_ENV, hmac_key_from_env

log = logging.getLogger("shoal.worker")

PREFIX = "compile-cache"
#: inductor's own variable: the directory it caches its compiles in
INDUCTOR_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
#: the largest cache directory shared through the store
MAX_BYTES = 1 << 30


def cache_key(model: torch.nn.Module, *, entrypoint: str, precision: str, options: Any, shape: int,
              device: torch.device) -> str:
    """The key of a compile's artifacts (see the module docstring)."""
    module = sys.modules.get(entrypoint.split(":", 1)[0])
    try:
        source = Path(module.__file__).read_bytes() if module is not None and module.__file__ else b""
    except OSError:
        source = b""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    facts = {
        "torch": torch.__version__, "python": sys.version.split()[0], "platform": platform.platform(),
        "machine": platform.machine(), "device": device.type, "device_name": device_name, "precision": precision,
        "options": options.model_dump() if hasattr(options, "model_dump") else repr(options), "shape": shape,
        "params": [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()],
        "source": hashlib.sha256(source).hexdigest(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def use_local_dir(key: str) -> Path:
    """Inductor's cache directory for ``key`` on this node: ``TORCHINDUCTOR_CACHE_DIR`` when the
    user set it, else ``<SHOAL_HOME>/compile/<key>`` (set for this process from here on)."""
    chosen = os.environ.get(INDUCTOR_DIR_ENV)
    if not chosen:
        chosen = str(Path(envvars.HOME.get() or Path.home() / ".shoal") / "compile" / key)
        os.environ[INDUCTOR_DIR_ENV] = chosen
    path = Path(chosen)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sign(secret: bytes, data: bytes) -> bytes:
    return _hmac.new(secret, data, hashlib.sha256).hexdigest().encode()


def load(store: ObjectStore, key: str, local: Path) -> str:
    """Fill ``local`` (an empty cache directory) from ``store``'s entry for ``key`` when one
    verifies. Returns what happened, for the log: ``"local"`` (the node's own directory holds
    compiles already), ``"loaded"``, ``"none"``, or why not."""
    if any(local.iterdir()):
        return "local"
    secret = hmac_key_from_env()
    if secret is None:
        return f"not shared: the store's entries are used only with {HMAC_ENV} set (they hold code)"
    try:
        if not store.exists(f"{PREFIX}/{key}.tar.gz"):
            return "none"
        data = store.get_bytes(f"{PREFIX}/{key}.tar.gz")
        signature = store.get_bytes(f"{PREFIX}/{key}.sig").strip()
    except (StorageError, OSError) as exc:
        return f"not read ({exc})"
    if not _hmac.compare_digest(signature, _sign(secret, data)):
        log.warning("the compile cache entry %s in %s does not verify (tampered, or another key): not used",
                    key, store.uri)
        return "refused (its HMAC does not verify)"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(local, filter="data")
    return "loaded"


def save(store: ObjectStore, key: str, local: Path) -> bool:
    """Pack ``local`` as ``key``'s entry in ``store``, unless one exists (the first worker to
    compile writes it), there is no HMAC key, or it is over :data:`MAX_BYTES`. True when
    written. Never raises: a cache is an optimisation."""
    secret = hmac_key_from_env()
    if secret is None:
        return False
    try:
        if store.exists(f"{PREFIX}/{key}.tar.gz"):
            return False
        size = sum(f.stat().st_size for f in local.rglob("*") if f.is_file())
        if size > MAX_BYTES:
            log.info("the compile cache (%d MiB) is too large to share through the store", size >> 20)
            return False
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            tar.add(local, arcname=".")
        data = buf.getvalue()
        store.put_bytes(f"{PREFIX}/{key}.sig", _sign(secret, data))
        store.put_bytes(f"{PREFIX}/{key}.tar.gz", data)
        return True
    except Exception as exc:  # noqa: BLE001 - a cache is an optimisation only
        log.warning("the compile cache could not be saved to %s: %s", store.uri, exc)
        return False
