"""Lua scripts run on every node, and the small helpers that describe them.

Each script is atomic on its node, which is what makes "check the token, then act" safe (seed
004: a plain GET followed by DEL can delete a lock another client took in between).

Key layout for a lock named ``name`` under prefix ``p``:

* ``p:lock:name``  - string ``"<token> <fence> <renewals> <acquired ms> <lease ms>\n<meta JSON>"``
  (see :data:`VALUE_FIELDS`). A string, so an uncontended acquire is a plain
  ``SET NX PX`` (no script on the hot path); one key per lock keeps the admin listing a single
  SCAN, and the lock and its metadata expire together. ``acquired`` is the wall clock of
  whoever wrote it (the acquiring client, or the node when a script took the lock).
* ``p:fence:name`` - fencing counter (no TTL).
* ``p:node``       - restart-guard marker of this node: ``run_id``, ``started`` (server ms the
  guard runs from: when the marker was armed), ``fresh`` (1 when it had no marker),
  ``trusted`` (server ms it was trusted as new, or 0), ``armed`` (server ms the marker was
  written), ``id`` (server µs the marker was written: names this version of the marker, so
  a connection that saw it vote can tell, with one ``HMGET``, that it is still the same),
  ``replid`` (``"<id> <master_replid>"``: the replication id the server had when this
  version of the marker was armed; a new one means the dataset was replaced by a resync),
  ``epoch`` (a Sentinel group's master: the Sentinels' failover epoch it was armed, or first
  voted, at; a failover that names the server master again, without a trace of its own,
  bears a newer one).
* ``p:queue:name``, ``p:beats:name``, ``p:qseq:name`` - a fair lock's line of waiters, their
  heartbeats and its ticket sequence (all expire when the line stays idle).
* ``p:waiters:name`` - the processes waiting for a (not fair) lock, to wake one at a time:
  waiter id -> when it began to wait (ms, its wall clock); expires when nobody waits.
* channel ``p:released:name:waiter`` - a release wakes that waiter (the fair line's first, or
  the waiter that has waited longest); channel ``p:released:name`` when there is none. A place
  in a fair lock's line is named ``waiter.suffix`` (the process's waiter id for the name, and
  one of the place's own), and its waiter is told on the channel of the id before the dot.
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
    "PERMITTED",
    "RELEASE",
    "SITS_OUT",
    "TRUST",
    "TRUST_NOW",
    "VALUE_FIELDS",
    "Script",
]

#: The lock value's header, in order, before the newline and the metadata JSON.
VALUE_FIELDS = ("token", "fence", "renewals", "acquired", "ttl")

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


# Splits a lock value (see the module docstring) into token, fence, renewals, acquired, ttl,
# meta; nil for a value that is not one.
_FIELDS = """
local function fields(v)
  return string.match(v, '^(%S+) (%d+) (%d+) (%d+) (%d+)\\n(.*)$')
