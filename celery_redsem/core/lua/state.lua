-- state: a consistent snapshot of one semaphore, for inspection. Read-only.
--
-- KEYS[1] holders (on Redis Cluster also KEYS[2..4]: waiters, wexp, wdue; see _common.lua)
-- Returns {now ms, limit or false, last token or false,
--          {id, token, lease expiry ms, ...} for live holders,
--          {id, ticket, waiter expiry ms, ...} for live waiters in line order}
local holders = KEYS[1]
local h = helpers()
local waiters, wexp = h.sibling_keys(holders)  -- (wdue is not shown)
local now = server_now()
local held = {}
local all = redis.call('HGETALL', holders)
for i = 1, #all, 2 do
  if string.sub(all[i], 1, 1) ~= ':' then
    local token, expiry = h.parse(all[i + 1])
    if expiry > now then
      held[#held + 1] = all[i]
      held[#held + 1] = fmt(token)
      held[#held + 1] = fmt(expiry)
    end
  end
end
local waiting = {}
local line = redis.call('ZRANGE', waiters, 0, -1, 'WITHSCORES')
for i = 1, #line, 2 do
  local until_ms = redis.call('ZSCORE', wexp, line[i])
  if until_ms and tonumber(until_ms) > now then
    waiting[#waiting + 1] = line[i]
    waiting[#waiting + 1] = line[i + 1]
    waiting[#waiting + 1] = until_ms
  end
end
local limit, fence = unpack(redis.call('HMGET', holders, ':limit', ':fence'))
return {now, limit, fence, held, waiting}
