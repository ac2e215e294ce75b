"""Lua scripts run on every node, and the small helpers that describe them.

Each script is atomic on its node, which is what makes "check the token, then act" safe (seed
004: a plain GET followed by DEL can delete a lock another client took in between).

Key layout for a lock named ``name`` under prefix ``p``:

* ``p:lock:name``  - hash: ``token``, ``meta`` (JSON holder metadata), ``fence``, ``renewals``,
  ``acquired`` (server ms), ``ttl`` (ms). One key per lock keeps the admin listing a single
  SCAN and the lock and its metadata expire together.
* ``p:fence:name`` - fencing counter (no TTL).
* ``p:node``       - restart-guard marker of this node: ``run_id``, ``started`` (server ms the
  guard runs from: when the marker was armed), ``fresh`` (1 when it had no marker),
  ``trusted`` (server ms it was trusted as new, or 0), ``armed`` (server ms the marker was
  written).
* ``p:queue:name``, ``p:beats:name``, ``p:qseq:name`` - a fair lock's line of waiters, their
  heartbeats and its ticket sequence (all expire when the line stays idle).
* channel ``p:released:name`` - published on release, wakes waiters.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

__all__ = [
    "ACQUIRE",
    "BODIES",
    "EXTEND",
    "FAIR_ACQUIRE",
    "FAIR_LEAVE",
    "FAIR_TICKET",
    "FENCE_SYNC",
    "FORCE_RELEASE",
    "LIST",
    "RELEASE",
    "TRUST",
    "TRUST_NOW",
    "Script",
]

#: Script bodies by SHA1, for the EVAL fallback when a node answers NOSCRIPT.
BODIES: dict[str, str] = {}


@dataclass(frozen=True)
class Script:
    """A Lua body and its SHA1, sent as EVALSHA with an EVAL fallback on NOSCRIPT."""

    body: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.body.encode()).hexdigest())
        BODIES[self.sha] = self.body


# Shared opening of both acquire scripts: the server clock, then the restart guard.
# Uses KEYS[3] node marker (run_id, started ms, fresh, trusted ms, armed ms), ARGV[5] run_id of
# the server this connection reached, ARGV[6] guard period ms ("0" = off). Returns early
# {2, ms, fresh, armed_age} while this node may not vote (armed_age: ms since the marker was
# written); sets trusted_age (ms since a brand-new cluster was trusted, else -1).
_GUARD = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local guard = tonumber(ARGV[6])
local trusted_age = -1
if guard > 0 then
  local m = redis.call('HMGET', KEYS[3], 'run_id', 'started', 'fresh', 'trusted', 'armed')
  if m[1] ~= ARGV[5] or not (m[2] and m[4] and m[5]) then
    -- The marker is missing or was written by an earlier server process: this node lost
    -- its data (restart, FLUSHALL, eviction) or is another server (a promoted replica), at
    -- some moment up to now. Its uptime says nothing about when (a flush does not restart
    -- it), so the guard runs from now: each caller keeps it out of its quorum until its own
    -- guard period (its longest lease) has passed, so every lease the node granted (or
    -- forgot) before has run out. fresh = 1 when no marker was left at all. (A marker
    -- missing fields was written by an older version: armed again the same way.)
    m = {ARGV[5], now, m[1] and '0' or '1', '0', now}
    redis.call('HSET', KEYS[3], 'run_id', m[1], 'started', m[2], 'fresh', m[3], 'trusted', 0,
               'armed', now)
  end
  local trusted = tonumber(m[4])
  if trusted > 0 then
    trusted_age = now - trusted
  elseif tonumber(m[2]) + guard > now then
    return {2, tonumber(m[2]) + guard - now, tonumber(m[3]), now - tonumber(m[5])}
  end
end
"""

# Shared middle of both acquire scripts: the lock is taken. By us, when this is a command sent
# again on a new connection after the first one's reply was lost (its SET may have landed):
# then it is our grant, so the caller neither misses it nor leaves it behind.
# Uses KEYS[1] lock hash, ARGV[1] token. Returns {0, fence, trusted_age} or {1, pttl, ...}.
_HELD = """
local holder = redis.call('HGET', KEYS[1], 'token')
if holder == ARGV[1] then
  return {0, tonumber(redis.call('HGET', KEYS[1], 'fence') or '0'), trusted_age}
elseif holder then
  return {1, redis.call('PTTL', KEYS[1]), trusted_age}
end
"""

