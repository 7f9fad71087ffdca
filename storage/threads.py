"""A thread pool made on first use and kept for the process's life (:class:`LazyPool`): the
storage layer's helper threads (hashing a checkpoint file beside its write, parallel memory
copies) start only in a process that needs them, once, and are shared by every call."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


class LazyPool:
    """A ``ThreadPoolExecutor`` of ``max_workers`` threads named ``<name>_<n>``, made by the
    first :meth:`get` (from any thread) and never shut down: its idle threads cost nothing,
    and a process that never asks for it has none."""

    def __init__(self, max_workers: int, name: str) -> None:
        self.max_workers = max_workers
        self.name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        """The pool (made now if this is the first call)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix=self.name)
            return self._pool