end
"""

# Shared opening of both acquire scripts: the server clock, then the restart guard.
# Uses KEYS[3] node marker (run_id, started ms, fresh, trusted ms, armed ms, id, replid, epoch),
# ARGV[5] the run id of the server this connection reached, then a space and its
# master_replid when the connection read one, then (a Sentinel group's master) a space and the
# Sentinels' failover epoch that named it, ARGV[6] guard period ms ("0" = off). Returns
# early {2, ms, fresh, armed_age, marker} while this node may not vote (armed_age: ms since
# the marker was written; marker: its id, which a TRUST must name); sets trusted_age (ms
# since a brand-new cluster was trusted, else -1) and marker (the marker's id, which the
# caller keeps to check the node with an HMGET next time).
_GUARD = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local guard = tonumber(ARGV[6])
local trusted_age = -1
local marker = false
if guard > 0 then
  local run_id, replid, epoch = string.match(ARGV[5], '^(%S+) ?(%S*) ?(%S*)$')
  local m = redis.call('HMGET', KEYS[3], 'run_id', 'started', 'fresh', 'trusted', 'armed', 'id',
                       'replid', 'epoch')
  -- replid is '<marker id> <master_replid>': the replication id this version of the marker
  -- was armed (or first voted) under. Redis draws a new one at every promotion, while a
  -- replica that resyncs takes its master's, so a master that was a replica meanwhile (a
  -- failover and failback, REPLICAOF then REPLICAOF NO ONE) may hold a copy of its own old
  -- marker under its own run id but without the leases it granted since: only the
  -- replication id tells. One paired with another marker id was left by a client that
  -- predates the field arming the marker, and counts as missing.
  local of, was = false, false
  if m[7] then
    of, was = string.match(m[7], '^(%S+) (%S*)$')
  end
  local current = of and of == m[6]
  local resynced = current and replid ~= '' and was ~= replid
  -- A failover named this server master after the marker was armed here (the Sentinels'
  -- epoch grew): a master deposed while frozen comes back still a master with its marker,
  -- run id and replication id intact, and may be named again before it was ever made a
  -- replica, having missed every lease granted meanwhile. A connection that tells an older
  -- epoch than the marker's was named before the marker's epoch: its vote is judged by the
  -- marker as it stands.
  local promoted = epoch ~= '' and m[8] and tonumber(m[8]) < tonumber(epoch)
  if m[1] ~= run_id or not (m[2] and m[4] and m[5]) or resynced or promoted then
    -- The marker is missing or was written by an earlier server process (or dataset): this
    -- node lost its data (restart, FLUSHALL, eviction, a resync) or is another server (a
    -- promoted replica), at some moment up to now. Its uptime says nothing about when (a
    -- flush does not restart it), so the guard runs from now: each caller keeps it out of
    -- its quorum until its own guard period (its longest lease) has passed, so every lease
    -- the node granted (or forgot) before has run out. fresh = 1 when no marker was left at
    -- all. (A marker missing fields was written by an older version: armed again the same
    -- way.)
    m = {run_id, now, m[1] and '0' or '1', '0', now, t[1] .. string.format('%06d', t[2])}
    redis.call('HSET', KEYS[3], 'run_id', m[1], 'started', m[2], 'fresh', m[3], 'trusted', 0,
               'armed', now, 'id', m[6], 'replid', m[6] .. ' ' .. replid)
    if epoch ~= '' then
      redis.call('HSET', KEYS[3], 'epoch', epoch)
    end
  else
    if epoch ~= '' and not m[8] then
      -- No epoch yet (a marker of an older version, or armed through a server's URL): filled
      -- in without arming the marker again, so an upgrade guards no group.
      redis.call('HSET', KEYS[3], 'epoch', epoch)
    end
    if not m[6] then
      -- A marker from before markers had ids: name it, without arming it again.
      m[6] = t[1] .. string.format('%06d', t[2])
      redis.call('HSET', KEYS[3], 'id', m[6])
      current = false
    end
    if not current and replid ~= '' then
      -- No replication id yet (a marker of an older version, or one it armed): this one is
      -- filled in without arming the marker again, so an upgrade guards no node.
      redis.call('HSET', KEYS[3], 'replid', m[6] .. ' ' .. replid)
    end
  end
  marker = m[6]
  local trusted = tonumber(m[4])
  if trusted > 0 then
    trusted_age = now - trusted
  elseif tonumber(m[2]) + guard > now then
    return {2, tonumber(m[2]) + guard - now, tonumber(m[3]), now - tonumber(m[5]), m[6]}
  end
end
"""

# Shared middle of both acquire scripts: the lock is taken. By us, when our plain SET landed
# before this script ran (the node's marker had changed since this connection saw it vote), or
# when this is a command sent again on a new connection after the first one's reply was lost:
# then it is our grant, so the caller neither misses it nor leaves it behind.
# Uses KEYS[1] lock, ARGV[1] token. Returns {0, fence, trusted_age, marker} or {1, pttl, ...}.
_HELD = """
local held = redis.call('GET', KEYS[1])
if held then
  local holder, fence = fields(held)
  if holder == ARGV[1] then
    return {0, tonumber(fence), trusted_age, marker}
  end
  return {1, redis.call('PTTL', KEYS[1]), trusted_age, marker}
end
"""

