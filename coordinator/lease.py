"""Per-job leadership lease with a fencing epoch.

One coordinator replica leads a job while it holds ``keys.lease`` (SET NX PX). Taking a
free lease increments ``keys.epoch`` in the same script, so every takeover gets a larger
epoch; renewing is a compare-and-set on our token. Fenced writes
(:mod:`shoal.coordinator.fenced`) check both, so a paused old leader that wakes up after a
takeover cannot change anything.
"""

from __future__ import annotations

import redis

from shoal.events.keys import JobKeys

# KEYS: lease, epoch, handoff. ARGV: token, ttl_ms. Returns our epoch (>0) if we hold the
# lease, else 0. A free lease whose job is being handed to another replica stays free for us.
_ACQUIRE_OR_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
if holder then return 0 end
local heir = redis.call('GET', KEYS[3])
if heir and heir ~= ARGV[1] then return 0 end
if heir then redis.call('DEL', KEYS[3]) end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('INCR', KEYS[2])
"""

# KEYS: lease, handoff. ARGV: token, heir token, hint_ms. Releases our lease naming its heir.
_HAND_OFF = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return redis.call('DEL', KEYS[1])
"""

# KEYS: lease. ARGV: token. Deletes the lease only if we hold it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseScripts:
    """Registered lease scripts for one client (EVALSHA with automatic reload)."""

    def __init__(self, client: redis.Redis):
        self.acquire_or_renew = client.register_script(_ACQUIRE_OR_RENEW)
        self.release = client.register_script(_RELEASE)
        self.hand_off_script = client.register_script(_HAND_OFF)

    def hold(self, keys: JobKeys, token: str, ttl_ms: int) -> int:
        """Acquire or renew; our epoch (>0) or 0 when another replica holds the lease."""
        return int(self.acquire_or_renew(keys=[keys.lease, keys.epoch, keys.handoff], args=[token, ttl_ms]) or 0)

    def queue_hold(self, pipe, keys: JobKeys, token: str, ttl_ms: int) -> None:
        """Queue :meth:`hold` on a pipeline; its result is the epoch (or 0) at execute()."""
        self.acquire_or_renew(keys=[keys.lease, keys.epoch, keys.handoff], args=[token, ttl_ms], client=pipe)

    def give_up(self, keys: JobKeys, token: str) -> bool:
        return bool(self.release(keys=[keys.lease], args=[token]))

    def hand_off(self, keys: JobKeys, token: str, heir: str, hint_ms: int) -> bool:
        """Release our lease so that only ``heir`` may take it for ``hint_ms`` (then anyone).
        False (nothing changed) when we no longer hold it."""
        return bool(self.hand_off_script(keys=[keys.lease, keys.handoff], args=[token, heir, hint_ms]))