# Shared end of both acquire scripts: take the free lock, drawing a fence if asked.
# Uses KEYS[1] lock hash, KEYS[2] fencing counter, ARGV[1] token, ARGV[2] ttl ms,
# ARGV[3] holder metadata (JSON), ARGV[4] "1" to draw a fence. Returns {0, fence, trusted_age}.
_TAKE = """
local fence = 0
if ARGV[4] == '1' then
  -- Seed a missing counter from the clock so a node that restarted empty still hands out
  -- numbers above any it gave before (see docs/guarantees, "fencing").
  if redis.call('EXISTS', KEYS[2]) == 0 then
    redis.call('SET', KEYS[2], now * 1000)
  end
  fence = redis.call('INCR', KEYS[2])
end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'meta', ARGV[3], 'fence', fence,
           'renewals', 0, 'acquired', now, 'ttl', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {0, fence, trusted_age}
"""

# Take the lock if it is free.
# KEYS[1] lock hash, KEYS[2] fencing counter, KEYS[3] node marker
# ARGV[1] token, ARGV[2] ttl ms, ARGV[3] holder metadata (JSON), ARGV[4] "1" to draw a fence,
# ARGV[5] run_id of the server this connection reached, ARGV[6] guard period ms ("0" = off)
# Returns {0, fence, trusted_age} taken (fence 0 when not fencing)
#         {1, pttl, trusted_age} held by another owner; pttl = ms until its lease ends
#         {2, ms, fresh, armed_age} restart guard: this node may not vote for ms more;
#                    fresh = 1 while the guard comes from a missing marker (never used, or
#                    restarted empty); armed_age = ms since the marker was written
# trusted_age: ms since this node was trusted as part of a brand-new cluster, -1 otherwise
ACQUIRE = Script(_GUARD + _HELD + _TAKE)

# Draw a place in a fair lock's queue: the caller takes the largest number a quorum returned.
# KEYS[1] queue sequence counter
# Returns the next number of this node's sequence.
FAIR_TICKET = Script("return redis.call('INCR', KEYS[1])")

# Take a fair lock if it is free and the caller is first in line; otherwise join the line.
# KEYS[1..3] as ACQUIRE, KEYS[4] queue (zset waiter -> ticket), KEYS[5] heartbeats (zset
# waiter -> expiry ms), KEYS[6] queue sequence counter
# ARGV[1..6] as ACQUIRE, ARGV[7] waiter id, ARGV[8] ticket, ARGV[9] heartbeat ms
# Returns as ACQUIRE, plus {3, -2, trusted_age} queued behind an earlier waiter
FAIR_ACQUIRE = Script(
    _GUARD
    + """
-- Waiters whose heartbeat ran out are dead: drop them so they cannot block the line.
local dead = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)
if #dead > 0 then
  redis.call('ZREM', KEYS[4], unpack(dead))
  redis.call('ZREM', KEYS[5], unpack(dead))
end
-- Keep the sequence above every agreed ticket, so a later waiter draws a larger one.
if tonumber(redis.call('GET', KEYS[6]) or '0') < tonumber(ARGV[8]) then
  redis.call('SET', KEYS[6], ARGV[8])
end
redis.call('ZADD', KEYS[4], 'NX', ARGV[8], ARGV[7])
redis.call('ZADD', KEYS[5], now + tonumber(ARGV[9]), ARGV[7])
local ttl = tonumber(ARGV[9]) * 2
redis.call('PEXPIRE', KEYS[4], ttl)
redis.call('PEXPIRE', KEYS[5], ttl)
redis.call('PEXPIRE', KEYS[6], ttl)
"""
    + _HELD
    + """
if redis.call('ZRANGE', KEYS[4], 0, 0)[1] ~= ARGV[7] then
  return {3, -2, trusted_age}
end
redis.call('ZREM', KEYS[4], ARGV[7])
redis.call('ZREM', KEYS[5], ARGV[7])
"""
    + _TAKE
)