# Shared end of both acquire scripts: take the free lock, drawing a fence if asked.
# Uses KEYS[1] lock, KEYS[2] fencing counter, ARGV[1] token, ARGV[2] ttl ms,
# ARGV[3] holder metadata (JSON), ARGV[4] "1" to draw a fence.
# Returns {0, fence, trusted_age, marker}.
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
-- %d: a number concatenated as is would be written as 1.7955604547e+15.
redis.call('SET', KEYS[1], string.format('%s %d 0 %d %s\\n', ARGV[1], fence, now, ARGV[2])
           .. ARGV[3], 'PX', ARGV[2])
return {0, fence, trusted_age, marker}
"""

# Take the lock if it is free (the full check; an uncontended acquire on a node whose marker
# this connection saw vote is a plain SET NX PX instead: see commands.AcquireRequest).
# KEYS[1] lock, KEYS[2] fencing counter, KEYS[3] node marker
# ARGV[1] token, ARGV[2] ttl ms, ARGV[3] holder metadata (JSON), ARGV[4] "1" to draw a fence,
# ARGV[5] run_id of the server this connection reached (and its master_replid, see _GUARD),
# ARGV[6] guard period ms ("0" = off)
# Returns {0, fence, trusted_age, marker} taken (fence 0 when not fencing)
#         {1, pttl, trusted_age, marker} held by another owner; pttl = ms until its lease ends
#         {2, ms, fresh, armed_age, marker} restart guard: this node may not vote for ms
#                    more; fresh = 1 while the guard comes from a missing marker (never used,
#                    or restarted empty); armed_age = ms since the marker was written
# trusted_age: ms since this node was trusted as part of a brand-new cluster, -1 otherwise
# marker: the id of the node's marker (false with the guard off)
ACQUIRE = Script(_FIELDS + _GUARD + _HELD + _TAKE)

# Draw a place in a fair lock's queue: the caller takes the largest number a quorum returned.
# KEYS[1] queue sequence counter
# ARGV[1] ms the sequence lives on while nobody draws (it expires with an idle line: a guarded
#         node answers FAIR_ACQUIRE before it could set the expiry there)
# Returns the next number of this node's sequence.
FAIR_TICKET = Script(
    """
local ticket = redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return ticket
"""
)

# Take a fair lock if it is free and the caller is first in line; otherwise join the line.
# KEYS[1..3] as ACQUIRE, KEYS[4] queue (zset waiter -> ticket), KEYS[5] heartbeats (zset
# waiter -> expiry ms), KEYS[6] queue sequence counter
# ARGV[1..6] as ACQUIRE, ARGV[7] waiter id, ARGV[8] ticket, ARGV[9] heartbeat ms
# Returns as ACQUIRE, plus {3, ahead, trusted_age, marker} queued behind `ahead` earlier waiters
FAIR_ACQUIRE = Script(
    _FIELDS
    + _GUARD
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
  return {3, redis.call('ZRANK', KEYS[4], ARGV[7]), trusted_age, marker}
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
# KEYS[1] lock, KEYS[2] fencing counter
# ARGV[1] token, ARGV[2] fence
# Returns 1 when our token holds the lock here (its value then records the fence), else 0.
FENCE_SYNC = Script(
    _FIELDS
    + """
local fence = tonumber(ARGV[2])
if tonumber(redis.call('GET', KEYS[2]) or '0') < fence then
  redis.call('SET', KEYS[2], fence)
end
local token, _, renewals, acquired, ttl, meta = fields(redis.call('GET', KEYS[1]) or '')
if token == ARGV[1] then
  redis.call('SET', KEYS[1], table.concat({token, ARGV[2], renewals, acquired, ttl}, ' ')
             .. '\\n' .. meta, 'KEEPTTL')
  return 1
