-- Shared helpers: prepended to every script by scripts.py, never run alone.
--
-- Key layout of one semaphore (all keys share the hash tag {name}):
--   holders  ZSET  permit id -> lease expiry, server ms
--   tokens   HASH  permit id -> fencing token of its grant
--   waiters  ZSET  permit id -> ticket (FIFO order)
--   wexp     ZSET  permit id -> waiter lease expiry, server ms
--   meta     HASH  limit, fence (last token), ticket (last ticket)
-- Times come from the server's clock only (TIME); client clocks never matter.

local PURGE_BATCH = 1000

-- Server time as (milliseconds, microseconds).
local function server_now()
  local t = redis.call('TIME')
  local sec, usec = tonumber(t[1]), tonumber(t[2])
  return sec * 1000 + math.floor(usec / 1000), sec * 1000000 + usec
end

local function fmt(n)
  return string.format('%.0f', n)
end

-- Drop holders and waiters whose lease ended (score <= now), in bounded batches.
-- Returns how many holders were dropped.
local function purge(holders, tokens, waiters, wexp, now)
  local gone = redis.call('ZRANGEBYSCORE', holders, '-inf', now, 'LIMIT', 0, PURGE_BATCH)
  if #gone > 0 then
    redis.call('ZREM', holders, unpack(gone))
    redis.call('HDEL', tokens, unpack(gone))
  end
  local left = redis.call('ZRANGEBYSCORE', wexp, '-inf', now, 'LIMIT', 0, PURGE_BATCH)
  if #left > 0 then
    redis.call('ZREM', wexp, unpack(left))
    redis.call('ZREM', waiters, unpack(left))
  end
  return #gone
end

-- Live holders: lease expiry strictly after now.
local function live_holders(holders, now)
  return redis.call('ZCOUNT', holders, '(' .. fmt(now), '+inf')
end

-- Tell the first `free` waiters that a permit may be free (they BLPOP their own list).
local function wake(waiters, wexp, wake_prefix, free, now)
  if free <= 0 then
    return
  end
  local first = redis.call('ZRANGE', waiters, 0, free - 1)
  for _, id in ipairs(first) do
    local until_ms = tonumber(redis.call('ZSCORE', wexp, id) or now)
    if until_ms > now then
      local key = wake_prefix .. id
      redis.call('LPUSH', key, '1')
      redis.call('LTRIM', key, 0, 0)
      redis.call('PEXPIRE', key, fmt(until_ms - now))
    end
  end
end

-- Give every key a TTL that outlives the longest lease in it by idle_ttl, so an idle
-- semaphore leaves nothing behind.
local function keep_alive(holders, tokens, waiters, wexp, meta, now, idle_ttl)
  local h = redis.call('ZRANGE', holders, -1, -1, 'WITHSCORES')
  local w = redis.call('ZRANGE', wexp, -1, -1, 'WITHSCORES')
  local hx = tonumber(h[2] or 0)
  local wx = tonumber(w[2] or 0)
  if hx > 0 then
    redis.call('PEXPIREAT', holders, fmt(hx + idle_ttl))
    redis.call('PEXPIREAT', tokens, fmt(hx + idle_ttl))
  end
  if wx > 0 then
    redis.call('PEXPIREAT', waiters, fmt(wx + idle_ttl))
    redis.call('PEXPIREAT', wexp, fmt(wx + idle_ttl))
  end
  redis.call('PEXPIREAT', meta, fmt(math.max(hx, wx, now) + idle_ttl))
end
