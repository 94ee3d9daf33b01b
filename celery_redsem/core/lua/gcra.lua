-- gcra: one attempt on a rate limiter (the generic cell rate algorithm on the server's clock):
-- admit now, book the next free slot for the caller, or say how long until one is free.
--
-- KEYS[1] rate  HASH  'tat'       theoretical arrival time of the schedule (server
--                                 microseconds): admissions and bookings advance it
--                     'atat'      the same for actual admissions only: whatever was booked, and
--                                 however late a booked caller comes, nobody is admitted at
--                                 `now` unless now >= atat - (burst - 1) * interval
--                     'interval'  microseconds between admissions; 'burst' (for inspection)
--                     Expires when both have passed: an idle limiter leaves no key behind.
-- KEYS[2] line  ZSET  permit id -> its booked slot (server microseconds, >= 0), or minus the
--                     time it was admitted. An entry is forgotten `keep` ms after its slot or
--                     admission; the key expires `keep` after the TATs.
-- ARGV[1] interval in microseconds (1 .. MAX_MS * 1000)
-- ARGV[2] burst: admissions the limiter allows at once (1 .. MAX_COUNT)
-- ARGV[3] keep: milliseconds an admission or booking is remembered after its slot (0 .. MAX_MS)
-- ARGV[4] book: 0 to only try, 1 to book the next free slot when refused, 2 to reserve it:
--         book the next free slot even if it is free now, admitting nobody (the caller takes
--         it later, at its slot, with an attempt under the same id: the admission counts then)
-- ARGV[5] horizon: book only a slot at most this many microseconds ahead (0 .. MAX_MS * 1000)
-- ARGV[6] permit id ('' for none: nothing is remembered, nothing booked)
-- (Settings out of bounds get an error reply, and nothing is written.)
--
-- Returns {admitted, wait, booked}: admitted 1 (wait 0) or 0; wait the microseconds until the
--         caller may run (its booked slot, or later if late callers took the actual slots, if
--         booked is 1, and 0 for a reserved slot that is due; else the next free slot, which
--         others may take first).
--
-- Idempotent per permit id: an id admitted within `keep` is admitted again without using a
-- slot; one that booked gets the time left until its slot. Booked slots are served in the
-- order they were booked: first to ask, first to run.
-- @common
local rate_key, line_key = KEYS[1], KEYS[2]
local interval, burst, keep = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local book, reserve = ARGV[4] == '1' or ARGV[4] == '2', ARGV[4] == '2'
local horizon, id = tonumber(ARGV[5]), ARGV[6]
if not (interval and burst and keep and horizon)
    or interval < 1 or interval > MAX_MS * 1000 or burst < 1 or burst > MAX_COUNT
    or keep < 0 or keep > MAX_MS or horizon < 0 or horizon > MAX_MS * 1000 then
  return redis.error_reply('ERR gcra.lua: a setting is out of bounds')
end
local _, now = server_now()
local got = redis.call('HMGET', rate_key, 'tat', 'atat')
local tat, atat = tonumber(got[1] or 0) or 0, tonumber(got[2] or 0) or 0
tat, atat = math.max(tat, now), math.max(atat, now)
local tau = (burst - 1) * interval

-- Admit at `now` (the actual admissions obey the rate, whoever booked what), `slot` the
-- caller's booked slot if it has one.
local function admit(slot)
  atat = atat + interval
  if slot == nil then
    tat = tat + interval
  end
  local ttl = math.ceil((math.max(tat, atat) - now) / 1000)
  redis.call('HSET', rate_key, 'tat', fmt(tat), 'atat', fmt(atat), 'interval', fmt(interval),
    'burst', fmt(burst))
  redis.call('PEXPIRE', rate_key, fmt(ttl))
  if id ~= '' then
    redis.call('ZADD', line_key, fmt(-now), id)
    redis.call('PEXPIRE', line_key, fmt(ttl + keep))
  end
  return {1, 0, 0}
end

if id ~= '' then
  local horizon_ago = now - keep * 1000
  redis.call('ZREMRANGEBYSCORE', line_key, '(' .. fmt(-horizon_ago), '(0')
  redis.call('ZREMRANGEBYSCORE', line_key, '0', '(' .. fmt(horizon_ago))
  local slot = redis.call('ZSCORE', line_key, id)
  if slot then
    slot = tonumber(slot)
    if slot < 0 then
      return {1, 0, 0} -- admitted before: again, using no slot
    end
    local wait = math.max(slot, atat - tau) - now
    if wait > 0 or reserve then
      return {0, math.max(wait, 0), 1}
    end
    return admit(slot)
  end
end

local free_at = math.max(tat, atat) - tau
local wait = free_at - now
if wait <= 0 and not reserve then
  return admit(nil)
end
if not (book and id ~= '' and tat - tau - now <= horizon) then
  return {0, wait, 0}
end
local slot = math.max(tat - tau, now)
tat = tat + interval
local ttl = math.ceil((math.max(tat, atat) - now) / 1000)
redis.call('HSET', rate_key, 'tat', fmt(tat), 'interval', fmt(interval), 'burst', fmt(burst))
redis.call('PEXPIRE', rate_key, fmt(ttl))
redis.call('ZADD', line_key, fmt(slot), id)
redis.call('PEXPIRE', line_key, fmt(ttl + keep))
return {0, math.max(slot, atat - tau, now) - now, 1}
