"""Worker log lines into the job's capped log stream (``keys.logs``), for ``shoal logs``.

:class:`RedisLogHandler` never blocks or raises into the caller: ``emit`` formats the record
and puts it on a bounded in-memory queue (dropping it when the queue is full); a daemon
thread XADDs queued lines ``{worker, level, msg, ts}`` in pipelines with ``MAXLEN ~`` :data:`~shoal.events.keys.LOGS_MAXLEN`.
A Redis error drops that batch (counted in ``dropped``) and the thread carries on, so a
Redis outage costs log lines, never training steps.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import redis

from shoal.events.keys import LOGS_MAXLEN, job_keys
from shoal.events.streams import LogEntry

#: Longest message kept; the rest of a line is cut.
MAX_MSG = 4000


class RedisLogHandler(logging.Handler):
    """Ships records to ``stream`` from a background thread. ``worker`` is a string or a
    callable returning the current name (a worker learns its id only when it joins)."""

    def __init__(self, client: redis.Redis, stream: str, worker: str | Callable[[], str | None], *,
                 level: int = logging.INFO, maxlen: int = LOGS_MAXLEN, capacity: int = 1000, batch: int = 100):
        super().__init__(level)
        self.client = client
        self.stream = stream
        self._worker = worker
        self.maxlen = maxlen
        self.batch = batch
        self.dropped = 0
        self.sent = 0
        self._q: queue.Queue = queue.Queue(maxsize=capacity)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-log-handler", daemon=True)
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        self._thread.start()

    def worker_name(self) -> str:
        try:
            name = self._worker() if callable(self._worker) else self._worker
        except Exception:
            name = None
        return str(name) if name else "-"

    def emit(self, record: logging.LogRecord) -> None:
        if threading.current_thread() is self._thread:
            return  # redis-py logging from our own sends would loop
        try:
            msg = self.format(record)
            if len(msg) > MAX_MSG:
                msg = msg[:MAX_MSG] + " [...]"
            self._q.put_nowait((self.worker_name(), record.levelname, msg, record.created))
        except queue.Full:
            self.dropped += 1
        except Exception:  # formatting errors must not reach the training loop
            self.dropped += 1

    def _send(self, items: list[dict]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for worker, level, msg, created in items:
                entry = LogEntry(worker=worker, level=level, msg=msg, ts=round(created, 3))
                pipe.xadd(self.stream, entry.to_fields(), maxlen=self.maxlen, approximate=True)
            pipe.execute()
            self.sent += len(items)
        except Exception:  # Redis down, closed client...: drop, never raise
            self.dropped += len(items)

    def _drain(self, block_s: float) -> bool:
        try:
            items = [self._q.get(timeout=block_s)]
        except queue.Empty:
            return False
        while len(items) < self.batch:
            try:
                items.append(self._q.get_nowait())
            except queue.Empty:
                break
        try:
            self._send(items)
        finally:
            for _ in items:
                self._q.task_done()
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(0.2)

    def flush(self, timeout: float = 2.0) -> None:
        """Send what is queued, for at most ``timeout`` seconds (from the calling thread)."""
        if self._thread.is_alive():
            deadline = time.monotonic() + timeout
            while self._q.unfinished_tasks and time.monotonic() < deadline:
                time.sleep(0.02)
            return
        while self._drain(0.0):
            pass

    def close(self, timeout: float = 2.0) -> None:
        """Flush (bounded by ``timeout``) and stop the thread."""
        try:
            self.flush(timeout)
        finally:
            self._stop.set()
            self._thread.join(timeout)
            while True:  # what could not be sent in time is dropped
                try:
                    self._q.get_nowait()
                except queue.Empty:
                    break
                self.dropped += 1
                self._q.task_done()
            super().close()


@contextlib.contextmanager
def redis_logging(client: redis.Redis, job_id: str, worker: str | Callable[[], str | None],
                  logger: logging.Logger | None = None) -> Iterator[RedisLogHandler]:
    """Install a :class:`RedisLogHandler` for ``job_id`` on ``logger`` (default: root) for
    the duration of the block; flushes and removes it on exit."""
    target = logger or logging.getLogger()
    handler = RedisLogHandler(client, job_keys(job_id).logs, worker)
    target.addHandler(handler)
    try:
        yield handler
    finally:
        target.removeHandler(handler)
        handler.close()
