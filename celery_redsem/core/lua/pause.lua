-- pause: hold every start of one name (its rate limiter's and its semaphore's) for a while, or
-- resume it.
--
-- KEYS[1] pause  HASH    'until': when the name's pause ends (server ms); the key expires
--                        then: gcra.lua admits and books nobody while it exists (a hash and
--                        PEXPIRE, not SET: the documented ACL rule allows them already)
-- KEYS[2] line   ZSET    the rate limiter's (gcra.lua), or absent
-- The semaphore's holders hash (derived, same hash tag) gets ':gate' 0 if it exists, closing
-- acquire.lua's fast path: its slow path reads the pause key and grants nothing meanwhile.
-- ARGV[1] milliseconds to pause for (1 .. MAX_MS), or 0 to resume (delete the key)
-- ARGV[2] a permit id whose admission the line forgets ('' for none): a run that pauses the
--         name (its call was refused, as with HTTP 429) and asks again later takes a new unit
-- Returns the milliseconds the name stays paused (0: not paused). A pause never shortens a
-- longer one already set (two callers told "Retry-After: 30" and "10" hold it for 30 s), so
-- the same call sent twice pauses once.
-- @common
local ms = tonumber(ARGV[1])
if not ms or ms < 0 or ms > MAX_MS or ms ~= math.floor(ms) then
  return redis.error_reply('ERR pause.lua: a setting is out of bounds')
end
if ARGV[2] and ARGV[2] ~= '' and KEYS[2] then
  redis.call('ZREM', KEYS[2], ARGV[2])
end
if ms == 0 then
  redis.call('DEL', KEYS[1])
  return 0
end
local left = redis.call('PTTL', KEYS[1])
if left >= ms then
  return left
end
local holders = string.sub(KEYS[1], 1, #KEYS[1] - 5) .. 'holders'
if redis.call('HGET', holders, ':gate') then
  redis.call('HSET', holders, ':gate', 0)
end
local now = server_now()
redis.call('HSET', KEYS[1], 'until', fmt(now + ms))
redis.call('PEXPIRE', KEYS[1], fmt(ms))
return ms
