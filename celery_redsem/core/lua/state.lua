-- state: a consistent snapshot of one semaphore, for inspection. Read-only.
--
-- KEYS[1] holders (on Redis Cluster also KEYS[2..4]: waiters, wexp, wdue; see _common.lua)
-- Returns {now ms, limit or false, last token or false,
--          {id, token, lease expiry ms, ...} for live holders,
--          {id, ticket, waiter expiry ms, ...} for live waiters in line order}
local holders = KEYS[1]
local lib = helpers()
local waiters, wexp = lib.sibling_keys(holders)  -- (wdue is not shown)
local now = server_now()
local h = {}
local all = redis.call('HGETALL', holders)
for i = 1, #all, 2 do
  if string.sub(all[i], 1, 1) ~= ':' then
    local token, expiry = lib.parse(all[i + 1])
    if expiry > now then
      h[#h + 1] = all[i]
      h[#h + 1] = fmt(token)
      h[#h + 1] = fmt(expiry)
    end
  end
end
local w = {}
local line = redis.call('ZRANGE', waiters, 0, -1, 'WITHSCORES')
for i = 1, #line, 2 do
  local until_ms = redis.call('ZSCORE', wexp, line[i])
  if until_ms and tonumber(until_ms) > now then
    w[#w + 1] = line[i]
    w[#w + 1] = line[i + 1]
    w[#w + 1] = until_ms
  end
end
local limit, fence = unpack(redis.call('HMGET', holders, ':limit', ':fence'))
return {now, limit, fence, h, w}
