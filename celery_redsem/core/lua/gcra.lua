-- gcra: one attempt on a rate limiter (the generic cell rate algorithm with a cost, over one or
-- more windows, on the server's clock): admit now, book the next free slot for the caller, say
-- how long until one is free, or charge units after the fact.
--
-- KEYS[1] rate  HASH  per window w (fields of window 1 unsuffixed, of window w > 1 ':<w>'):
--                     'tat'       theoretical arrival time of the schedule (server
--                                 microseconds): admissions and bookings advance it by
--                                 cost x interval
--                     'atat'      the same for actual admissions (and charges) only: whatever
--                                 was booked, and however late a booked caller comes, nobody
--                                 is admitted at `now` unless the actual TATs allow it
--                     'interval'  microseconds per unit; 'burst' units the window holds at
--                                 once; 'windows' how many windows (for inspection)
--                     Expires when every TAT has passed: an idle limiter leaves no key behind.
-- KEYS[2] line  ZSET  permit id -> its booked slot (server microseconds, >= 0), or minus the
--                     time it was admitted (or a charge id, charged). An entry is forgotten
--                     `keep` ms after its slot or admission; the key expires `keep` after the
--                     TATs.
-- KEYS[3] pause HASH  while it exists (pause.lua), nobody is admitted and nothing booked:
--                     an attempt is told to wait until it expires (or its slot, if later);
--                     a charge goes through
-- ARGV[1] keep: milliseconds an admission or booking is remembered after its slot (0 .. MAX_MS)
-- ARGV[2] mode: 0 to only try, 1 to book the next free slot when refused, 2 to reserve it:
--         book the next free slot even if it is free now, admitting nobody (the caller takes
--         it later, at its slot, with an attempt under the same id: the admission counts then),
--         3 to charge: advance every window's TATs by cost units, admitting nobody and
--         checking nothing (a cost known after the fact delays later starts)
-- ARGV[3] horizon: book only a slot at most this many microseconds ahead (0 .. MAX_MS * 1000)
-- ARGV[4] permit id ('' for none: nothing is remembered, nothing booked), or charge id
-- ARGV[5] cost: units this start (or charge) takes (1 .. MAX_COUNT; at most every window's
--         burst unless charging, else it could never be admitted)
-- ARGV[6] windows: how many (1 .. 16), then per window ARGV[5 + 2w] its interval in
--         microseconds per unit and ARGV[6 + 2w] its burst in units, with interval x burst
--         and interval x cost at most MAX_MS * 1000
-- (Settings out of bounds get an error reply, and nothing is written.)
--
-- A window admits cost c at `now` if its TAT, advanced by c x interval, is at most burst x
-- interval ahead of `now`: at most burst + w x rate units in any w seconds. The windows are
-- checked together and advanced only if every one admits: a refusal consumes none.
--
-- Returns {admitted, wait, booked[, paused]}: admitted 1 (wait 0) or 0; wait the microseconds
--         until the caller may run (its booked slot, or later if late callers took the actual
--         slots, if booked is 1, and 0 for a reserved slot that is due; else the next free slot,
--         which others may take first). paused 1: refused because the name is paused. A
--         charge returns {1, 0, 0}.
--
-- Idempotent per permit id: an id admitted (or a charge id charged) within `keep` is admitted
-- again without using a slot; one that booked gets the time left until its slot. Booked
-- slots are served in the order they were booked: first to ask, first to run.
-- @common
local rate_key, line_key = KEYS[1], KEYS[2]
local keep, mode, horizon = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local id, cost, n = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local MAX_US = MAX_MS * 1000
local bad = not (keep and mode and horizon and cost and n) or keep < 0 or keep > MAX_MS
  or horizon < 0 or horizon > MAX_US or cost < 1 or cost > MAX_COUNT or n < 1 or n > 16
  or (mode ~= 0 and mode ~= 1 and mode ~= 2 and mode ~= 3)
local interval, burst, suffix = {}, {}, {}
for w = 1, bad and 0 or n do
  interval[w], burst[w] = tonumber(ARGV[5 + 2 * w]), tonumber(ARGV[6 + 2 * w])
  suffix[w] = w == 1 and '' or (':' .. w)
  local i, b = interval[w], burst[w]
  if not (i and b) or i < 1 or i > MAX_US or b < 1 or b > MAX_COUNT or i * b > MAX_US
      or i * cost > MAX_US or (mode ~= 3 and cost > b) then
    bad = true
  end
end
if bad then
  return redis.error_reply('ERR gcra.lua: a setting is out of bounds')
end
local _, now = server_now()
local fields = {}
for w = 1, n do
  fields[2 * w - 1], fields[2 * w] = 'tat' .. suffix[w], 'atat' .. suffix[w]
end
local got = redis.call('HMGET', rate_key, unpack(fields))
local tat, atat = {}, {}
for w = 1, n do
  tat[w] = math.max(tonumber(got[2 * w - 1] or 0) or 0, now)
  atat[w] = math.max(tonumber(got[2 * w] or 0) or 0, now)
end

-- The earliest time every window admits `cost` units, judged by the TATs `of` (tat or atat).
local function free_at(of)
  local at = now
  for w = 1, n do
    at = math.max(at, of[w] + (cost - burst[w]) * interval[w])
  end
  return at
end

-- Advance every window by the cost: the schedule's TATs from `from` (nil: not them), the
-- actual ones with `actual`; store them, push the TTLs, and remember `id` under `score`.
local function store(from, actual, score)
  local values, last = {}, now
  for w = 1, n do
    if from then
      tat[w] = math.max(tat[w], from) + cost * interval[w]
    end
    if actual then
      atat[w] = atat[w] + cost * interval[w]
    end
    local s = suffix[w]
    for _, v in ipairs({'tat' .. s, fmt(tat[w]), 'atat' .. s, fmt(atat[w]),
        'interval' .. s, fmt(interval[w]), 'burst' .. s, fmt(burst[w])}) do
      values[#values + 1] = v
    end
    last = math.max(last, tat[w], atat[w])
  end
  local ttl = math.ceil((last - now) / 1000)
  redis.call('HSET', rate_key, 'windows', fmt(n), unpack(values))
  redis.call('PEXPIRE', rate_key, fmt(ttl))
  if id ~= '' then
    redis.call('ZADD', line_key, fmt(score), id)
    redis.call('PEXPIRE', line_key, fmt(ttl + keep))
  end
end

if mode ~= 3 then
  local paused = redis.call('PTTL', KEYS[3])
  if paused > 0 then
    local free = math.max(free_at(tat), free_at(atat))
    return {0, math.max(paused * 1000, free - now), 0, 1}
  end
end

if id ~= '' then
  local horizon_ago = now - keep * 1000
  redis.call('ZREMRANGEBYSCORE', line_key, '(' .. fmt(-horizon_ago), '(0')
  redis.call('ZREMRANGEBYSCORE', line_key, '0', '(' .. fmt(horizon_ago))
  local slot = redis.call('ZSCORE', line_key, id)
  if slot then
    slot = tonumber(slot)
    if slot < 0 or mode == 3 then
      return {1, 0, 0} -- admitted (or charged) before: again, using no slot
    end
    local wait = math.max(slot, free_at(atat)) - now
    if wait > 0 or mode == 2 then
      return {0, math.max(wait, 0), 1}
    end
    store(nil, true, -now) -- the booking advanced the schedule already
    return {1, 0, 0}
  end
end

if mode == 3 then
  store(now, true, -now)
  return {1, 0, 0}
end
local wait = math.max(free_at(tat), free_at(atat)) - now
if wait <= 0 and mode ~= 2 then
  store(now, true, -now)
  return {1, 0, 0}
end
local slot = free_at(tat)
if not (mode >= 1 and id ~= '' and slot - now <= horizon) then
  return {0, wait, 0}
end
-- Book: the schedule moves on by the cost from the slot; the actual TATs only at admission.
store(slot, false, slot)
return {0, math.max(slot, free_at(atat)) - now, 1}
