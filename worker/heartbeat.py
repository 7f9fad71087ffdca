"""Worker heartbeats: a TTL'd progress key plus the last-seen sorted set, in one Lua call.

The score is Redis server time, so clock skew between machines never matters. ``ZADD XX``
only refreshes a worker the coordinator is watching: once it was declared Failed (and
forgotten) its heartbeats no longer count, and :meth:`Heartbeater.beat` returns False so
the worker knows it was evicted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from shoal.events.keys import JobKeys
from shoal.events.models import Heartbeat
from shoal.core.durable import execute_confirmed
from shoal.core.connection import without_retries

log = logging.getLogger("shoal.worker.heartbeat")

# KEYS: heartbeat key, last_seen zset, busy zset, workers hash. ARGV: worker_id, value, ttl_ms,
# busy_ms (how long the current step has been busy; -1: not busy), pid (0: not checked).
# Returns 1 if watched as this process: the id is in last_seen and its record names this pid.
# Worker ids restart after Redis lost its data, so a process whose record was lost can find
# its old id watched again as another process's (that one learnt of the loss first and joined
# anew); it must not take that membership for its own (it would beat for the other, never
# rejoin, and the job would wait for it: measured, a fresh-clone run's Redis-loss test).
_BEAT = """
local t = redis.call('TIME')
local ms = t[1] * 1000 + math.floor(t[2] / 1000)
local watched = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not watched then return 0 end
local pid = tonumber(ARGV[5])
if pid > 0 then
  local doc = redis.call('HGET', KEYS[4], ARGV[1])
  if doc then
    local ok, rec = pcall(cjson.decode, doc)
    local theirs = ok and type(rec) == 'table' and tonumber(rec['pid']) or 0
    if theirs > 0 and theirs ~= pid then return 0 end
  end
end
redis.call('ZADD', KEYS[2], 'XX', ms, ARGV[1])
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
local busy = tonumber(ARGV[4])
if busy >= 0 then
  redis.call('ZADD', KEYS[3], ms - busy, ARGV[1])
else
  redis.call('ZREM', KEYS[3], ARGV[1])
