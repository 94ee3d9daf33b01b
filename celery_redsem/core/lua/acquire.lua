-- acquire: grant a permit, or take / keep a place in the FIFO waiting line.
--
-- KEYS[1] holders (on Redis Cluster also KEYS[2..4]: waiters, wexp, wdue; see _common.lua)
-- ARGV[1] '<limit>:<lease ms>:<waiter lease ms>:<idle ttl ms>:<join>:<back in ms>[:1]|<permit id>'
--         (one argument, not two: each argument costs the client time on every task start),
--         where 1 <= limit <= MAX_COUNT and each duration <= MAX_MS (_common.lua; other
--         settings get an error reply, and nothing is written); the waiter lease is how long
--         a place in line is kept without the waiter coming back; the idle ttl is how long
--         keys outlive the last lease in them; join is 1 to join (or stay in) the waiting
--         line when no permit is free, 0 to only try; back in is when the caller will ask
--         again (0: it waits now, as a blocked caller does): until then its place does not
--         hold a free permit for it (< waiter lease); a ':1' before the '|' asks to mark a
--         renewal (for callers that give back a new grant that too few replicas acknowledged,
--         and must not give back one held before). The permit id is everything after the
--         first '|'.
--
-- Returns status '<token>:<lease expiry ms>'  granted (or already held: same token, lease
--                                             renewed; with ':1' asked, that renewal ends in
--                                             ':renewed')
--         {position, waiter expiry ms}   not granted; position is 1-based, 0 if not in line
--         {0, 0, pause ms}               not granted: the name is paused (pause.lua) for
--                                        that long; holders renew, places in line are kept
-- (A grant is one status string, not a table or a bulk string: it is the reply parsed on every
-- task start, and a status line is the cheapest for a client to read.)
--
-- Idempotent per permit id: a holder gets its permit back, a waiter keeps its ticket.
-- A free permit with nobody waiting costs four calls: TIME, HMGET, HLEN, HSET.
local COUNTERS = 7 -- counter fields in the holders hash (see _common.lua)
local holders = KEYS[1]
local limit, lease, id = string.match(ARGV[1], '^(%d+):(%d+):[^|]*|(.*)$')
local time = redis.call('TIME') -- as server_now() does; the helpers come after the fast path
local now_us = time[1] * 1000000 + time[2]
local now = (now_us - now_us % 1000) / 1000
local expires = now + lease
local got = redis.call('HMGET', holders, id, ':fence', ':gate', ':next', ':limit')
local mine, fence, gate, next_expiry, stored_limit = got[1], got[2], got[3], got[4], got[5]

-- The fast path, taken on most task starts: a new caller, a permit free, nobody in line, and
-- no counter but the fence to change (':gate' says so). Every step here is paid on each task
-- start, so it reads only what it decides on, compares the limit as the server stored it
-- (integers are rendered exactly), lets Lua's arithmetic convert the numbers it computes with
-- (a call to tonumber or math costs more), and returns a status reply; the rest of the
-- settings are parsed, and the shared helpers (_common.lua) and closures created, only past it.
if not mine and stored_limit == limit and gate and gate + 0 >= expires
    and (next_expiry or 0) + 0 <= expires
    and redis.call('HLEN', holders) - COUNTERS < limit + 0 then
  local token = (fence or 0) + 1
  if token < now_us then
    token = now_us
  end
  local entry = string.format('%d:%d', token, expires)
  redis.call('HSET', holders, ':fence', token, id, entry)
  return {ok = entry}
end

-- @common
local waiter_lease, idle_ttl, join, back_in, mark_renewal =
  string.match(ARGV[1], '^%d+:%d+:(%d+):(%d+):(%d):(%d+):?(%d?)|')
limit, lease, idle_ttl = tonumber(limit), tonumber(lease), tonumber(idle_ttl)
waiter_lease, back_in = tonumber(waiter_lease), tonumber(back_in)
-- Settings out of bounds (or malformed) are refused before anything is written. (The fast path
-- needs no such check: it writes only for a lease that ends by ':gate', which a call that
-- passed this check stored, with this very limit.)
if not (back_in and limit >= 1 and limit <= MAX_COUNT and lease <= MAX_MS
    and waiter_lease <= MAX_MS and idle_ttl <= MAX_MS and back_in <= MAX_MS) then
  return redis.error_reply('ERR acquire.lua: settings out of bounds or malformed: ' .. ARGV[1])
