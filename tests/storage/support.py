"""Shared helpers of the storage tests (no tests here).

* :func:`moto_endpoint` -- a real S3-compatible HTTP server (moto) on loopback, started once
  per process and stopped at exit. The S3 backend talks to it through the real minio client.
* :func:`make_store` -- a fresh store of a given kind (one of :data:`BACKENDS`);
  the ``object_store`` fixture (``conftest.py``) is parametrized over it.
* :class:`HookedStore` -- a store wrapper that records operations and can block or fail
  them, for ordering, async and failure tests.
* :func:`tiny_state` -- a small deterministic TrainState whose content encodes its step.
"""

from __future__ import annotations

import atexit
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import torch

from shoal.storage.backend import ObjectStore
from shoal.storage.memory import MemoryStore
from shoal.storage.train_state import TrainState

BACKENDS = ["memory", "local", "s3"]
ACCESS_KEY = "shoal-test-access"
SECRET_KEY = "shoal-test-SECRET-do-not-print"

_server: str | None = None
_server_lock = threading.Lock()


def moto_endpoint() -> str:
    """``http://127.0.0.1:PORT`` of a moto S3 server running in this process (started once,
    stopped at exit; ``bench.s3_server``: moto's S3 in waitress, keep-alive like a real endpoint)."""
    from bench.s3_server import start_moto_s3

    global _server
    with _server_lock:
        if _server is None:
            _server, stop = start_moto_s3()
            atexit.register(stop)
        return _server


def s3_env() -> dict[str, str]:
    return {"S3_ENDPOINT": moto_endpoint(), "S3_ACCESS_KEY": ACCESS_KEY, "S3_SECRET_KEY": SECRET_KEY}


def make_s3_store(prefix: str = "ckpt/job") -> ObjectStore:
    """An S3Store on a fresh bucket of the moto server."""
    from shoal.storage.s3 import S3Store
    from shoal.storage.s3_config import S3Config

    config = S3Config.from_env(s3_env())
    return S3Store(f"b-{uuid.uuid4().hex[:16]}", prefix, config, create_bucket=True)


def make_store(kind: str, tmp_path: Path) -> ObjectStore:
    if kind == "memory":
        return MemoryStore()
    if kind == "local":
        from shoal.storage.local import LocalStore

        return LocalStore(tmp_path / "store")
    if kind == "s3":
        return make_s3_store()
    raise ValueError(kind)


class HookedStore(ObjectStore):
    """Delegates to ``inner``; logs ``(op, key)`` in ``ops``; ``before_write(key)`` runs
    before every write reaches ``inner`` (it may block on an event or raise)."""

    def __init__(self, inner: ObjectStore, before_write: Callable[[str], None] | None = None) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.ops: list[tuple[str, str]] = []
        self.before_write = before_write

    @contextmanager
    def open_write(self, key: str) -> Iterator[BinaryIO]:
        if self.before_write is not None:
            self.before_write(key)
        with self.inner.open_write(key) as f:
            yield f
        self.ops.append(("put", key))

    def get_bytes(self, key: str) -> bytes:
        self.ops.append(("get", key))
        return self.inner.get_bytes(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.ops.append(("delete", key))
        self.inner.delete(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def local_path(self, key: str) -> Path | None:
        return self.inner.local_path(key)


def tiny_state(step: int, *, cursor: object | None = None, generation: int = 1) -> TrainState:
    """A small TrainState whose tensors and counters are functions of ``step``."""
    return TrainState(
        step=step,
        model={"w": torch.full((64,), float(step)), "b": torch.arange(8) + step},
        optimizer={"state": {0: {"exp_avg": torch.full((4,), step / 2)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        epoch=step // 10,
        data_cursor={"sample": step * 32} if cursor is None else cursor,
        generation=generation,
        world_size=2,
    )


class Warnings(list):
    """Collects ``on_warning`` messages: pass the instance itself as the callback."""

    def __call__(self, message: str) -> None:
        self.append(message)

    def text(self) -> str:
        return "\n".join(self)


def dead_redis():
    """A client for a loopback port nobody listens on, failing fast (no retries)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from shoal.ops.embedded import free_port

    return redis.Redis(port=free_port(), socket_connect_timeout=1, socket_timeout=1, retry=Retry(NoBackoff(), 0))
