"""A ``torch.distributed.Store`` kept in Redis: the rendezvous of one generation's process group.

gloo (and nccl) exchange their connection addresses through a key/value *store*: every rank
``set``\\ s its own key and blocks in ``get``/``wait`` until its peers' keys appear. shoal puts
that store in Redis, under a prefix that is fresh for every generation
(``job_keys(job).rendezvous(generation)``), so that no key of an earlier generation - whose
group may have died half-way through its rendezvous - can be read by a later one. Re-using a
prefix after ``destroy_process_group`` can hang or mix up peers: one prefix per generation is
the rule (:mod:`shoal.worker.process_group` enforces it).

Layout under the prefix ``P`` (internal to this module; torch chooses the key names):

* ``P + "k:" + key`` - a LIST holding exactly one element, the value. A list rather than a
  string so that a blocking read is one command: ``BLMOVE k k RIGHT LEFT`` *rotates* the
  one-element list, i.e. it is a blocking "peek" that returns the value and leaves it in
  place. Redis serves every client blocked on the key when a value is pushed (the list stays
  non-empty after each rotation), so any number of ranks waiting for the same key all wake
  up at once: no polling, no pub/sub race (the value is durable, a late waiter returns at
  once). Requires Redis >= 6.2 / Valkey (BLMOVE).
* ``P + "t:" + base`` - a HASH rank -> value, and ``P + "c:" + base`` - a one-element LIST
  holding the complete *table* of ``base`` (see below): only when the store knows its
  ``rank`` and ``world_size``.
* ``P + "k:steal/<generation>/<step>"`` - a HASH of a step's chunk claims (``f<i>``/``b<i>``:
  chunks of rank i's slice taken from its front, from its back): :meth:`RedisStore.claim`,
  shoal's own, not torch's (:mod:`shoal.worker.steal`).

The address table (``rank``/``world_size`` given: what :meth:`shoal.worker.process_group.Rendezvous.join`
does). A gloo group connects its full mesh through the store: every rank ``set``\\ s its
address under ``base/<its rank>`` (torch 2.13 names it ``0//cpu//0/<rank>``), then, for every
peer ``i`` (itself included), ``wait([base/i])`` and ``get(base/i)``: ``2W + 1`` store calls per
rank, i.e. ``W (2W + 1)`` blocking Redis reads per group. Here a ``set`` of ``base/<own rank>``
also enters the value in ``base``'s table (one Lua call, whatever ``W``); the call that makes
the table complete (``W`` ranks) writes all of it, in rank order, as the one element of
``c:base`` and gets it back as its reply. A read of ``base/i`` on a rank that published in
``base`` is served from that table: one blocking rotation of ``c:base`` (which wakes every
waiter at once, as above) fetches every rank's value, kept for the later reads. So a rank's
whole rendezvous costs O(1) Redis commands - one ``set``, one blocking read (one more per
:data:`ABORT_POLL_S` it has to wait) - and a group O(W), instead of O(W) and O(W^2).
The table is read once: it assumes, as gloo's full mesh does, that every rank of the store's
world publishes ``base/<its rank>`` once with ``set``. A key written any other way (``add``,
``append``, ``compare_set``, ``multi_set``, ``delete_key``) takes its ``base`` off the table on
this rank, and keys of a ``base`` this rank did not publish (a NCCL unique id, a subgroup
whose ranks differ from the store's) are read one by one as before.

Every write is a Lua script (atomic: value + expiry together) and sets a TTL
(``ttl`` seconds, default 1 h), so the keys of old generations vanish on their own;
:meth:`RedisStore.cleanup` deletes a prefix at once. All keys share the job's ``{job}``
hash tag through the prefix, so the scripts are legal on Redis Cluster.

Timeouts: ``get`` and ``wait`` block at most the store timeout (``timeout`` property, set by
``set_timeout`` or the constructor) or the ``timeout`` passed to ``wait``, and then raise
``torch.distributed.DistStoreError`` - the error torch's own stores raise and
``init_process_group``/``_store_based_barrier`` expect (a ``RuntimeError``). A single Redis
call never blocks longer than about half the client's ``socket_timeout``, so a blocked read
cannot be mistaken for a dead connection. Redis failures propagate as ``redis.RedisError``;
:mod:`shoal.worker.process_group` translates them.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta

import redis
import torch.distributed as dist

from shoal.events.keys import RENDEZVOUS_TTL_S
from shoal.events import envvars

#: Set to ``1`` (benches only): the rendezvous of before issue 17 - every address read key by
#: key (``W (2W + 1)`` blocking reads per group) and a barrier polled every 2 ms - so that
#: ``bench/rendezvous_bench.py`` can measure both side by side in one run.
LEGACY_ENV = envvars.RENDEZVOUS_LEGACY


def legacy_rendezvous() -> bool:
    """Whether :data:`LEGACY_ENV` asks for the old rendezvous (a bench's comparison)."""
    return os.environ.get(LEGACY_ENV, "") == "1"


DEFAULT_TTL = float(RENDEZVOUS_TTL_S)  #: the store serves one generation's rendezvous
DEFAULT_TIMEOUT = timedelta(seconds=300)
#: With an ``abort`` callback, the longest single blocking read (how soon an abort is seen).
ABORT_POLL_S = 0.25

_SET = """
redis.call('DEL', KEYS[1])
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

_ADD = """
local cur = redis.call('LINDEX', KEYS[1], 0)
local n = tonumber(ARGV[1])
if cur and cur ~= '' then
  -- parse like std::stoll (as torch's stores): leading blanks, sign, digits; rest ignored
  local c = tonumber(string.match(cur, '^%s*([+-]?%d+)') or '')
  if c == nil then return redis.error_reply('add: value of key is not an integer') end
  n = n + c
end
local s = string.format('%d', n)
redis.call('DEL', KEYS[1])
redis.call('RPUSH', KEYS[1], s)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return s
"""

# Semantics of c10d::HashStore::compareSet: set when (absent and expected == "") or
# (present and current == expected), returning desired; else return the current value, or
# `expected` when the key is absent.
_COMPARE_SET = """
local cur = redis.call('LINDEX', KEYS[1], 0)
if (not cur and ARGV[1] == '') or (cur and cur == ARGV[1]) then
  redis.call('DEL', KEYS[1])
  redis.call('RPUSH', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return ARGV[2]
end
if not cur then return ARGV[1] end
return cur
"""

_APPEND = """
local cur = redis.call('LINDEX', KEYS[1], 0) or ''
redis.call('DEL', KEYS[1])
redis.call('RPUSH', KEYS[1], cur .. ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

_MULTI_SET = """
local ttl = ARGV[#ARGV]
for i, k in ipairs(KEYS) do
  redis.call('DEL', k)
  redis.call('RPUSH', k, ARGV[i])
  redis.call('PEXPIRE', k, ttl)
end
return #KEYS
"""


# Set ``base/<rank>`` (KEYS[1]) and enter it in the table of ``base`` (KEYS[2]); the call that
# completes the table (ARGV[4] ranks) writes all of it, as netstrings in rank order, into
# KEYS[3] and returns it (else nil).
_PUBLISH = """
redis.call('DEL', KEYS[1])
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
local w = tonumber(ARGV[4])
if redis.call('HLEN', KEYS[2]) < w then return false end
local flat = redis.call('HGETALL', KEYS[2])
local byrank = {}
for i = 1, #flat, 2 do byrank[flat[i]] = flat[i + 1] end
local parts = {}
for r = 0, w - 1 do
  local v = byrank[tostring(r)]
  if v == nil then return false end
  parts[#parts + 1] = string.format('%d:', #v) .. v
end
local blob = table.concat(parts)
redis.call('DEL', KEYS[3])
redis.call('RPUSH', KEYS[3], blob)
redis.call('PEXPIRE', KEYS[3], ARGV[2])
return blob
"""

# A step's chunk claims (:meth:`RedisStore.claim`): KEYS[1] a HASH of ``f<i>`` (chunks taken
# from the front of block i, by its owner) and ``b<i>`` (taken from its back, by others);
# ARGV[1] the caller's block, ARGV[2] the TTL, ARGV[3..] each block's chunks. The caller's next
# front chunk while its block has one; else the back chunk of the block with the largest share
# of its chunks left (blocks are sized by their owners' speed: the one furthest from done);
# {-1, -1} once every chunk is taken.
_CLAIM = """
local own = tonumber(ARGV[1])
local counts = {}
for i = 3, #ARGV do counts[#counts + 1] = tonumber(ARGV[i]) end
local mine = redis.call('HMGET', KEYS[1], 'f' .. own, 'b' .. own)
local f = tonumber(mine[1]) or 0
if counts[own + 1] - f - (tonumber(mine[2]) or 0) > 0 then  -- the common case: O(1), whatever the world
  redis.call('HSET', KEYS[1], 'f' .. own, f + 1)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {own, f}
end
local taken = {}
local flat = redis.call('HGETALL', KEYS[1])
for i = 1, #flat, 2 do taken[flat[i]] = tonumber(flat[i + 1]) end
local function left(i)
  return counts[i + 1] - (taken['f' .. i] or 0) - (taken['b' .. i] or 0)
end
local best, share = -1, 0
for i = 0, #counts - 1 do
  local l = left(i)
  if l > 0 and l / counts[i + 1] > share then best, share = i, l / counts[i + 1] end
end
if best < 0 then return {-1, -1} end
local b = taken['b' .. best] or 0
redis.call('HSET', KEYS[1], 'b' .. best, b + 1)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {best, counts[best + 1] - 1 - b}
"""

#: ``base/<rank>``: a key gloo's full mesh publishes once per rank
_RANK_KEY = re.compile(r"^(.*)/(\d+)$")


def _parse_table(blob: bytes, world_size: int) -> list[bytes]:
    """The values of a table written by ``_PUBLISH`` (netstrings ``<len>:<bytes>``), by rank."""
    out: list[bytes] = []
    i = 0
    for _ in range(world_size):
        j = blob.index(b":", i)
        n = int(blob[i:j])
        out.append(blob[j + 1:j + 1 + n])
        i = j + 1 + n
    if i != len(blob):
        raise dist.DistStoreError(f"RedisStore: malformed address table ({len(blob)} bytes, {world_size} ranks)")
    return out


def _to_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\^" else c for c in s)


def _seconds(t: timedelta | float | int) -> float:
    return t.total_seconds() if isinstance(t, timedelta) else float(t)


class RedisStore(dist.Store):
    """A ``torch.distributed.Store`` whose keys live in Redis under ``prefix``.

    ``client`` is a redis-py client (``decode_responses`` must be False); it is shared, not
    closed, by the store. ``prefix`` must come from ``job_keys(job).rendezvous(generation)``
    and must not be reused once a group using it was destroyed. ``timeout`` bounds every
    blocking read (``get``, ``wait``); ``ttl`` (seconds) is the expiry given to every key.
    ``max_wait`` (seconds), when set, caps every blocking read even when the caller passes a
    longer timeout: gloo waits for its peers with the *collective* timeout, and
    :meth:`shoal.worker.process_group.Rendezvous.join` uses ``max_wait`` to bound the rendezvous by its
    own, usually shorter, timeout. ``abort``, when given, is asked before every blocking read
    (each at most :data:`ABORT_POLL_S`): a non-empty answer ends the wait with DistStoreError
    naming it (the rendezvous of a generation whose member the coordinator evicted).
    ``rank`` and ``world_size``, when given (both), serve the full mesh's address reads from
    one table per group (see the module docstring): O(1) Redis commands per rank.

    Implements everything gloo/nccl and ``init_process_group`` use: ``set``, ``get``,
    ``wait``, ``add``, ``compare_set``, ``check``, ``delete_key``, ``num_keys``,
    ``set_timeout``/``timeout`` (inherited), plus ``append``, ``multi_get``, ``multi_set``,
    ``list_keys`` and ``clone``. Thread-safe as far as the redis-py client is.
    """

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        *,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        ttl: float = DEFAULT_TTL,
        max_wait: float | None = None,
        abort: Callable[[], str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        if not prefix:
            raise ValueError("RedisStore needs a non-empty key prefix")
        if (rank is None) != (world_size is None) or (world_size is not None and not 0 <= rank < world_size):
            raise ValueError(f"rank and world_size go together, 0 <= rank < world_size; got {rank}, {world_size}")
        self._rank, self._world_size = rank, world_size
        #: bases whose ``base/<rank>`` this rank published with set(): their keys come from a table
        self._published: set[str] = set()
        #: complete tables, by base: every rank's value, in rank order
        self._tables: dict[str, list[bytes]] = {}
        conn_kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
        if conn_kwargs.get("decode_responses"):
            raise ValueError("RedisStore needs a redis client with decode_responses=False")
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        if max_wait is not None and max_wait <= 0:
            raise ValueError(f"max_wait must be positive, got {max_wait}")
        self._max_wait = max_wait
        #: asked while a read blocks: a non-empty answer ends it (DistStoreError naming it)
        self._abort = abort
        self._client = client
        self._prefix = prefix
        self._ttl_ms = int(ttl * 1000)
        sock = conn_kwargs.get("socket_timeout")
        # Longest single blocking Redis call: well inside the socket timeout.
        self._max_block = max(0.05, float(sock) / 2) if sock else 30.0
        if abort is not None:  # answer an abort within a quarter second
            self._max_block = min(self._max_block, ABORT_POLL_S)
        self._set = client.register_script(_SET)
        self._add = client.register_script(_ADD)
        self._cas = client.register_script(_COMPARE_SET)
        self._append = client.register_script(_APPEND)
        self._mset = client.register_script(_MULTI_SET)
        self._publish = client.register_script(_PUBLISH)
        self._claim = client.register_script(_CLAIM)
        self.set_timeout(timedelta(seconds=_seconds(timeout)))

    # --- helpers --------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def client(self) -> redis.Redis:
        return self._client

    def _k(self, key: str) -> str:
        return f"{self._prefix}k:{key}"

    def _limit(self, seconds: float) -> float:
        return seconds if self._max_wait is None else min(seconds, self._max_wait)

    def _block_until(self, key: str, deadline: float, timeout_s: float) -> bytes:
        """Return the value of ``key`` once it exists; DistStoreError after ``deadline``."""
        return self._block_on(self._k(key), f"key {key!r}", deadline, timeout_s)

    def _block_on(self, rk: str, what: str, deadline: float, timeout_s: float) -> bytes:
        """The one element of the list ``rk`` once it exists (a rotating BLMOVE: every waiter
        wakes); DistStoreError naming ``what`` after ``deadline`` or on an abort."""
        while True:
            why = self._abort() if self._abort is not None else ""
            if why:
                raise dist.DistStoreError(f"RedisStore: aborted while waiting for {what} ({why})")
            remaining = deadline - time.monotonic()
            if remaining <= 0.001:
                value = self._client.lindex(rk, 0)  # a last non-blocking look
                if value is not None:
                    return value
                raise dist.DistStoreError(
                    f"RedisStore: timed out after {timeout_s:.3f}s waiting for {what} "
                    f"(prefix {self._prefix!r})"
                )
            value = self._client.blmove(rk, rk, min(remaining, self._max_block), "RIGHT", "LEFT")
            if value is not None:
                return value

    # --- the address table ----------------------------------------------------------------
    def _table_entry(self, key: str) -> tuple[str, int] | None:
        """``(base, i)`` when ``key`` is ``base/i`` of a table this rank published in."""
        if not self._published:
            return None
        m = _RANK_KEY.match(key)
        if m is None or m.group(1) not in self._published:
            return None
        i = int(m.group(2))
        return (m.group(1), i) if i < self._world_size else None

    def _table(self, base: str, deadline: float, timeout_s: float) -> list[bytes]:
        """Every rank's value of ``base``, once all of them published (one blocking read,
        then kept); DistStoreError naming the missing ranks after ``deadline``."""
        table = self._tables.get(base)
        if table is not None:
            return table
        try:
            blob = self._block_on(f"{self._prefix}c:{base}", f"every rank's key {base!r}/<rank>", deadline, timeout_s)
        except dist.DistStoreError as exc:
            have = {int(r) for r in self._client.hkeys(f"{self._prefix}t:{base}")}
            missing = [r for r in range(self._world_size) if r not in have]
            raise dist.DistStoreError(f"{exc}; ranks that never published theirs: {missing}") from None
        table = self._tables[base] = _parse_table(blob, self._world_size)
        return table

    def _forget(self, key: str) -> None:
        """``key`` is written other than by its rank's set(): its base is read key by key."""
        m = _RANK_KEY.match(key)
        if m is not None and m.group(1) in self._published:
            self._published.discard(m.group(1))
            self._tables.pop(m.group(1), None)

    def _read(self, key: str, deadline: float, timeout_s: float) -> bytes:
        entry = self._table_entry(key)
        if entry is None:
            return self._block_until(key, deadline, timeout_s)
        base, i = entry
        return self._table(base, deadline, timeout_s)[i]

    # --- the Store API --------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        """Set ``key`` to ``value`` (bytes or str) and wake every reader blocked on it. With a
        ``rank``, ``base/<rank>`` is also entered in ``base``'s address table."""
        m = _RANK_KEY.match(key) if self._world_size is not None else None
        if m is None or int(m.group(2)) != self._rank:
            self._forget(key)
            self._set(keys=[self._k(key)], args=[_to_bytes(value), self._ttl_ms])
            return
        base = m.group(1)
        self._tables.pop(base, None)
        blob = self._publish(keys=[self._k(key), f"{self._prefix}t:{base}", f"{self._prefix}c:{base}"],
                             args=[_to_bytes(value), self._ttl_ms, self._rank, self._world_size])
        self._published.add(base)
        if blob is not None:  # this call completed the table
            self._tables[base] = _parse_table(blob, self._world_size)

    def get(self, key: str) -> bytes:
        """The value of ``key``, blocking until it is set; DistStoreError after the timeout."""
        t = self._limit(_seconds(self.timeout))
        return self._read(key, time.monotonic() + t, t)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Block until every key in ``keys`` exists, at most ``timeout`` (default: the store
        timeout) in total; raises DistStoreError naming the first missing key (for a table:
        the ranks missing)."""
        t = self._limit(_seconds(self.timeout if timeout is None else timeout))
        deadline = time.monotonic() + t
        for key in keys:
            self._read(key, deadline, t)

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key in ``keys`` exists now (never blocks)."""
        if not keys:
            return True
        return int(self._client.exists(*[self._k(k) for k in keys])) == len(keys)

    def add(self, key: str, value: int) -> int:
        """Atomically add ``value`` to the integer at ``key`` (absent or empty = 0); returns the
        sum. The stored value is its decimal text, as with torch's stores; a value that does
        not start with an integer raises ``redis.ResponseError``."""
        self._forget(key)
        return int(self._add(keys=[self._k(key)], args=[int(value), self._ttl_ms]))

    def claim(self, key: str, block: int, chunks: Sequence[int]) -> tuple[int, int] | None:
        """Take the next chunk of a step's work split in blocks of ``chunks`` chunks (block i
        belongs to rank i): ``block``'s next chunk from its front while it has one, else the
        last untaken chunk of the block with the largest share of its chunks left. Returns
        (block, chunk index), or None when every chunk of every block is taken. Atomic (one
        Lua call): no chunk is ever given twice. Not a torch store operation: shoal's within-step
        balancing (:mod:`shoal.worker.steal`)."""
        if not 0 <= block < len(chunks):
            raise ValueError(f"block {block} is not one of the {len(chunks)} blocks")
        got = self._claim(keys=[self._k(key)], args=[int(block), self._ttl_ms, *(int(c) for c in chunks)])
        b, i = int(got[0]), int(got[1])
        return None if b < 0 else (b, i)

    def compare_set(self, key: str, expected_value: bytes | str, desired_value: bytes | str) -> bytes:
        """Atomic compare-and-set with ``c10d`` semantics (see ``HashStore``): sets
        ``desired_value`` when the key holds ``expected_value`` (or is absent and
        ``expected_value`` is empty) and returns it; otherwise returns the current value, or
        ``expected_value`` when the key is absent."""
        self._forget(key)
        return bytes(
            self._cas(
                keys=[self._k(key)],
                args=[_to_bytes(expected_value), _to_bytes(desired_value), self._ttl_ms],
            )
        )

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True when it existed."""
        self._forget(key)
        return bool(self._client.delete(self._k(key)))

    def num_keys(self) -> int:
        """Number of keys currently in this store (a SCAN of the prefix: O(keys))."""
        return sum(1 for _ in self._scan(self._prefix + "k:"))

    def append(self, key: str, value: bytes | str) -> None:
        """Atomically append ``value`` to the value of ``key`` (absent = empty)."""
        self._forget(key)
        self._append(keys=[self._k(key)], args=[_to_bytes(value), self._ttl_ms])

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Values of ``keys``, each blocking like :meth:`get`, within one store timeout."""
        t = self._limit(_seconds(self.timeout))
        deadline = time.monotonic() + t
        return [self._read(k, deadline, t) for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        """Set several keys atomically (one script)."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        if not keys:
            return
        for k in keys:
            self._forget(k)
        self._mset(
            keys=[self._k(k) for k in keys],
            args=[_to_bytes(v) for v in values] + [self._ttl_ms],
        )

    def list_keys(self) -> list[str]:
        """The (torch-side) names of every key in this store."""
        start = len(self._prefix) + 2
        return sorted(k.decode()[start:] for k in self._scan(self._prefix + "k:"))

    def has_extended_api(self) -> bool:
        return True

    # torch's C++ trampoline (used when a C++ PrefixStore/backend calls into this store)
    # dispatches these two under their C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys

    def clone(self) -> "RedisStore":
        """A store on the same client, prefix, timeout, TTL, abort and world (its tables start
        empty: a clone reads key by key what it did not publish itself)."""
        return RedisStore(
            self._client, self._prefix, timeout=self.timeout, ttl=self._ttl_ms / 1000, max_wait=self._max_wait,
            abort=self._abort, rank=self._rank, world_size=self._world_size,
        )

    # --- housekeeping ---------------------------------------------------------------------
    def _scan(self, prefix: str) -> Iterable[bytes]:
        return self._client.scan_iter(match=_glob_escape(prefix) + "*", count=500)

    def cleanup(self) -> int:
        """Delete every key under this store's prefix; returns how many were deleted.

        Call only once every member of the generation has left its group (or never: the TTL
        removes the keys anyway). Deleting keys a rank is still waiting for makes it time out.
        """
        return cleanup_prefix(self._client, self._prefix)


def cleanup_prefix(client: redis.Redis, prefix: str, batch: int = 500) -> int:
    """Delete (UNLINK) every key whose name starts with ``prefix``; returns the count."""
    if not prefix:
        raise ValueError("refusing to clean up an empty prefix")
    deleted = 0
    chunk: list[bytes] = []
    for key in client.scan_iter(match=_glob_escape(prefix) + "*", count=batch):
        chunk.append(key)
        if len(chunk) >= batch:
            deleted += int(client.unlink(*chunk))
            chunk.clear()
    if chunk:
        deleted += int(client.unlink(*chunk))
    return deleted