end
local half_idle = math.floor(idle_ttl / 2)
-- Paused (pause.lua closed the fast path's gate; it stays closed until the pause ends).
local paused = redis.call('PTTL', string.sub(holders, 1, #holders - 7) .. 'pause')
local queued, horizon, ticket = unpack(redis.call('HMGET', holders, ':queued', ':horizon', ':ticket'))
local fresh = not fence
fence, queued, gate = tonumber(fence or 0), tonumber(queued or 0), tonumber(gate or 0)
next_expiry, horizon, ticket = tonumber(next_expiry or 0), tonumber(horizon or 0), tonumber(ticket or 0)
local seen_queued, seen_next, seen_ticket = queued, next_expiry, ticket

-- ':gate' for a hash that expires at `new_horizon`: the fast path is open for leases ending
-- by then less half an idle TTL, unless someone waits or no holder's expiry is known.
local function gate_for(new_horizon)
  if queued == 0 and next_expiry ~= 0 and paused <= 0 then
    return new_horizon - half_idle
  end
  return 0
end

-- Did anything but the fence change since the HMGET (or does the TTL need a push)?
local function changed(new_horizon)
  return new_horizon ~= horizon or tonumber(stored_limit) ~= limit or queued ~= seen_queued
    or next_expiry ~= seen_next or ticket ~= seen_ticket or gate_for(new_horizon) ~= gate
end

-- Write the counters (all seven when any but the fence changed or the hash is new), push the
-- TTL when it comes within half an idle TTL of `keep_until`. Numbers go to the server as they
-- are: it renders integers exactly, and formatting in Lua is costly for a script this short.
local function save(field, value, keep_until)
  local new_horizon = horizon
  if fresh or horizon < keep_until + half_idle then
    new_horizon = keep_until + idle_ttl
  end
  if changed(new_horizon) then
    redis.call('HSET', holders, ':fence', fence, ':limit', limit, ':ticket', ticket,
      ':queued', queued, ':next', next_expiry, ':horizon', new_horizon,
      ':gate', gate_for(new_horizon), field, value)
  else
    redis.call('HSET', holders, ':fence', fence, field, value)
  end
  if new_horizon ~= horizon then
    redis.call('PEXPIREAT', holders, new_horizon)
  end
end

local h -- slow-path helpers, built only when needed
if mine then
  h = helpers()
  local entry
  entry, next_expiry = h.renew(mine, now, expires, next_expiry)
  if entry then
    save(id, entry, expires)
    if mark_renewal == '1' then
      return {ok = entry .. ':renewed'}
    end
    return {ok = entry}
  end
  redis.call('HDEL', holders, id)
end
if paused > 0 then
  return {0, 0, paused}
end

local held = fresh and 0 or redis.call('HLEN', holders) - COUNTERS
if fresh then
  -- The hash is new. If a waiting line outlived it (an admin deleted the hash, or memory
  -- pressure evicted it), carry on from the line's own state so nobody jumps the queue.
  h = h or helpers()
  local line = h.sibling_keys(holders)
  local last = redis.call('ZRANGE', line, -1, -1, 'WITHSCORES')
  if last[2] then
    ticket, queued = tonumber(last[2]), redis.call('ZCARD', line)
  end
end
-- `ahead`: waiters before this caller whose place holds a permit now (they are due).
local waiters, wexp, wdue, rank
local ahead = 0
-- This caller's ticket, if it is in line (asked for only when counting due waiters ahead).
local function my_ticket()
  return tonumber(redis.call('ZSCORE', waiters, id) or 0)
end
if queued > 0 then
  h = h or helpers()
  waiters, wexp, wdue = h.sibling_keys(holders)
  rank = redis.call('ZRANK', waiters, id) or nil
  if rank and tonumber(redis.call('ZSCORE', wexp, id) or 0) <= now then
    -- This caller's place lapsed (nothing swept it yet): it comes back as a newcomer,
    -- behind everyone still in line, not with its old place.
    h.leave_line(holders, waiters, wexp, wdue, id)
    queued, rank = queued - 1, nil
  end
  if queued > 0 then
    ahead = h.due_ahead(waiters, wdue, rank or queued, queued, my_ticket(), now, limit - held)
  end
end

if held + ahead >= limit then
  -- Looks full: sweep out holders and waiters whose leases ended, if any can have.
  h = h or helpers()
  waiters, wexp, wdue = h.sibling_keys(holders)
  local freed = false
  if next_expiry == 0 or next_expiry <= now then
    local before = held
    held, next_expiry = h.sweep_holders(holders, now)
    freed = held < before
  end
  if queued > 0 then
    local before = queued
    queued = h.sweep_waiters(waiters, wexp, wdue, now)
    rank = queued > 0 and redis.call('ZRANK', waiters, id) or nil
    ahead = h.due_ahead(waiters, wdue, rank or queued, queued, my_ticket(), now, limit - held)
    freed = freed or queued < before
  end
  if freed then
    h.wake(holders, waiters, wexp, wdue, limit - held, now)
  end
end

if held + ahead < limit then
  fence = math.max(fence + 1, now_us)
  if rank then
    h.leave_line(holders, waiters, wexp, wdue, id)
    queued = queued - 1
  end
  if next_expiry == 0 or expires < next_expiry then
    next_expiry = expires
  end
  local entry = string.format('%d:%d', fence, expires)
  save(id, entry, expires)
  return {ok = entry}
end

if join ~= '1' then
  if changed(horizon) then
    save(':limit', limit, now)
  end
  return {0, 0}
end
if not rank then
  rank = queued
  ticket = ticket + 1
  queued = queued + 1
  redis.call('ZADD', waiters, ticket, id)
end
local waiter_until = now + waiter_lease
local fresh_line = queued == 1 and rank == 0
redis.call('ZADD', wexp, waiter_until, id)
redis.call('ZADD', wdue, now + back_in, id)
h.extend(waiters, waiter_until + idle_ttl, fresh_line)
h.extend(wexp, waiter_until + idle_ttl, fresh_line)
h.extend(wdue, waiter_until + idle_ttl, fresh_line)
save(':limit', limit, waiter_until + half_idle)
return {rank + 1, waiter_until}