end
return 0
"""
)

# Re-arm the lease if the lock is still ours; with a claim, also take the lock where nobody
# holds it (a holder whose copies are on a bare quorum spreads to the free nodes, so one node
# pausing later costs it nothing; the caller claims only while it holds a valid lease, so no
# one else can hold a quorum meanwhile).
# KEYS[1] lock
# ARGV[1] token, ARGV[2] ttl ms, ARGV[3] the lock value to write where the key is missing
#         ('' for none)
# Returns 1 when extended (or claimed), 0 when the token is not ours (or the key is gone).
EXTEND = Script(
    _FIELDS
    + """
local held = redis.call('GET', KEYS[1])
local token, fence, renewals, acquired, _, meta = fields(held or '')
if token == ARGV[1] then
  -- One SET with PX: the value is never left without an expiry.
  local header = string.format('%s %s %d %s %s', token, fence, renewals + 1, acquired, ARGV[2])
  redis.call('SET', KEYS[1], header .. '\\n' .. meta, 'PX', ARGV[2])
  return 1
end
if not held and ARGV[3] ~= '' then
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
  return 1
end
return 0
"""
)

# Delete the lock if it is still ours and wake one waiter: the fair line's first, else the
# waiter that has waited longest, on its own channel (the release channel, ':', its id; for a
# place in the fair line, the id before its '.'). Woken
# all at once, every process waiting would contend for each release (and all but one lose);
# woken one at a time, the next one takes the lock alone. A waiter that left (or whose process
# died) no longer listens on its channel: PUBLISH tells nobody, and the next one is tried.
# With no one to wake by name, the release channel itself is told (semaphores and read/write
# locks wait there).
# KEYS[1] lock, KEYS[2] waiters (zset waiter id -> when it began to wait), KEYS[3] fair line
# ARGV[1] token, ARGV[2] release channel
# Returns 1 + the number of subscribers told (processes woken) when deleted, 0 when the
# token is not ours (the holder's key is left alone).
RELEASE = Script(
    """
local held = redis.call('GET', KEYS[1])
if held and string.match(held, '^(%S+) ') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  -- Nobody waits by name (the uncontended release): one call, not one per set.
  if redis.call('EXISTS', KEYS[2], KEYS[3]) == 0 then
    return 1 + redis.call('PUBLISH', ARGV[2], ARGV[1])
  end
  local told = 0
  for _, entry in ipairs(redis.call('ZRANGE', KEYS[3], 0, 2)) do
    -- A place in a fair lock's line is '<waiter id>.<suffix>': its waiter is told on the
    -- channel of that id, which its process keeps for the name between acquires.
    local waiter = string.match(entry, '^([^.]+)%.') or entry
    told = redis.call('PUBLISH', ARGV[2] .. ':' .. waiter, ARGV[1])
    if told > 0 then
      return 1 + told
    end
  end
  for _ = 1, 8 do
    local waiter = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
    if not waiter then
      break
    end
    redis.call('ZREM', KEYS[2], waiter)
    told = redis.call('PUBLISH', ARGV[2] .. ':' .. waiter, ARGV[1])
    if told > 0 then
      return 1 + told
    end
  end
  return 1 + redis.call('PUBLISH', ARGV[2], ARGV[1])
end
return 0
"""
)

# What a health probe runs to learn whether the node would take a lock: EVAL and EVALSHA, with
# a write command on a lock key. An ACL user limited to other commands or other keys is refused
# with NOPERM; a master that may not write (min-replicas-to-write unmet: NOREPLICAS; a replica:
# READONLY) refuses the write. Either way the node would never vote. The key does not exist,
# so the PEXPIRE changes nothing and nothing is replicated.
# KEYS[1] a lock key (of a name no lock uses)
# Returns 1.
PERMITTED = Script(
    """
redis.call('PEXPIRE', KEYS[1], 1)
return 1
"""
)

# Delete the lock whoever holds it (admin / operator action), wake waiters, and tell the
# holder: the token goes out on the lock's release channel and on the holders' channel, which
# every auto-renewing holder of a process hears through one subscription per node.
# KEYS[1] lock
# ARGV[1] release channel, ARGV[2] the token to remove, or "" for whichever holds it,
# ARGV[3] holders' channel
# Returns the token that was removed, or false when there was no lock (or another token).
FORCE_RELEASE = Script(
    _FIELDS
    + """
