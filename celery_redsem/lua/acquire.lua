-- acquire: grant a permit, or take / keep a place in the FIFO waiting line.
--
-- KEYS[1] holders  KEYS[2] tokens  KEYS[3] waiters  KEYS[4] wexp  KEYS[5] meta
-- ARGV[1] permit id
-- ARGV[2] limit (>= 1)
-- ARGV[3] lease, ms
-- ARGV[4] '1' to join (or stay in) the waiting line when no permit is free, '0' to only try
-- ARGV[5] waiter lease, ms: how long a place in line is kept without the waiter coming back
-- ARGV[6] idle ttl, ms: how long keys outlive the last lease in them
-- ARGV[7] wake key prefix
--
-- Returns {1, token, lease expiry ms, now ms}     granted (or already held: same token, lease renewed)
--         {0, position, waiter expiry ms, now ms} not granted; position is 1-based, 0 if not in line
--
-- Idempotent per permit id: a holder gets its permit back, a waiter keeps its ticket.
local holders, tokens, waiters, wexp, meta = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id = ARGV[1]
local limit = tonumber(ARGV[2])
local lease = tonumber(ARGV[3])
local join = ARGV[4] == '1'
local waiter_lease = tonumber(ARGV[5])
local idle_ttl = tonumber(ARGV[6])
local wake_prefix = ARGV[7]

local now, now_us = server_now()
local freed = purge(holders, tokens, waiters, wexp, now)
redis.call('HSET', meta, 'limit', limit)

local held = redis.call('ZSCORE', holders, id)
if held then
  local expires = now + lease
  redis.call('ZADD', holders, fmt(expires), id)
  keep_alive(holders, tokens, waiters, wexp, meta, now, idle_ttl)
  return {1, tonumber(redis.call('HGET', tokens, id)), expires, now}
end

local live = live_holders(holders, now)
local rank = redis.call('ZRANK', waiters, id)
local ahead = rank or redis.call('ZCARD', waiters)

if live + ahead < limit then
  local token = math.max(tonumber(redis.call('HGET', meta, 'fence') or 0) + 1, now_us)
  local expires = now + lease
  redis.call('HSET', meta, 'fence', fmt(token))
  redis.call('ZADD', holders, fmt(expires), id)
  redis.call('HSET', tokens, id, fmt(token))
  if rank then
    redis.call('ZREM', waiters, id)
    redis.call('ZREM', wexp, id)
  end
  redis.call('DEL', wake_prefix .. id)
  if freed > 0 then
    wake(waiters, wexp, wake_prefix, limit - live - 1, now)
  end
  keep_alive(holders, tokens, waiters, wexp, meta, now, idle_ttl)
  return {1, token, expires, now}
end

local position = 0
local waiter_until = 0
if join then
  if not rank then
    local ticket = redis.call('HINCRBY', meta, 'ticket', 1)
    redis.call('ZADD', waiters, ticket, id)
    rank = ahead
  end
  waiter_until = now + waiter_lease
  redis.call('ZADD', wexp, fmt(waiter_until), id)
  position = rank + 1
end
if freed > 0 then
  wake(waiters, wexp, wake_prefix, limit - live, now)
end
keep_alive(holders, tokens, waiters, wexp, meta, now, idle_ttl)
return {0, position, waiter_until, now}
