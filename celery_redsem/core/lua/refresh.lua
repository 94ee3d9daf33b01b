-- refresh: extend the leases of many permits in one call. Never resurrects a permit.
--
-- KEYS[i]: the holders hash of permit i's semaphore (keys may repeat)
-- ARGV[1] idle ttl, ms
-- ARGV[3i - 1], ARGV[3i], ARGV[3i + 1] for permit i: permit id, fencing token, lease ms
--
-- Returns one integer per permit: the new lease expiry (server ms) if the permit was still held
-- by that grant and not yet expired, else 0 (lost: expired, released, or re-granted).
-- An idle ttl or a lease over MAX_MS (_common.lua), or a missing one, gets an error reply before
-- any permit is touched.
local idle_ttl = tonumber(ARGV[1])
local valid = idle_ttl and idle_ttl <= MAX_MS and #ARGV == 3 * #KEYS + 1
for i = 1, valid and #KEYS or 0 do
  local lease = tonumber(ARGV[3 * i + 1])
  if not (lease and lease <= MAX_MS) then
    valid = false
    break
  end
end
if not valid then
  return redis.error_reply('ERR refresh.lua: an idle ttl or a lease out of bounds or missing')
end
local now = server_now()
local out = {}
for i = 1, #KEYS do
  local holders = KEYS[i]
  local id, token, lease = ARGV[3 * i - 1], ARGV[3 * i], tonumber(ARGV[3 * i + 1])
  local mine, horizon, next_expiry = unpack(redis.call('HMGET', holders, id, ':horizon', ':next'))
  out[i] = 0
  if mine and string.match(mine, '^(%d+):') == token then
    local expiry = tonumber(string.match(mine, ':(%d+)$')) or 0 -- unreadable: expired
    if expiry > now then
      local expires = now + lease
      local entry = token .. ':' .. expires
      if tonumber(next_expiry or 0) > expires then -- a shorter lease: keep ':next' a lower bound
        redis.call('HSET', holders, ':next', expires)
      end
      horizon = tonumber(horizon or 0)
      if horizon < expires + math.floor(idle_ttl / 2) then
        redis.call('HSET', holders, id, entry, ':horizon', expires + idle_ttl)
        redis.call('PEXPIREAT', holders, expires + idle_ttl)
        -- A grouped semaphore's grants (fair_share.py) are kept as long as its holders.
        local base = string.sub(holders, 1, #holders - 7)
        redis.call('PEXPIREAT', base .. 'fair', expires + idle_ttl, 'GT')
        redis.call('PEXPIREAT', base .. 'fh', expires + idle_ttl, 'GT')
      else
        redis.call('HSET', holders, id, entry)
      end
      out[i] = expires
    else
      redis.call('HDEL', holders, id)
    end
  end
end
return out
