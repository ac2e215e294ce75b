"""Lua scripts of the semaphore and the read/write lock (see :mod:`.kinds` for their names).

A semaphore's permits are plain locks (:mod:`.scripts` takes, renews and releases them); the
only script of its own reads how long each slot stays taken, to pick a free one.

Key layout of a read/write lock named ``name`` under prefix ``p`` (beside the writer, which is
the plain lock ``p:lock:name``, so the admin page, renewal, fencing and force release treat a
writer as any lock):

* ``p:readers:name`` - sorted set: reader token -> server ms its lease ends.
* ``p:rmeta:name``   - hash: reader token -> its value, as a lock's (``scripts.VALUE_FIELDS``).
* ``p:wwait:name``   - sorted set: waiting writer id -> server ms its wait ends. A reader is
  refused while a writer waits (writers are not starved by a stream of readers); a waiting
  writer refreshes its entry at every attempt and removes it when it gets the lock or gives up.

Both sorted sets are judged by the server clock inside the scripts (entries whose time has
come are dropped before anything is decided), and their keys expire with their last entry.
"""

from __future__ import annotations

from .scripts import _FIELDS, _GUARD, _TAKE, Script

__all__ = [
    "LIST_READERS",
    "PERMIT_PTTLS",
    "READ_ACQUIRE",
    "READ_CHECK",
    "READ_EXTEND",
    "READ_FORCE_RELEASE",
    "READ_RELEASE",
    "WRITE_ACQUIRE",
    "WRITE_LEAVE",
]

# How long each of a semaphore's slots stays taken.
# KEYS the slots' lock keys; ARGV none
# Returns one PTTL per key, in order (-2: free).
PERMIT_PTTLS = Script(
    """
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = redis.call('PTTL', key)
end
return out
"""
)

# The server's clock in ms (the acquire scripts get it from the restart guard's opening).
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Shared by the read/write scripts after the restart guard: drop readers and waiting writers
# whose time has come. Uses KEYS[4] readers, KEYS[5] reader values, KEYS[6] waiting writers.
_PRUNE = """
local dead = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
if #dead > 0 then
  redis.call('ZREM', KEYS[4], unpack(dead))
  redis.call('HDEL', KEYS[5], unpack(dead))
end
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
"""

# A writer that cannot take the lock yet says it waits (blocking new readers).
# Uses KEYS[6] waiting writers, ARGV[7] waiter id, ARGV[8] ms the entry lives.
_WAIT = """
local function wait()
  if ARGV[7] ~= '' then
    redis.call('ZADD', KEYS[6], now + tonumber(ARGV[8]), ARGV[7])
    redis.call('PEXPIRE', KEYS[6], tonumber(ARGV[8]) * 2)
  end
end
"""

# Keeps the readers' keys until their last reader's lease ends.
_KEEP_READERS = """
local function keep()
  local last = redis.call('ZRANGE', KEYS[4], -1, -1, 'WITHSCORES')
  if #last > 0 then
    local ms = math.max(tonumber(last[2]) - now, 1)
    redis.call('PEXPIRE', KEYS[4], ms)
    redis.call('PEXPIRE', KEYS[5], ms)
  end
end
"""

# Take a read hold: no writer holds the lock and none waits for it.
# KEYS[1] writer lock, KEYS[2] fencing counter (unused), KEYS[3] node marker, KEYS[4] readers,
# KEYS[5] reader values, KEYS[6] waiting writers
# ARGV[1] token, ARGV[2] ttl ms, ARGV[3] holder metadata (JSON), ARGV[4] unused, ARGV[5] run_id
# of the server this connection reached, ARGV[6] guard period ms ("0" = off), ARGV[7] unused,
# ARGV[8] unused
# Returns as scripts.ACQUIRE: {0, 0, trusted_age, marker} taken (or already ours: a command sent
# again), {1, pttl, trusted_age, marker} a writer holds it, {1, pttl, trusted_age, marker, 0}
# a writer waits for it (pttl: ms until that ends), {2, ...} restart guard
READ_ACQUIRE = Script(
    _GUARD
    + _PRUNE
    + _KEEP_READERS
    + """
if redis.call('ZSCORE', KEYS[4], ARGV[1]) then
  return {0, 0, trusted_age, marker}
end
local held = redis.call('PTTL', KEYS[1])
if held ~= -2 then
  return {1, held, trusted_age, marker}
end
local waiting = redis.call('ZRANGE', KEYS[6], 0, 0, 'WITHSCORES')
if #waiting > 0 then
  return {1, tonumber(waiting[2]) - now, trusted_age, marker, 0}
end
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[5], ARGV[1],
           string.format('%s 0 0 %d %s\\n', ARGV[1], now, ARGV[2]) .. ARGV[3])
keep()
return {0, 0, trusted_age, marker}
"""
)

