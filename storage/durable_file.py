"""A write-only file whose dirty pages are pushed to disk while it is still being written.

Writing a large file and then calling ``fsync`` once serializes the CPU work (serializing,
hashing) and the disk work. :class:`DurableFile` starts a helper thread after the first
``flush_every`` bytes that calls ``fdatasync`` each time another ``flush_every`` bytes were
written, so the disk works while the caller keeps producing data and the final ``fsync`` in
:meth:`DurableFile.finish` has little left to do. Small files never start the thread.
"""

from __future__ import annotations

import os
import threading
from typing import BinaryIO

_fdatasync = getattr(os, "fdatasync", os.fsync)

FLUSH_EVERY = 16 * 1024 * 1024


class DurableFile:
    """Wraps an open binary file ``f``; use :meth:`write`, then exactly one of
    :meth:`finish` (durable) or :meth:`abort` (discard)."""

    def __init__(self, f: BinaryIO, flush_every: int = FLUSH_EVERY) -> None:
        self._f = f
        self._flush_every = flush_every
        self._unflushed = 0
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._error: OSError | None = None

    def write(self, data) -> int:
        """Write ``data``; an error of an earlier background flush is raised here."""
        if self._error is not None:
            raise self._error
        n = self._f.write(data)
        self._unflushed += n
        if self._unflushed >= self._flush_every:
            self._unflushed = 0
            self._f.flush()  # hand the Python buffer to the kernel so fdatasync covers it
            if self._thread is None:
                self._thread = threading.Thread(target=self._flusher, name="shoal-fdatasync", daemon=True)
                self._thread.start()
            self._wake.set()
        return n

    def flush(self) -> None:
        self._f.flush()

    def _flusher(self) -> None:
        fd = self._f.fileno()
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            try:
                _fdatasync(fd)
            except OSError as exc:
                self._error = exc
                return

    def _join(self) -> None:
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            self._thread.join()  # at most one fdatasync in progress; the fd must outlive it

    def finish(self) -> None:
        """Stop the helper, then flush and fsync everything. Raises the OSError of any
        flush that failed (the data must then be treated as not written)."""
        self._join()
        if self._error is not None:
            raise self._error
        self._f.flush()
        os.fsync(self._f.fileno())

    def abort(self) -> None:
        """Stop the helper without making anything durable."""
        self._join()
