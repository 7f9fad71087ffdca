"""The Redis LATEST pointer of a job (key ``job_keys(job).latest``): JSON naming the newest
published checkpoint, moved only forwards.

Value: ``{"step": N, "checkpoint": "step-00000000N", "store": "<store uri>",
"generation": G}`` (the wire model is ``shoal.events.models.LatestPointer``). A write is
refused when the stored value names a higher step (an equal step rewrites it; an unparsable
stored value is replaced). That rule is the Lua function :data:`FORWARD_SET_LUA`, used in two
places: :data:`CAS_LUA` / :func:`publish_latest`, the plain call, and the coordinator's fenced
write path (``shoal.coordinator.fenced``, op ``SETLATEST``), which is how the coordinator moves
the pointer when a worker reports a checkpoint.
"""

from __future__ import annotations

import redis

from shoal.core.durable import execute_confirmed
from shoal.events.keys import job_keys
from shoal.events.models import LatestPointer as _WirePointer
from shoal.storage.errors import LatestRegression, PointerCorrupt, translated

#: ``forward_set(key, step, value)``: SET ``key`` to ``value`` unless the value stored there
#: names a step above ``step``. Returns -1 when written, else that (higher) stored step.
FORWARD_SET_LUA = """
local function forward_set(key, step, value)
  local cur = redis.call('GET', key)
  if cur then
    local ok, obj = pcall(cjson.decode, cur)
    if ok and type(obj) == 'table' and type(obj['step']) == 'number'
       and obj['step'] > tonumber(step) then
      return obj['step']
    end
  end
  redis.call('SET', key, value)
  return -1
end
"""

#: KEYS[1] = pointer key; ARGV[1] = new step; ARGV[2] = new JSON value.
#: Returns -1 when written, else the (higher) current step, which is left untouched.
CAS_LUA = FORWARD_SET_LUA + "return forward_set(KEYS[1], ARGV[1], ARGV[2])\n"


class LatestPointer(_WirePointer):
    """Where the newest published checkpoint of a job is; :meth:`from_json` raises
    PointerCorrupt (a storage error) for a malformed or inconsistent value."""

    @classmethod
    def from_json(cls, raw: bytes | str) -> LatestPointer:
        try:
            return super().from_json(raw)
        except ValueError as exc:
            raise PointerCorrupt(str(exc)) from exc


def cas_args(pointer: LatestPointer) -> list[str | int]:
    """ARGV for :data:`CAS_LUA`."""
    return [pointer.step, pointer.to_json()]


def publish_latest(r: redis.Redis, job_id: str, pointer: LatestPointer) -> None:
    """Move the job's pointer to ``pointer`` unless it names a higher step already.

    Raises LatestRegression (pointer untouched) when it does, StorageUnavailable when Redis
    fails (or, under Sentinel, no replica confirmed the move), ValueError for an invalid job id."""
    key = job_keys(job_id).latest
    with translated(f"publish LATEST of job {job_id}"):
        # under Sentinel the move counts once a replica holds it, confirmed on the connection
        # that made it: confirmed apart, a fail-over between the two could let the promoted
        # replica vouch for a move only the old primary saw (and retention would then prune
        # the checkpoint the surviving pointer names)
        (current,) = execute_confirmed(r, r.pipeline(transaction=False).eval(CAS_LUA, 1, key, *cas_args(pointer)),
                                       f"LATEST of job {job_id}")
        current = int(current)
    if current >= 0:
        raise LatestRegression(f"job {job_id} LATEST is at step {current}; refusing to move it back to {pointer.step}")


def read_pointer(r: redis.Redis, job_id: str) -> LatestPointer | None:
    """The job's pointer, None when unset. PointerCorrupt when malformed,
    StorageUnavailable when Redis fails (or, under Sentinel, no replica holds what was read:
    it may vanish in a fail-over)."""
    key = job_keys(job_id).latest
    with translated(f"read LATEST of job {job_id}"):
        # under Sentinel a read counts once a replica holds what it saw: a value only a cut-off
        # primary acknowledged (to be dropped at its demotion) must not send a resume forward
        (raw,) = execute_confirmed(r, r.pipeline(transaction=False).get(key), f"read of LATEST of job {job_id}")
    return None if raw is None else LatestPointer.from_json(raw)