# Leave a fair lock's line (the waiter gave up).
# KEYS[1] queue, KEYS[2] heartbeats; ARGV[1] waiter id. Returns the number of entries removed.
FAIR_LEAVE = Script(
    """
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('ZREM', KEYS[1], ARGV[1])
"""
)

# Raise this node's fencing counter to the fence the quorum agreed on.
# KEYS[1] lock hash, KEYS[2] fencing counter
# ARGV[1] token, ARGV[2] fence
# Returns 1 when our token holds the lock here (its hash then records the fence), else 0.
FENCE_SYNC = Script(
    """
local fence = tonumber(ARGV[2])
if tonumber(redis.call('GET', KEYS[2]) or '0') < fence then
  redis.call('SET', KEYS[2], fence)
end
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'fence', fence)
  return 1
end
return 0
"""
)

# Re-arm the lease if the lock is still ours.
# KEYS[1] lock hash
# ARGV[1] token, ARGV[2] ttl ms
# Returns 1 when extended, 0 when the token is not ours (or the key is gone).
EXTEND = Script(
    """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  -- Expiry last: whatever the ttl, the hash is never left without one.
  redis.call('HSET', KEYS[1], 'ttl', ARGV[2])
  redis.call('HINCRBY', KEYS[1], 'renewals', 1)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
)

# Delete the lock if it is still ours and wake whoever waits for it.
# KEYS[1] lock hash
# ARGV[1] token, ARGV[2] release channel
# Returns 1 + the number of subscribers told (processes waiting) when deleted, 0 when the
# token is not ours (the holder's key is left alone).
RELEASE = Script(
    """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1 + redis.call('PUBLISH', ARGV[2], ARGV[1])
end
return 0
"""
)

# Delete the lock whoever holds it (admin / operator action) and wake waiters.
# KEYS[1] lock hash
# ARGV[1] release channel, ARGV[2] the token to remove, or "" for whichever holds it
# Returns the token that was removed, or false when there was no lock (or another token).
FORCE_RELEASE = Script(
    """
local token = redis.call('HGET', KEYS[1], 'token')
if token and (ARGV[2] == '' or token == ARGV[2]) then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[1], token)
  return token
end
return false
"""
)

# Mark this node usable now: used when every node of a cluster reports it has never been
# used (a brand-new cluster has no leases to protect).
# KEYS[1] node marker
# ARGV[1] run_id the caller saw on this node
# Returns 1 when the marker was set by this very server process and is now trusted, else 0.
TRUST = Script(
    """
if redis.call('HGET', KEYS[1], 'run_id') == ARGV[1] then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('HSET', KEYS[1], 'trusted', now, 'fresh', 0)
  return 1
end
return 0
"""
)

# Arm this node's marker as trusted now: an operator asserted that no lock is held (`manage.py
# redlock trust`), so the node may vote at once whatever its guard said.
# KEYS[1] node marker
# ARGV[1] run_id of the server this connection reached
# Returns 1.
TRUST_NOW = Script(
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], 'run_id', ARGV[1], 'started', now, 'fresh', 0, 'trusted', now,
           'armed', now)
return 1
"""
)

# One step of listing the locks on this node: a SCAN step, and each lock's fields, as JSON
# (one reply for up to `count` locks instead of two per lock keeps a 10,000-lock listing fast).
# KEYS none
# ARGV[1] SCAN cursor, ARGV[2] MATCH pattern, ARGV[3] COUNT
# Returns {next cursor, JSON list of [key, token, meta, fence, renewals, acquired, ttl, pttl]}
LIST = Script(
    """
local step = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', ARGV[3], 'TYPE', 'hash')
local out = {}
for _, key in ipairs(step[2]) do
  local f = redis.call('HMGET', key, 'token', 'meta', 'fence', 'renewals', 'acquired', 'ttl')
  local pttl = redis.call('PTTL', key)
  if f[1] and pttl > 0 then
    -- Numbers stay strings: cjson would round a 16-digit fence to 14 digits.
    out[#out + 1] = {key, f[1], f[2] or '{}', f[3] or '0', f[4] or '0', f[5] or '0',
                     f[6] or '0', pttl}
  end
end
if #out == 0 then
  return {step[1], '[]'}
end
return {step[1], cjson.encode(out)}
"""
)