# Take the write hold: nobody holds the lock and no reader holds a read hold; otherwise wait
# (see _WAIT). Same KEYS and ARGV as READ_ACQUIRE, with ARGV[4] "1" to draw a fence, ARGV[7]
# the waiter id (stable across one acquire's attempts), ARGV[8] ms its wait entry lives.
# Returns as scripts.ACQUIRE ({1, pttl, ...}: pttl = ms until the writer's lease or the first
# reader's ends; refused for readers, a fifth element: how many there are).
WRITE_ACQUIRE = Script(
    _FIELDS
    + _GUARD
    + _PRUNE
    + _WAIT
    + """
local held = redis.call('GET', KEYS[1])
if held then
  local holder, fence = fields(held)
  if holder == ARGV[1] then
    return {0, tonumber(fence), trusted_age, marker}
  end
  wait()
  return {1, redis.call('PTTL', KEYS[1]), trusted_age, marker}
end
local first = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')
if #first > 0 then
  wait()
  return {1, tonumber(first[2]) - now, trusted_age, marker, redis.call('ZCARD', KEYS[4])}
end
if ARGV[7] ~= '' then
  redis.call('ZREM', KEYS[6], ARGV[7])
end
"""
    + _TAKE
)

# A writer stops waiting (it gave up); readers it held back are told.
# KEYS[1] waiting writers; ARGV[1] waiter id, ARGV[2] release channel
# Returns 1 when its entry was there, else 0.
WRITE_LEAVE = Script(
    """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('PUBLISH', ARGV[2], ARGV[1])
  return 1
end
return 0
"""
)

# Re-arm a read hold if it is still ours; with a claim, also put it back where its entry ran
# out while no writer holds the lock there (a node that paused past the lease: otherwise the
# hold lives on a bare quorum from then on, and the next minority pause costs it, where a
# plain lock spreads back; the caller claims only while its lease is valid, so no writer can
# hold a quorum meanwhile, and writers waiting already wait for this reader's quorum).
# KEYS[1] readers, KEYS[2] reader values, KEYS[3] writer lock
# ARGV[1] token, ARGV[2] ttl ms, ARGV[3] the reader's value to write where its entry is missing
#         ('' for none)
# Returns 1 when extended (or claimed), 0 when the token is not a live reader here.
READ_EXTEND = Script(
    _FIELDS
    + _NOW
    + """
local until_ms = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or '0')
if until_ms <= now then
  if ARGV[3] == '' or redis.call('EXISTS', KEYS[3]) == 1 then
    return 0
  end
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
else
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
  local token, fence, renewals, acquired, _, meta = fields(redis.call('HGET', KEYS[2], ARGV[1])
                                                           or '')
  if token then
    redis.call('HSET', KEYS[2], ARGV[1], string.format('%s %s %d %s %s', token, fence,
               renewals + 1, acquired, ARGV[2]) .. '\\n' .. meta)
  end
end
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local ms = math.max(tonumber(last[2]) - now, 1)
redis.call('PEXPIRE', KEYS[1], ms)
redis.call('PEXPIRE', KEYS[2], ms)
return 1
"""
)

# Drop a read hold and wake whoever waits for the lock.
# KEYS[1] readers, KEYS[2] reader values; ARGV[1] token, ARGV[2] release channel
# Returns 1 + the number of subscribers told when removed, 0 when the token was not there.
READ_RELEASE = Script(
    """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  return 1 + redis.call('PUBLISH', ARGV[2], ARGV[1])
end
return 0
"""
)

# Whether a read hold is live here, in the shape a lock check reads (the lock value's head).
# KEYS[1] readers; ARGV[1] token
# Returns "<token> " when it is, else false.
READ_CHECK = Script(
    _NOW
    + """
if tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or '0') > now then
  return ARGV[1] .. ' '
end
return false
"""
)

# One step of listing the readers on this node, in the shape of scripts.LIST's entries, each
# reader named "<lock>#read:<token>" under the locks' key prefix (so a listing reads both alike).
# KEYS none
# ARGV[1] SCAN cursor, ARGV[2] MATCH pattern (on the readers' sets), ARGV[3] COUNT, ARGV[4] the
# readers' sets' key prefix ("p:readers:"), ARGV[5] the reader values' ("p:rmeta:"), ARGV[6] the
# locks' ("p:lock:")
# Returns {next cursor, JSON list of [key, token, meta, fence, renewals, acquired, ttl, pttl]}
LIST_READERS = Script(
    _FIELDS
    + _NOW
    + """
local step = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', ARGV[3], 'TYPE', 'zset')
local out = {}
for _, key in ipairs(step[2]) do
  local name = string.sub(key, #ARGV[4] + 1)
  local live = redis.call('ZRANGEBYSCORE', key, '(' .. now, '+inf', 'WITHSCORES')
  for i = 1, #live, 2 do
    local value = redis.call('HGET', ARGV[5] .. name, live[i]) or ''
    local token, fence, renewals, acquired, ttl, meta = fields(value)
    if token then
      out[#out + 1] = {ARGV[6] .. name .. '#read:' .. token, token, meta, fence, renewals,
                       acquired, ttl, tonumber(live[i + 1]) - now}
    end
  end
end
if #out == 0 then
  return {step[1], '[]'}
end
return {step[1], cjson.encode(out)}
"""
)

# Remove one reader whoever it is (an operator's action), wake whoever waits, and tell the
# reader on the holders' channel (as FORCE_RELEASE does).
# KEYS[1] readers, KEYS[2] reader values; ARGV[1] the reader's token, ARGV[2] release channel,
# ARGV[3] holders' channel
# Returns the token when it was removed, else false.
READ_FORCE_RELEASE = Script(
    """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('PUBLISH', ARGV[2], ARGV[1])
  redis.call('PUBLISH', ARGV[3], ARGV[1])
  return ARGV[1]
end
return false
"""
)
