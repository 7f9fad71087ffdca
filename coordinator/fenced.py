"""The fenced write path: every coordinator write to Redis goes through one Lua script.

The script first checks that ``keys.lease`` still holds our token and ``keys.epoch`` still
equals our epoch, then applies a batch of whitelisted commands atomically. A stale
writer gets ``StaleEpoch`` and nothing is applied. Batches are built with
:class:`FencedBatch`; keys must belong to the job (same hash tag), which the builder checks.
"""

from __future__ import annotations

import json

import redis

from shoal.coordinator.errors import StaleEpoch
from shoal.core.durable import execute_confirmed
from shoal.events.keys import JobKeys
from shoal.storage.latest import FORWARD_SET_LUA

#: The error code the script below replies with when the writer no longer holds the job
#: (Redis error replies are ``CODE message``; redis-py raises them as ResponseError: _stale).
STALE_CODE = "STALE"

_APPLY = FORWARD_SET_LUA + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('STALE lease not held') end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return redis.error_reply('STALE epoch changed') end
local ops = cjson.decode(ARGV[3])
for _, op in ipairs(ops) do
  local args = {}
  for i = 3, #op do args[#args + 1] = op[i] end
  if op[1] == 'SETLATEST' then
    forward_set(KEYS[op[2]], args[1], args[2])
  else
    redis.call(op[1], KEYS[op[2]], unpack(args))
  end
end
return #ops
"""

#: Redis commands a batch may hold, plus ``SETLATEST key step value``: the LATEST pointer's
#: forward-only SET (``shoal.storage.latest.FORWARD_SET_LUA``; a lower step is not written).
ALLOWED = frozenset({"SETLATEST", "HSET", "HDEL", "SET", "DEL", "XADD", "XACK", "XTRIM", "ZADD", "ZREM", "RPUSH", "EXPIRE", "PEXPIRE"})


#: field-value pairs per HSET of a batch (see :meth:`FencedBatch.hset`)
HSET_PAIRS = 1000


class FencedBatch:
    """Commands to apply atomically under the fence. Values are strings (JSON where structured)."""

    def __init__(self, keys: JobKeys):
        self._prefix = keys.base + ":"
        self._keys: list[str] = [keys.lease, keys.epoch]
        self._index: dict[str, int] = {}
        self.ops: list[list] = []

    def add(self, cmd: str, key: str, *args: str | int | float) -> "FencedBatch":
        if cmd not in ALLOWED:
            raise ValueError(f"command {cmd} is not allowed in a fenced batch")
        if not key.startswith(self._prefix):
            raise ValueError(f"key {key} is outside the job's hash tag")
        if key not in self._index:
            self._keys.append(key)
            self._index[key] = len(self._keys)  # Lua KEYS are 1-based
        self.ops.append([cmd, self._index[key], *[str(a) for a in args]])
        return self

    def hset(self, key: str, mapping: dict[str, str]) -> "FencedBatch":
        """HSET of ``mapping``, in commands of at most :data:`HSET_PAIRS` pairs: the script
        calls each with Lua's ``unpack``, which takes at most ~8,000 values (a generation
        adding 4,000 workers at once failed there, half applied)."""
        items = list(mapping.items())
        for start in range(0, len(items), HSET_PAIRS):
            flat: list[str] = []
            for k, v in items[start:start + HSET_PAIRS]:
                flat += [k, v]
            self.add("HSET", key, *flat)
        return self

    def xadd(self, key: str, fields: dict[str, str], maxlen: int | None = None) -> "FencedBatch":
        args: list[str | int] = []
        if maxlen is not None:
            args += ["MAXLEN", "~", maxlen]
        args.append("*")
        for k, v in fields.items():
            args += [k, v]
        return self.add("XADD", key, *args)

    @property
    def keys(self) -> list[str]:
        return self._keys


class FencedWriter:
    """Applies batches for one job as the holder of (token, epoch)."""

    def __init__(self, client: redis.Redis, keys: JobKeys, token: str, epoch: int):
        self._script = client.register_script(_APPLY)
        self._client = client
        self.keys = keys
        self.token = token
        self.epoch = epoch

    def commit(self, batch: FencedBatch) -> None:
        """Apply ``batch`` atomically; raises StaleEpoch if we no longer hold the job.
        Other Redis errors propagate as redis-py exceptions (the loop handles them), among
        them NotReplicated (``shoal.core.durable``) when no replica confirmed the write."""
        if not batch.ops:
            return
        # under Sentinel a replica must hold it before it counts (NotReplicated: an outage),
        # confirmed on the connection that wrote it
        pipe = self._client.pipeline(transaction=False)
        self._script(keys=batch.keys, args=[self.token, str(self.epoch), json.dumps(batch.ops)], client=pipe)
        try:
            execute_confirmed(self._client, pipe, f"job {self.keys.job_id}: fenced write of epoch {self.epoch}")
        except redis.ResponseError as exc:
            if _stale(exc):
                raise StaleEpoch(f"job {self.keys.job_id}: write with epoch {self.epoch} refused ({exc})") from exc
            raise


def _stale(exc: redis.ResponseError) -> bool:
    """Whether an error reply is the script's own refusal: its error code (the reply's first
    word), the only thing redis-py passes on of it."""
    return str(exc).split(" ", 1)[0] == STALE_CODE
