-- release: give a permit back, or leave the waiting line. Idempotent and owner-checked.
--
-- KEYS[1] holders  KEYS[2] tokens  KEYS[3] waiters  KEYS[4] wexp  KEYS[5] meta
-- ARGV[1] permit id
-- ARGV[2] fencing token of the grant being released, or '' to release whatever grant the id holds
--         (used by the worker's main process, which knows only the task id)
-- ARGV[3] idle ttl, ms
-- ARGV[4] wake key prefix
--
-- Returns 1 if a held permit was released, 2 if a place in line was given up, 0 if the id had
-- neither (already released, expired, or a different grant with the same id).
local holders, tokens, waiters, wexp, meta = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id, token = ARGV[1], ARGV[2]
local idle_ttl = tonumber(ARGV[3])
local wake_prefix = ARGV[4]

local now = server_now()
purge(holders, tokens, waiters, wexp, now)

local result = 0
if redis.call('ZSCORE', holders, id) then
  if token == '' or redis.call('HGET', tokens, id) == token then
    redis.call('ZREM', holders, id)
    redis.call('HDEL', tokens, id)
    result = 1
  end
elseif redis.call('ZSCORE', waiters, id) then
  redis.call('ZREM', waiters, id)
  redis.call('ZREM', wexp, id)
  redis.call('DEL', wake_prefix .. id)
  result = 2
end

if result > 0 then
  local limit = tonumber(redis.call('HGET', meta, 'limit') or 1)
  wake(waiters, wexp, wake_prefix, limit - live_holders(holders, now), now)
  keep_alive(holders, tokens, waiters, wexp, meta, now, idle_ttl)
end
return result
