"""The Redis LATEST pointer of a job (key ``job_keys(job).latest``): JSON naming the newest
published checkpoint, moved only forwards by a Lua compare-and-set.

Value: ``{"step": N, "checkpoint": "step-00000000N", "store": "<store uri>",
"generation": G}``. :data:`CAS_LUA` refuses a value whose step is lower than the stored one
(an equal step rewrites it; an unparsable stored value is replaced). The coordinator routes
this write through its fenced-epoch path by wrapping :data:`CAS_LUA` / :func:`cas_args`;
:func:`publish_latest` is the plain, unfenced call.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import redis

from shoal.events.keys import job_keys
from shoal.storage.errors import LatestRegression, PointerCorrupt, translated
from shoal.storage.layout import checkpoint_dir

#: KEYS[1] = pointer key; ARGV[1] = new step; ARGV[2] = new JSON value.
#: Returns -1 when written, else the (higher) current step, which is left untouched.
CAS_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, obj = pcall(cjson.decode, cur)
  if ok and type(obj) == 'table' and type(obj['step']) == 'number'
     and obj['step'] > tonumber(ARGV[1]) then
    return obj['step']
  end
end
redis.call('SET', KEYS[1], ARGV[2])
return -1
"""


@dataclass(frozen=True)
class LatestPointer:
    """Where the newest published checkpoint of a job is."""

    step: int
    store: str
    generation: int = 0

    @property
    def checkpoint(self) -> str:
        return checkpoint_dir(self.step)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "checkpoint": self.checkpoint}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> LatestPointer:
        """Parse a pointer; PointerCorrupt if it is malformed or inconsistent."""
        try:
            obj = json.loads(raw)
            ptr = cls(step=obj["step"], store=obj["store"], generation=obj.get("generation", 0))
        except (ValueError, KeyError, TypeError) as exc:
            raise PointerCorrupt(f"Redis LATEST pointer is not valid JSON: {exc}") from exc
        ints_ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (ptr.step, ptr.generation))
        if not ints_ok or not isinstance(ptr.store, str) or obj.get("checkpoint") != ptr.checkpoint:
            raise PointerCorrupt(f"Redis LATEST pointer is inconsistent: {obj!r}")
        return ptr


def cas_args(pointer: LatestPointer) -> list[str | int]:
    """ARGV for :data:`CAS_LUA`."""
    return [pointer.step, pointer.to_json()]


def publish_latest(r: redis.Redis, job_id: str, pointer: LatestPointer) -> None:
    """Move the job's pointer to ``pointer`` unless it names a higher step already.

    Raises LatestRegression (pointer untouched) when it does, StorageUnavailable when Redis
    fails, ValueError for an invalid job id."""
    key = job_keys(job_id).latest
    with translated(f"publish LATEST of job {job_id}"):
        current = int(r.eval(CAS_LUA, 1, key, *cas_args(pointer)))
    if current >= 0:
        raise LatestRegression(f"job {job_id} LATEST is at step {current}; refusing to move it back to {pointer.step}")


def read_pointer(r: redis.Redis, job_id: str) -> LatestPointer | None:
    """The job's pointer, None when unset. PointerCorrupt when malformed,
    StorageUnavailable when Redis fails."""
    key = job_keys(job_id).latest
    with translated(f"read LATEST of job {job_id}"):
        raw = r.get(key)
    return None if raw is None else LatestPointer.from_json(raw)
