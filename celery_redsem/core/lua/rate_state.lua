-- rate_state: a snapshot of one rate limiter on the server's clock (for status and inspect).
--
-- KEYS[1] rate  HASH  'tat', 'atat', 'interval', 'burst' (see gcra.lua)
-- KEYS[2] line  ZSET  permit id -> booked slot, or minus the admission time (server us)
-- Returns {now us, later TAT us or '', interval us or '', burst or '', booked, remembered}:
--         booked counts bookings not claimed yet, remembered every entry (admitted ones too).
-- Read-only.
-- @common
local _, now = server_now()
local got = redis.call('HMGET', KEYS[1], 'tat', 'atat', 'interval', 'burst')
local tat = got[1] and fmt(math.max(tonumber(got[1]), tonumber(got[2] or 0) or 0)) or ''
local booked = redis.call('ZCOUNT', KEYS[2], '0', '+inf')
local remembered = redis.call('ZCARD', KEYS[2])
return {fmt(now), tat, got[3] or '', got[4] or '', booked, remembered}
