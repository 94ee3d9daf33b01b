-- Shared helpers: put into every script by scripts.py (at its '-- @common' line, else on top),
-- never run alone.
--
-- Keys of one semaphore. All share the hash tag {name}, so they live in one cluster slot.
-- On one server scripts declare only the holders key (KEYS[1]); the others are derived from it
-- here, in the same slot: fewer arguments shorten the acquire/release round trip, which runs on
-- every task start and end. On Redis Cluster they declare the line's three keys too (KEYS[2..4])
-- so that Redis redirects a call while the slot migrates. Wake-up lists are never declared.
--   holders  HASH  permit id -> '<fencing token>:<lease expiry ms>', and seven counters:
--                          ':fence'   last fencing token granted
--                          ':limit'   limit the last caller asked for (for inspection and wake-ups)
--                          ':ticket'  last ticket handed to a waiter
--                          ':queued'  waiters in line (healed from the zset when in doubt)
--                          ':next'    no holder's lease ends before this (ms); 0 = unknown
--                          ':horizon' when the hash expires (ms)
--                          ':gate'    acquire's fast path is open for leases ending by
--                                     then (ms); 0 = closed: someone waits, or ':next' is
--                                     unknown. Never later than ':horizon'.
--   waiters  ZSET  permit id -> ticket (FIFO order)
--   wexp     ZSET  permit id -> waiter lease expiry (ms)
--   wdue     ZSET  permit id -> when the waiter said it would be back (ms). A place in line
--                  holds a free permit for its waiter only from then on: a Celery task that
--                  retries on a countdown is away until its countdown ends, and a permit it
--                  cannot use meanwhile goes to whoever is present, in line order.
--   <prefix>:{name}:wake:<permit id>  LIST  wake-up signal for a blocked waiter
-- Times come from the server's clock only (TIME); client clocks never matter.
-- Every key expires: the line's keys an idle TTL after the last place in them, the holders hash
-- half an idle TTL to one after its longest lease and one to one and a half after the last
-- place in line (it outlives the line): idle semaphores vanish.
-- The hot paths run on every task start and end, so they are kept to a few calls: expired
-- holders are swept only when the semaphore is full and ':next' says one may have expired,
-- and the TTL is pushed only when ':horizon' comes within half an idle TTL.