end
return 1
"""


class CutOff(Exception):
    """The commit fence could not reach Redis for longer than the heartbeat TTL: the
    coordinator may have declared this worker failed meanwhile, so nothing may be committed."""


class Heartbeater:
    """Refreshes a worker's heartbeat every ``interval`` s from a daemon thread.

    ``update(**fields)`` changes what the next beat publishes (step, loss, digest...).
    :attr:`evicted` becomes True, for good, once a beat finds that the coordinator no longer
    watches this worker (a beat of the heartbeat thread, or of the training thread through
    :meth:`still_member`).

    The thread beats on a connection pool of its own whose commands fail at once instead of
    riding out an outage: a failed beat is simply tried again one ``interval`` later, so after
    a Redis restart the worker is seen again within an interval of the server's return (a
    retrying client would wait out its backoff, up to a second, eating into the TTL), and
    nothing the training thread does with its own client can delay a beat. The thread logs
    once when beats start failing and once when they are back, and warns when a beat comes
    later than half the TTL after the previous one (the process was frozen or starved of CPU,
    or Redis was slow): the evidence when a live worker is declared failed.
    :meth:`beat` called directly uses ``client`` as given (riding out outages if it does).

    Progress: the training thread marks when a step is busy with its own work
    (:meth:`busy`); each beat publishes since when (Redis server time, in the job's ``busy``
    set), so the coordinator can evict a member whose step is stuck while its heartbeat lives.
    """

    def __init__(self, client: redis.Redis, keys: JobKeys, worker_id: str, *, interval: float, ttl: float, pid: int = 0,
                 fence_timeout: float | None = None, fence_wait: float = 30.0):
        self._script = client.register_script(_BEAT)
        #: the thread's beats wait at most an interval and a second: once Redis is back (or a
        #: replica was promoted) a live worker beats within about two intervals and a second,
        #: the grace a coordinator back from an outage gives it (``coordinator/loop.py``,
        #: ``return_grace_ms``), even when an attempt hung on a server that was gone
        self._fast = without_retries(client, timeout=interval + 1.0)
        #: the training thread's own beat (:meth:`still_member`) waits at most this long on
        #: Redis: a blackholed server must not hold a step for the socket timeout, longer than
        #: the peers' collective timeout (default: a quarter of the TTL, at most 1 s)
        self.fence_timeout = fence_timeout if fence_timeout is not None else min(1.0, ttl / 4)
        self._fence = without_retries(client, timeout=self.fence_timeout)
        #: the longest :meth:`still_member` waits for Redis once the TTL passed without a
        #: confirmed beat, before it gives the step up (:class:`CutOff`)
        self.fence_wait = fence_wait
        self._busy_since: float | None = None
        #: monotonic time of this worker's last committed step (None: none yet)
        self._committed_at: float | None = None
        self._keys = keys
        self._ttl_ms = int(ttl * 1000)
        self.interval = interval
        self.worker_id = worker_id
        self._value = Heartbeat(worker_id=worker_id, pid=pid)  # its pid: the process its record must name (0: any)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.evicted = False
        #: called once (from the thread whose beat found it) when :attr:`evicted` becomes True
        self.on_evicted: Callable[[], None] | None = None
        #: set while the thread's beats raise (Redis unreachable): when they started failing,
        #: and when the thread last tried
        self._failing_since: float | None = None
        self._tried_at = time.monotonic()
        #: monotonic time at which the last beat that found us watched was sent
        self.confirmed_at = time.monotonic()

    def update(self, **fields) -> None:
        with self._lock:
            self._value = self._value.model_copy(update=fields)

    def committed(self, at: float) -> None:
        """This worker committed a step at monotonic time ``at``: every beat from now on says
        how long ago (``Heartbeat.since_commit``), so a reader computes the job's last commit
        on Redis's clock (the beat's ``last_seen`` score minus it), whatever the step timers say."""
        self._committed_at = at

    def busy(self, on: bool, *, since: float | None = None) -> None:
        """The current step is (``on``) or is no longer busy with its own work - data, forward,
        backward, user code; not waiting on peers. Published with the next beat. ``since``
        (monotonic; default now) backdates the start: own work that ran since then without
        waiting on peers (an evaluation before the step) counts toward the step timeout."""
        self._busy_since = (time.monotonic() if since is None else since) if on else None

    def beat(self, *, client: redis.Redis | None = None) -> bool:
        """One beat now; False once this worker is evicted. Raises redis.RedisError (among
        them NotReplicated, ``shoal.core.durable``: no replica confirmed it)."""
        sent = time.monotonic()
        with self._lock:
            beat = self._value
            if self._committed_at is not None:
                beat = beat.model_copy(update={"since_commit": round(max(0.0, sent - self._committed_at), 3)})
            value, pid = beat.model_dump_json(), beat.pid
        since = self._busy_since
        busy_ms = int((sent - since) * 1000) if since is not None else -1
        # under Sentinel a beat counts once a replica holds it, confirmed on the connection that
        # sent it: one acknowledged by a primary cut off from its replicas (soon demoted, its
        # writes dropped) proves nothing, and neither does its answer (evicted or not)
        target = client if client is not None else self._script.registered_client
        pipe = target.pipeline(transaction=False)
        self._script(keys=[self._keys.heartbeat(self.worker_id), self._keys.last_seen, self._keys.busy,
                           self._keys.workers],
                     args=[self.worker_id, value, self._ttl_ms, busy_ms, pid], client=pipe)
        ok = bool(execute_confirmed(target, pipe, f"heartbeat of {self.worker_id}",
                                    timeout_ms=max(1, int(self.fence_timeout * 1000)))[0])
        if ok:
            self.confirmed_at = max(self.confirmed_at, sent)
        elif not self.evicted:
            self.evicted = True
            hook, self.on_evicted = self.on_evicted, None
            if hook is not None:
                try:
                    hook()
                except Exception:  # noqa: BLE001 - a beat must not fail on it
                    log.exception("heartbeat: handling the eviction failed")
        return ok

    def still_member(self) -> bool:
        """Whether this worker may commit a step: the commit fence. False once a beat found it
        evicted; raises :class:`CutOff` when Redis could not confirm it for longer than the
        TTL (then the coordinator may have declared it failed).

        Free while beats are recent; when the last confirmed beat was sent more than half the
        TTL ago (the process was frozen or starved: the coordinator may have declared it failed
        since), beats once now to find out, waiting at most :attr:`fence_timeout` for Redis
        (a blackholed server must not hold a step for the socket timeout). If Redis cannot be
        reached and the last confirmed beat is younger than the TTL, True: the coordinator
        cannot have declared it failed yet (it counts the TTL from the last beat it got, which
        is no older than the last one confirmed); while the thread's beats are failing, that
        holds without trying, unless the thread itself has not tried for half the TTL (a
        frozen process must still ask). Past the TTL, nothing is committed unconfirmed: it
        tries again until Redis answers or :attr:`fence_wait` passed, then raises CutOff; the
        caller keeps its state and rejoins once Redis is back."""
        if self.evicted:
            return False
        now, half, ttl = time.monotonic(), self._ttl_ms / 2000, self._ttl_ms / 1000
        if now - self.confirmed_at <= half:
            return True
        failing = self._failing_since is not None and now - self._tried_at <= half
        if failing and now - self.confirmed_at < ttl:
            return True
        deadline = now + self.fence_wait
        while True:
            try:
                return self.beat(client=self._fence)
            except redis.RedisError as exc:
                now = time.monotonic()
                if now - self.confirmed_at < ttl:
                    return True
                if now >= deadline:
                    raise CutOff(f"cut off from Redis: no heartbeat confirmed for {now - self.confirmed_at:.1f} s "
                                 f"(ttl {ttl:g} s; {exc}); nothing committed, state kept") from exc
                time.sleep(min(self.interval, max(0.0, deadline - now)))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.worker_id}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fast.close()
        self._fence.close()

    def _run(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.is_set():
            self._tried_at = time.monotonic()
            try:
                self.beat(client=self._fast)
            except redis.RedisError as exc:
                if self._failing_since is None:
                    self._failing_since = self._tried_at
                    log.warning("heartbeat failing (%s); trying again every %.1f s", exc, self.interval)
            else:
                now = time.monotonic()
                if self._failing_since is not None:
                    log.warning("heartbeat back after %.1f s of failures", now - self._failing_since)
                    self._failing_since = None
                elif (now - last_ok) * 1000 > self._ttl_ms / 2:
                    log.warning("heartbeat %.2f s after the previous one (interval %.1f s, ttl %.1f s): "
                                "this process was frozen or starved of CPU, or Redis answered slowly",
                                now - last_ok, self.interval, self._ttl_ms / 1000)
                last_ok = now
            self._stop.wait(self.interval)
