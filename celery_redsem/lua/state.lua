-- state: a consistent snapshot of one semaphore, for inspection. Read-only.
--
-- KEYS[1] holders  KEYS[2] tokens  KEYS[3] waiters  KEYS[4] wexp  KEYS[5] meta
-- Returns {now ms, limit or false, last token or false,
--          {id, token, lease expiry ms, ...} for live holders by expiry,
--          {id, ticket, waiter expiry ms, ...} for live waiters in line order}
local holders, tokens, waiters, wexp, meta = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local now = server_now()
local h = {}
local live = redis.call('ZRANGEBYSCORE', holders, '(' .. fmt(now), '+inf', 'WITHSCORES')
for i = 1, #live, 2 do
  h[#h + 1] = live[i]
  h[#h + 1] = redis.call('HGET', tokens, live[i]) or '0'
  h[#h + 1] = live[i + 1]
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
return {now, redis.call('HGET', meta, 'limit'), redis.call('HGET', meta, 'fence'), h, w}