-- The largest settings a script takes: a year of milliseconds (validation.py's MAX_SECONDS)
-- and a billion permits (MAX_COUNT). Python refuses larger ones; the scripts refuse them too,
-- before they write anything: sums beyond what the server's clock arithmetic holds exactly
-- would fail a call half way (PEXPIREAT out of range) and leave a hash with no TTL behind.
local MAX_MS, MAX_COUNT = 31536000000, 1000000000

-- Server time as (milliseconds, microseconds).
local function server_now()
  local t = redis.call('TIME')
  local sec, usec = tonumber(t[1]), tonumber(t[2])
  return sec * 1000 + math.floor(usec / 1000), sec * 1000000 + usec
end

local function fmt(n)
  return string.format('%.0f', n)
end

-- The helpers below are needed off the fast paths only. Creating a closure costs the server
-- time on every call, so they are built on demand: `local h = helpers()`.
local function helpers()
  local h = {}
  local SWEEP_BATCH, SWEEP_ROUNDS = 1000, 10
  local SWEEP_MOST = SWEEP_ROUNDS * SWEEP_BATCH -- places one sweep looks at, at most

  -- A holder entry '<token>:<expiry>' as two numbers; one that is not (written by hand, or by
  -- a version whose scripts could store an overflowed expiry) counts as expired: (0, 0).
  function h.parse(entry)
    local token, expiry = string.match(entry, '^(%d+):(%d+)$')
    if not expiry then
      return 0, 0
    end
    return tonumber(token), tonumber(expiry)
  end

  -- A grant `mine` ('<token>:<expiry>') renewed to end at `expires`: its new entry (nil if
  -- it expired by `now`), and `next_expiry` (':next') kept a lower bound.
  function h.renew(mine, now, expires, next_expiry)
    local token, expiry = h.parse(mine)
    if expiry <= now then
      return nil, next_expiry
    end
    if expires < next_expiry then -- a shorter lease than before: keep ':next' a lower bound
      next_expiry = expires
    end
    return string.format('%d:%d', token, expires), next_expiry
  end

  -- Sibling keys of `holders` ('<prefix>:{name}:holders'): waiters, waiter expiries, due times.
  -- Declared as KEYS[2..4] on Redis Cluster (so that Redis redirects a call while the slot
  -- migrates), else derived from the name.
  function h.sibling_keys(holders)
    if KEYS[4] then
      return KEYS[2], KEYS[3], KEYS[4]
    end
    local base = string.sub(holders, 1, #holders - 7)
    return base .. 'waiters', base .. 'wexp', base .. 'wdue'
  end

  -- How many of the first `n` waiters (ranks 0..n-1; `mine` is the ticket at rank n, if any)
  -- are due (back, or late) at `now`; counting stops at `cap`. It walks whichever is shorter:
  -- the waiters ahead, or the due waiters. In Celery most waiters are away on a countdown.
  function h.due_ahead(waiters, wdue, n, queued, mine, now, cap)
    if n <= 0 or cap <= 0 then
      return 0
    end
    local line = redis.call('ZCARD', waiters)
    if redis.call('ZCARD', wdue) < line then -- someone in line has no due time
      h.date_undated(waiters, wdue, line, now)
    end
    local due = redis.call('ZCOUNT', wdue, '-inf', now)
    if due == 0 or n >= queued then
      return math.min(due, cap)
    end
    local count = 0
    local function tally(scores, ok)
      for _, score in ipairs(scores) do
        if score and ok(tonumber(score)) then
          count = count + 1
          if count >= cap then
            return true
          end
        end
      end
      return false
    end
    if due < n then -- walk the due waiters, count those with an earlier ticket
      for start = 0, due - 1, 100 do
        local ids = redis.call('ZRANGEBYSCORE', wdue, '-inf', now, 'LIMIT', start, 100)
        if #ids == 0 or tally(redis.call('ZMSCORE', waiters, unpack(ids)),
            function(ticket) return ticket < mine end) then
          break
        end
      end
      return count
    end
    for start = 0, n - 1, 100 do -- walk the waiters ahead, count the due ones
      local ids = redis.call('ZRANGE', waiters, start, math.min(start + 99, n - 1))
      if #ids == 0 or tally(redis.call('ZMSCORE', wdue, unpack(ids)),
          function(at) return at <= now end) then
        break
      end
    end
    return count
  end

  -- Places in line with no due time lost it with the key (evicted, deleted): date them `now`,
  -- so that they count as due (their waiters may be blocked on a wake-up now) until their
  -- waiters come back, and give the key the line's TTL. Walks the whole line of `line`
  -- places, once: after it every place has a due time again.
  function h.date_undated(waiters, wdue, line, now)
    local undated = h.missing_from(waiters, wdue, line)
    for i = 1, #undated, SWEEP_BATCH do
      local scored = {}
      for j = i, math.min(i + SWEEP_BATCH - 1, #undated) do
        scored[#scored + 1] = now
        scored[#scored + 1] = undated[j]
      end
      redis.call('ZADD', wdue, unpack(scored))
    end
    local ttl = redis.call('PTTL', waiters)
    if #undated > 0 and ttl > 0 then
      h.extend(wdue, now + ttl, false)
    end
  end

  -- The wake-up list of a waiter.
  function h.wake_key(holders, id)
    return string.sub(holders, 1, #holders - 7) .. 'wake:' .. id
  end

  -- Take `id` out of the line: its place, waiter lease, due time and wake-up list. Returns
  -- true if it had a place (else nothing else is touched).
  function h.leave_line(holders, waiters, wexp, wdue, id)
    if redis.call('ZREM', waiters, id) == 0 then
      return false
    end
    redis.call('ZREM', wexp, id)
    redis.call('ZREM', wdue, id)
    redis.call('DEL', h.wake_key(holders, id))
    return true
  end

  -- Remove holders whose lease ended. Returns (live holders, earliest live expiry or 0).
  function h.sweep_holders(holders, now)
    local all = redis.call('HGETALL', holders)
    local expired, held, earliest = {}, 0, 0
    for i = 1, #all, 2 do
      if string.sub(all[i], 1, 1) ~= ':' then
        local _, expiry = h.parse(all[i + 1])
        if expiry <= now then
          expired[#expired + 1] = all[i]
        else
          held = held + 1
          if earliest == 0 or expiry < earliest then
            earliest = expiry
          end
        end
      end
    end
    for i = 1, #expired, SWEEP_BATCH do
      redis.call('HDEL', holders, unpack(expired, i, math.min(i + SWEEP_BATCH - 1, #expired)))
    end
    return held, earliest
  end

  -- Members among the first `count` of the zset `from` that have no score in the zset `other`.
  function h.missing_from(from, other, count)
    local missing = {}
    for start = 0, count - 1, 100 do
      local ids = redis.call('ZRANGE', from, start, start + 99)
      if #ids == 0 then
        break
      end
      local scores = redis.call('ZMSCORE', other, unpack(ids))
      for i, id in ipairs(ids) do
        if not scores[i] then
          missing[#missing + 1] = id
        end
      end
    end
    return missing
  end

  -- Remove the members `ids` from the zsets `a` and `b`, SWEEP_BATCH at a time.
  function h.remove_from(a, b, ids)
    for i = 1, #ids, SWEEP_BATCH do
      local last = math.min(i + SWEEP_BATCH - 1, #ids)
      redis.call('ZREM', a, unpack(ids, i, last))
      redis.call('ZREM', b, unpack(ids, i, last))
    end
  end

  -- Remove waiters whose waiter lease ended, places with no waiter lease at all (their
  -- wexp entry was lost with the key: a DEL, an eviction), and due times and waiter leases
  -- of places that are no longer in line (lost with the waiters key): counted as due, they
  -- would keep permits from everyone else. Each kind at most SWEEP_ROUNDS batches a call,
  -- from the head of the line, so that a crowd of dead places cannot block the server long;
  -- the next calls take the rest. Returns the number still in line.
  function h.sweep_waiters(waiters, wexp, wdue, now)
    for _ = 1, SWEEP_ROUNDS do
      local left = redis.call('ZRANGEBYSCORE', wexp, '-inf', now, 'LIMIT', 0, SWEEP_BATCH)
      if #left > 0 then
        redis.call('ZREM', wexp, unpack(left))
        redis.call('ZREM', waiters, unpack(left))
        redis.call('ZREM', wdue, unpack(left))
      end
      if #left < SWEEP_BATCH then
        break
      end
    end
    local queued = redis.call('ZCARD', waiters)
    if queued > redis.call('ZCARD', wexp) then -- places with no waiter lease
      local orphans = h.missing_from(waiters, wexp, math.min(queued, SWEEP_MOST))
      h.remove_from(waiters, wdue, orphans)
      queued = queued - #orphans
    end
    local dues = redis.call('ZCARD', wdue)
    if dues > queued then -- due times of places that are gone (lost with the waiters key)
      h.remove_from(wdue, wexp, h.missing_from(wdue, waiters, math.min(dues, SWEEP_MOST)))
    end
    return queued
  end

  -- Push a wake-up to the first `free` waiters that are due (a waiter away on a countdown
  -- cannot use one), so blocked acquirers retry at once. Looks at most 100 places deep.
  -- In a deep line most places are away (parked or on a countdown): then the due ones are
  -- found by due time, not by walking 100 places on every release.
  function h.wake(holders, waiters, wexp, wdue, free, now)
    if free <= 0 then
      return
    end
    local ids
    local line = redis.call('ZCARD', waiters)
    if line == 0 then
      return
    end
    local due_count = redis.call('ZCOUNT', wdue, '-inf', now)
    if redis.call('ZCARD', wdue) == line and due_count <= 100 then
      -- Every place has a due time: the due ones among the first 100, in line order.
      if due_count == 0 then
        return
      end
      local due_ids = redis.call('ZRANGEBYSCORE', wdue, '-inf', now)
      local tickets = redis.call('ZMSCORE', waiters, unpack(due_ids))
      local last = line > 100 and tonumber(redis.call('ZRANGE', waiters, 99, 99, 'WITHSCORES')[2])
      local found = {}
      for i, id in ipairs(due_ids) do
        local ticket = tonumber(tickets[i] or 0)
        if ticket == 0 then -- a due time left by a place now gone: the index is not whole
          found = nil
          break
        end
        if not last or ticket <= last then
          found[#found + 1] = {ticket, id}
        end
      end
      if found then
        table.sort(found, function(a, b) return a[1] < b[1] end)
        ids = {}
        for i = 1, #found do
          ids[i] = found[i][2]
        end
      end
    end
    if not ids then
      ids = redis.call('ZRANGE', waiters, 0, 99)
    end
    if #ids == 0 then
      return
    end
    local due = redis.call('ZMSCORE', wdue, unpack(ids))
    local until_ms = redis.call('ZMSCORE', wexp, unpack(ids))
    for i, id in ipairs(ids) do
      local lease_end = tonumber(until_ms[i] or 0)
      if tonumber(due[i] or now) <= now and lease_end > now then
        local key = h.wake_key(holders, id)
        redis.call('LPUSH', key, '1')
        redis.call('LTRIM', key, 0, 0)
        redis.call('PEXPIRE', key, lease_end - now)
        free = free - 1
        if free == 0 then
          return
        end
      end
    end
  end

  -- Let a zset live until `at` (ms) or later; `fresh`: this script just created it (no TTL
  -- yet). A key re-created by this script after it was lost (a DEL, an eviction) has no TTL
  -- either, which GT leaves alone: it gets one here.
  function h.extend(key, at, fresh)
    if fresh or (redis.call('PEXPIREAT', key, at, 'GT') == 0
        and redis.call('PTTL', key) == -1) then
      redis.call('PEXPIREAT', key, at)
    end
  end

  return h
end
