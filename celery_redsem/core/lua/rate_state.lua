-- rate_state: a snapshot of one rate limiter on the server's clock (for status and inspect).
--
-- KEYS[1] rate  HASH  per window 'tat', 'atat', 'interval', 'burst' (window w > 1 with the
--                     suffix ':<w>') and 'windows' (see gcra.lua)
-- KEYS[2] line  ZSET  permit id -> booked slot, or minus the admission time (server us)
-- KEYS[3] pause HASH  while it exists the limiter admits nobody (pause.lua)
-- Returns {now us, booked, remembered, paused ms (0: not paused), then per window: later TAT
--         us or '', interval us or '', burst or ''}: booked counts bookings not claimed yet,
--         remembered every entry (admitted ones too). No windows when the limiter is idle
--         (no key).
-- Read-only.
-- @common
local _, now = server_now()
local booked = redis.call('ZCOUNT', KEYS[2], '0', '+inf')
local remembered = redis.call('ZCARD', KEYS[2])
local reply = {fmt(now), booked, remembered, math.max(redis.call('PTTL', KEYS[3]), 0)}
local n = tonumber(redis.call('HGET', KEYS[1], 'windows') or '') or 0
if n == 0 and redis.call('HGET', KEYS[1], 'tat') then
  n = 1 -- written before windows were counted
end
for w = 1, math.min(n, 16) do
  local s = w == 1 and '' or (':' .. w)
  local got = redis.call('HMGET', KEYS[1], 'tat' .. s, 'atat' .. s, 'interval' .. s, 'burst' .. s)
  local tat = got[1] and fmt(math.max(tonumber(got[1]), tonumber(got[2] or 0) or 0)) or ''
  reply[#reply + 1] = tat
  reply[#reply + 1] = got[3] or ''
  reply[#reply + 1] = got[4] or ''
end
return reply
