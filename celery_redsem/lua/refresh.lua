-- refresh: extend the leases of many permits in one call. Never resurrects a permit.
--
-- KEYS: three per permit, in order: holders, tokens, meta of the permit's semaphore
-- ARGV[1] idle ttl, ms
-- ARGV[1 + 3i - 2 .. 1 + 3i] for permit i: permit id, fencing token, lease ms
--
-- Returns one integer per permit: the new lease expiry (server ms) if the permit was still held
-- by that grant and not yet expired, else 0 (lost: expired, released, or re-granted).
local idle_ttl = tonumber(ARGV[1])
local now = server_now()
local out = {}
for i = 1, #KEYS / 3 do
  local holders, tokens, meta = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local id, token, lease = ARGV[3 * i - 1], ARGV[3 * i], tonumber(ARGV[3 * i + 1])
  local score = redis.call('ZSCORE', holders, id)
  local current = redis.call('HGET', tokens, id)
  if score and tonumber(score) > now and current == token then
    local expires = now + lease
    redis.call('ZADD', holders, 'XX', fmt(expires), id)
    local longest = tonumber(redis.call('ZRANGE', holders, -1, -1, 'WITHSCORES')[2])
    redis.call('PEXPIREAT', holders, fmt(longest + idle_ttl))
    redis.call('PEXPIREAT', tokens, fmt(longest + idle_ttl))
    if redis.call('PTTL', meta) < expires - now + idle_ttl then
      redis.call('PEXPIRE', meta, fmt(expires - now + idle_ttl))
    end
    out[i] = expires
  else
    if score and tonumber(score) <= now and current == token then
      redis.call('ZREM', holders, id)
      redis.call('HDEL', tokens, id)
    end
    out[i] = 0
  end
end
return out
