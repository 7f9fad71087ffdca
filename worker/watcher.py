"""Follows the job's generation stream and state from a background thread.

The training loop reads :attr:`GenerationWatcher.latest` and :attr:`job_state` (plain
attribute reads) instead of asking Redis on every step: a new shard table arrives through
a blocking XREAD as soon as the coordinator publishes it, and the job state is refreshed
at least every ``interval`` seconds. Redis errors are logged and retried; they never
reach the training thread. ``on_table`` is called (from the watcher's thread) with each new
table as it arrives: the training worker aborts a group whose peer the table evicted;
``on_ended`` once the job reached a final state: it aborts a group still forming or stuck.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from shoal.events.keys import JobKeys
from shoal.events.models import ShardTable
from shoal.events.states import is_terminal

log = logging.getLogger("shoal.worker.watcher")


class GenerationWatcher:
    def __init__(self, client: redis.Redis, keys: JobKeys, *, interval: float = 1.0,
                 on_table: Callable[[ShardTable], None] | None = None,
                 on_ended: Callable[[str], None] | None = None):
        self._client = client
        self._on_table = on_table
        #: called once (from the watcher's thread) when the job reaches a final state
        self._on_ended = on_ended
        self._keys = keys
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.latest = 0
        self.job_state = "pending"
        self._cursor = "0-0"

    def refresh(self) -> None:
        """One synchronous read of the current table and job state."""
        pipe = self._client.pipeline(transaction=False)
        pipe.xrevrange(self._keys.generations, count=1)
        pipe.get(self._keys.shard)
        pipe.hget(self._keys.state, "state")
        last, raw, state = pipe.execute()
        self._cursor = last[0][0].decode() if last else "0-0"  # nothing published after this is missed
        if raw:
            self.latest = max(self.latest, ShardTable.model_validate_json(raw).generation)
        self.job_state = state.decode() if state else "pending"

    def start(self) -> None:
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="generation-watcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        cursor = self._cursor
        block_ms = max(1, int(self._interval * 1000))
        while not self._stop.is_set():
            try:
                resp = self._client.xread({self._keys.generations: cursor}, count=100, block=block_ms)
                for _stream, entries in resp or []:
                    for sid, fields in entries:
                        cursor = sid.decode() if isinstance(sid, bytes) else sid
                        table = ShardTable.model_validate_json(fields[b"data"])
                        if table.generation > self.latest:
                            self.latest = table.generation
                            self._notify(table)
                state = self._client.hget(self._keys.state, "state")
                self.job_state = state.decode() if state else "pending"
                if is_terminal(self.job_state) and self._on_ended is not None:
                    ended, self._on_ended = self._on_ended, None
                    ended(self.job_state)
            except (redis.RedisError, ValueError) as exc:
                log.warning("generation watcher: %s", exc)
                self._stop.wait(self._interval)

    def _notify(self, table: ShardTable) -> None:
        if self._on_table is None:
            return
        try:
            self._on_table(table)
        except Exception:  # noqa: BLE001 - the watcher must go on
            log.exception("generation watcher: handling generation %d failed", table.generation)
