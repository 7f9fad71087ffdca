"""The Redis barrier where the members of a generation meet before forming its group.

Every member of generation ``g``'s table *arrives* - one Lua call adds its worker id to the
set ``barrier(g)``; the call whose id completes the set (``world`` ids) pushes ``world``
tokens to the list ``barrier_done(g)`` - and then *waits*: one blocking ``BLPOP`` on
``barrier_done(g)`` and on its own ``barrier_wake(g, worker)``, at most one slice long. Each
member takes one token, so the last arrival wakes every member at once, without polling. The
set is the truth, the tokens only wake: a wait that ends without a token reads the set's size
(a token lost with a connection cannot strand a member past one slice).

``barrier_wake`` is for the other events that end a wait - a newer table, the job's end -
which the worker's watcher thread learns first: it calls :meth:`GenerationBarrier.wake`, which
pushes a token there while a wait is in progress. A wait registers itself *before* it asks
its ``interrupted`` callback, and the watcher updates what that callback reads *before* it
calls ``wake``: so either the callback sees the event or the wake token is pushed.

Redis commands per member and switch: one arrival and one ``BLPOP`` when every member arrives
within one slice (the last to arrive, none: it knows it completed the set) - O(1) per member,
O(W) per group; a longer wait costs one ``BLPOP`` and one ``SCARD`` per slice. Every key lives
under the generation's rendezvous prefix and expires after :data:`RENDEZVOUS_TTL_S`.

:data:`shoal.worker.store.LEGACY_ENV` (benches only) restores the barrier of before issue 17:
``SCARD`` + ``GET`` + ``HGET`` every 2 ms (:meth:`GenerationBarrier.poll_legacy`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from shoal.events.keys import RENDEZVOUS_TTL_S, JobKeys
from shoal.events.models import ShardTable

#: The legacy barrier's pause between two polls (what issue 17 replaced), seconds.
LEGACY_POLL_S = 0.002

# KEYS[1] arrived (SET), KEYS[2] done (LIST); ARGV: worker id, world size, TTL (ms).
# Returns the number arrived; the arrival that completes the set pushes one token per member.
_ARRIVE = """
local added = redis.call('SADD', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local n = redis.call('SCARD', KEYS[1])
local w = tonumber(ARGV[2])
if added == 1 and n >= w then
  local batch = {}
  for i = 1, w do
    batch[#batch + 1] = '1'
    if #batch == 1000 or i == w then
      redis.call('RPUSH', KEYS[2], unpack(batch))
      batch = {}
    end
  end
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return n
"""


@dataclass(frozen=True)
class LegacyPoll:
    """One poll of the legacy barrier: arrivals, the newest published generation, job state."""

    arrived: int
    newest: int
    job_state: str


class GenerationBarrier:
    """The barrier of one worker (``client``: its Redis client, ``keys``: its job's keys).

    :meth:`arrive` and :meth:`wait` are called by the training thread, :meth:`wake` by any
    other. Redis errors propagate (the training loop rides out an outage and performs the
    action again: arriving twice is harmless)."""

    def __init__(self, client: redis.Redis, keys: JobKeys) -> None:
        self._client = client
        self._keys = keys
        self._arrive = client.register_script(_ARRIVE)
        sock = getattr(client.connection_pool, "connection_kwargs", {}).get("socket_timeout")
        #: the longest single BLPOP: well inside the socket timeout
        self.max_block = max(0.05, float(sock) / 2) if sock else 30.0
        self._lock = threading.Lock()
        #: (generation, worker id) while :meth:`wait` blocks
        self._waiting: tuple[int, str] | None = None
        #: (generation, arrivals) as the last arrive()/wait() learnt them
        self._known: tuple[int, int] = (0, 0)

    def arrive(self, generation: int, worker_id: str, world: int) -> int:
        """Add ``worker_id`` to ``generation``'s barrier of ``world`` members; returns how many
        have arrived (``world``: this arrival completed it and woke everyone)."""
        keys = self._keys
        n = int(self._arrive(keys=[keys.barrier(generation), keys.barrier_done(generation)],
                             args=[worker_id, world, RENDEZVOUS_TTL_S * 1000]))
        self._known = (generation, n)
        return n

    def wait(self, generation: int, worker_id: str, world: int, seconds: float,
             interrupted: Callable[[], bool] = lambda: False) -> int:
        """Block at most ``seconds`` (and :attr:`max_block`) until all ``world`` members of
        ``generation`` arrived; returns how many have (``>= world``: all of them), as far as
        known. Returns early, without counting again, when ``interrupted()`` is true (checked
        once the wait is registered) or :meth:`wake` was called."""
        known_gen, known = self._known
        known = known if known_gen == generation else 0
        if known >= world:
            return known
        keys = self._keys
        with self._lock:
            self._waiting = (generation, worker_id)
        try:
            if interrupted():
                return known
            got = self._client.blpop([keys.barrier_done(generation), keys.barrier_wake(generation, worker_id)],
                                     timeout=max(0.01, min(seconds, self.max_block)))
        finally:
            with self._lock:
                self._waiting = None
        if got is not None:
            if got[0].decode() == keys.barrier_done(generation):
                self._known = (generation, world)
                return world
            return known  # woken: the caller looks at what changed
        n = int(self._client.scard(keys.barrier(generation)))
        self._known = (generation, n)
        return n

    def wake(self, newer: int | None = None) -> bool:
        """(Any thread.) End the wait in progress, if any - with ``newer``, only a wait at an
        older generation's barrier - at once; True when it woke one. For events the wait's
        ``interrupted`` callback reads: update them first."""
        with self._lock:
            waiting = self._waiting
        if waiting is None or (newer is not None and waiting[0] >= newer):
            return False
        key = self._keys.barrier_wake(*waiting)
        pipe = self._client.pipeline(transaction=False)
        pipe.rpush(key, "1")
        pipe.pexpire(key, RENDEZVOUS_TTL_S * 1000)
        pipe.execute()
        return True

    def poll_legacy(self, generation: int) -> LegacyPoll:
        """The barrier of before issue 17 (benches only): sleep 2 ms, then read the arrivals,
        the newest table and the job's state."""
        time.sleep(LEGACY_POLL_S)
        pipe = self._client.pipeline(transaction=False)
        pipe.scard(self._keys.barrier(generation))
        pipe.get(self._keys.shard)
        pipe.hget(self._keys.state, "state")
        arrived, raw, state = pipe.execute()
        newest = ShardTable.model_validate_json(raw).generation if raw else 0
        return LegacyPoll(int(arrived), newest, (state or b"").decode())