local token = fields(redis.call('GET', KEYS[1]) or '')
if token and (ARGV[2] == '' or token == ARGV[2]) then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[1], token)
  redis.call('PUBLISH', ARGV[3], token)
  return token
end
return false
"""
)

# Whether this node sits out its restart guard, judged as ``_GUARD`` judges it for an acquire
# but read-only (it arms no marker): for a read that must not count the "no key" of a node
# that may have lost its keys as "not held" (``locked()``, the listing).
# KEYS[1] node marker
# ARGV[1] the run id of the server this connection reached, then a space and its
# master_replid when the connection read one; ARGV[2] guard period ms
# Returns {ms, unmarked}: ms this node still sits out (0: it votes; the whole guard period
# while its marker is missing or from an earlier server process or dataset, which the next
# acquire arms), unmarked = 1 when it has no marker at all (never voted since its data went).
SITS_OUT = Script(
    """
local run_id, replid = string.match(ARGV[1], '^(%S+) ?(%S*)$')
local guard = tonumber(ARGV[2])
local m = redis.call('HMGET', KEYS[1], 'run_id', 'started', 'trusted', 'armed', 'id', 'replid')
local of, was = false, false
if m[6] then
  of, was = string.match(m[6], '^(%S+) (%S*)$')
end
local resynced = of and of == m[5] and replid ~= '' and was ~= replid
if m[1] ~= run_id or not (m[2] and m[3] and m[4]) or resynced then
  return {guard, m[1] and 0 or 1}
end
if tonumber(m[3]) > 0 then
  return {0, 0}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {math.max(tonumber(m[2]) + guard - now, 0), 0}
"""
)

# Mark this node usable now: used when every node of a cluster reports it has never been
# used (a brand-new cluster has no leases to protect). Only the marker the caller saw fresh
# is trusted: a node flushed and armed again since (a FLUSHALL keeps the run id) has a new
# marker id, and a late TRUST must not make it vote.
# KEYS[1] node marker
# ARGV[1] run_id the caller saw on this node, ARGV[2] the marker id it saw
# Returns 1 when that very marker is still there and is now trusted, else 0.
TRUST = Script(
    """
local m = redis.call('HMGET', KEYS[1], 'run_id', 'id')
if m[1] == ARGV[1] and m[2] == ARGV[2] then
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
# ARGV[1] run_id of the server this connection reached, ARGV[2] its master_replid ('' or
# absent when the connection read none), ARGV[3] the Sentinels' failover epoch that named it
# master ('' or absent for a server's URL)
# Returns 1.
TRUST_NOW = Script(
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = t[1] .. string.format('%06d', t[2])
redis.call('HSET', KEYS[1], 'run_id', ARGV[1], 'started', now, 'fresh', 0, 'trusted', now,
           'armed', now, 'id', id, 'replid', id .. ' ' .. (ARGV[2] or ''))
if ARGV[3] and ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'epoch', ARGV[3])
end
return 1
"""
)

# One step of listing the locks on this node: a SCAN step, and each lock's fields, as JSON
# (one reply for up to `count` locks instead of two per lock keeps a 10,000-lock listing fast).
# KEYS none
# ARGV[1] SCAN cursor, ARGV[2] MATCH pattern, ARGV[3] COUNT
# Returns {next cursor, JSON list of [key, token, meta, fence, renewals, acquired, ttl, pttl]}
LIST = Script(
    _FIELDS
    + """
local step = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', ARGV[3], 'TYPE', 'string')
local out = {}
for _, key in ipairs(step[2]) do
  local token, fence, renewals, acquired, ttl, meta = fields(redis.call('GET', key) or '')
  local pttl = redis.call('PTTL', key)
  if token and pttl > 0 then
    -- Numbers stay strings: cjson would round a 16-digit fence to 14 digits.
    out[#out + 1] = {key, token, meta, fence, renewals, acquired, ttl, pttl}
  end
end
if #out == 0 then
  return {step[1], '[]'}
end
return {step[1], cjson.encode(out)}
"""
)
