-- Fair-share helpers: put into the fair scripts after _common.lua (scripts.py), never run alone.
--
-- Keys of a grouped semaphore, besides the holders hash (all '<prefix>:{name}:...', one slot):
--   fair        HASH  ':vt' virtual time (start tag of the latest grant), ':ticket' last ticket,
--                     ':glimit' the group limit the last caller asked for (0: none), and
--                     permit id -> group for every holder and waiter
--   fq          ZSET  group -> start tag of its head, for groups with waiters below their limit
--   fcap        ZSET  group -> start tag of its head, for groups with waiters at their limit
--   fw:<group>  ZSET  permit id -> ticket (FIFO line of the group)
--   fwx:<group> ZSET  permit id -> waiter lease expiry (ms)
--   fwd:<group> ZSET  permit id -> when the waiter said it would be back (ms): until then it is
--                     away (a Celery task parked or on a countdown) and its place holds no
--                     free permit for it; the first *present* waiter of a group is its
--                     candidate, and groups with no present waiter are passed over
--   fwn:<group> HASH  permit id -> Pub/Sub channel, for away waiters that asked to be told
--                     when their turn comes (Celery admission: a worker's channel). When a
--                     release reaches such a waiter, it is *offered* the permit: its place is
--                     made present (it holds the permit for it) for at most OFFER_MS, and
--                     its permit id is published on its channel
--   fg:<group>  HASH  'f' finish tag of its last grant, 'w' weight, 'n' grants served
--   fh          ZSET  '<group>\0<permit id>' (score 0, in lexical order) for every grant of a
--                     group, checked against the holders hash and `fair` before it is counted:
--                     a lease that ended is not counted. refresh.lua keeps `fair` and `fh` as
--                     long as the holders hash, so a long-held grant keeps its group.
-- A grant goes to the head of the group with the smallest start tag (start-time fair
-- queueing): the grant's start S is the group's tag, its finish S + 1 / weight becomes the
-- group's next tag; a group that starts waiting gets max(virtual time, its last finish), so it
-- is served at once and an idle group banks no credit. Every key gets an idle TTL past the
-- last lease or waiter lease in it. Dead heads (waiter lease ended) are removed when met.
local MAX_WEIGHT = 1000000

local function fair_helpers(holders, now, h)
  local f = {}
  local base = string.sub(holders, 1, #holders - 7)
  f.fair, f.fq, f.fcap, f.fh = base .. 'fair', base .. 'fq', base .. 'fcap', base .. 'fh'
  f.budget = 100 -- dead places and empty groups one call clears at most
  f.LOOK = 200 -- groups one call looks at, at most, for a present head
  f.OFFER_MS = 2000 -- how long an offered place holds its permit if its waiter does not come

  function f.key(kind, group)
    return base .. kind .. ':' .. group
  end

  function f.tag(str)
    return string.format('%.17g', str)
  end

  -- Take `id` out of `group`'s line; drop the group from the queues once its line is empty.
  -- Returns true if it had a place.
  function f.leave(group, id)
    if redis.call('ZREM', f.key('fw', group), id) == 0 then
      return false
    end
    redis.call('ZREM', f.key('fwx', group), id)
    redis.call('ZREM', f.key('fwd', group), id)
    redis.call('HDEL', f.key('fwn', group), id)
    redis.call('DEL', h.wake_key(holders, id))
    if redis.call('HGET', f.fair, id) == group then
      redis.call('HDEL', f.fair, id)
    end
    if redis.call('ZCARD', f.key('fw', group)) == 0 then
      redis.call('ZREM', f.fq, group)
      redis.call('ZREM', f.fcap, group)
    end
    return true
  end

  -- The first waiter of `group` whose waiter lease has not ended (removing dead ones, within
  -- the budget), with its lease end; nil if none (or the budget ran out).
  function f.head(group)
    local line, lexp = f.key('fw', group), f.key('fwx', group)
    while f.budget > 0 do
      local first = redis.call('ZRANGE', line, 0, 0)[1]
      if not first then
        return nil
      end
      local until_ms = tonumber(redis.call('ZSCORE', lexp, first) or 0)
      if until_ms > now then
        return first, until_ms
      end
      f.budget = f.budget - 1
      f.leave(group, first)
    end
    return nil
  end

  -- The member of fh for a grant of `group` to `id`.
  function f.grant(group, id)
    return group .. '\0' .. id
  end

  -- Live holders of `group` (nil: of every group): entries of fh whose permit id is held, not
  -- expired, and still of that group (the others are removed).
  function f.held(group)
    local rows
    if group then
      rows = redis.call('ZRANGEBYLEX', f.fh, '[' .. group .. '\0', '(' .. group .. '\1')
    else
      rows = redis.call('ZRANGE', f.fh, 0, -1)
    end
    if #rows == 0 then
      return 0
    end
    local ids, groups = {}, {}
    for i, row in ipairs(rows) do
      groups[i], ids[i] = string.match(row, '^(.-)%z(.*)$')
    end
    local entries = redis.call('HMGET', holders, unpack(ids))
    local owners = redis.call('HMGET', f.fair, unpack(ids))
    local live, dead = 0, {}
    for i, id in ipairs(ids) do
      local _, expiry = 0, 0
      if entries[i] then
        _, expiry = h.parse(entries[i])
      end
      if expiry > now and owners[i] == groups[i] then
        live = live + 1
      else
        dead[#dead + 1] = rows[i]
        if owners[i] == groups[i] and not redis.call('ZSCORE', f.key('fw', groups[i]), id) then
          redis.call('HDEL', f.fair, id)
        end
      end
    end
    if #dead > 0 then
      redis.call('ZREM', f.fh, unpack(dead))
    end
    return live
  end

  -- Move `group` between fq (may be served) and fcap (at its limit); a group coming back
  -- from fcap starts no earlier than the virtual time `vt`.
  function f.park(group, capped, vt)
    if capped then
      local tag = redis.call('ZSCORE', f.fq, group)
      if tag then
        redis.call('ZREM', f.fq, group)
        redis.call('ZADD', f.fcap, tag, group)
      end
    else
      local tag = redis.call('ZSCORE', f.fcap, group)
      if tag then
        redis.call('ZREM', f.fcap, group)
        redis.call('ZADD', f.fq, f.tag(math.max(tonumber(tag), vt)), group)
      end
    end
  end

  -- The first present waiter of `group` (back: its due time has come; live waiter lease),
  -- other than `skip`, with its ticket and lease end; nil if none. Most places of a deep line
  -- are away, so the present ones are found by due time (at most 100 looked at).
  function f.present(group, skip)
    local first, until_ms = f.head(group)
    if not first then
      return nil
    end
    local line, ldue = f.key('fw', group), f.key('fwd', group)
    if first ~= skip and tonumber(redis.call('ZSCORE', ldue, first) or 0) <= now then
      return first, tonumber(redis.call('ZSCORE', line, first)), until_ms
    end
    local ids = redis.call('ZRANGEBYSCORE', ldue, '-inf', now, 'LIMIT', 0, 100)
    if #ids == 0 then
      return nil
    end
    local tickets = redis.call('ZMSCORE', line, unpack(ids))
    local leases = redis.call('ZMSCORE', f.key('fwx', group), unpack(ids))
    local best, best_ticket, best_until
    for i, id in ipairs(ids) do
      local ticket, lease_end = tonumber(tickets[i] or 0), tonumber(leases[i] or 0)
      if ticket > 0 and lease_end > now and id ~= skip and (not best or ticket < best_ticket) then
        best, best_ticket, best_until = id, ticket, lease_end
      end
    end
    return best, best_ticket, best_until
  end

  -- Tell waiter `id` of `group` (waiter lease until `until_ms`) that a permit is free for
  -- it: a present one by its wake-up list; an away one that gave a channel by an offer (see
  -- fwn above). False if it can be told neither way (away, no channel).
  function f.call(group, id, until_ms)
    local due = f.key('fwd', group)
    if tonumber(redis.call('ZSCORE', due, id) or 0) > now then
      local channel = redis.call('HGET', f.key('fwn', group), id)
      if not channel then
        return false
      end
      redis.call('ZADD', due, now, id)
      if until_ms > now + f.OFFER_MS then
        redis.call('ZADD', f.key('fwx', group), now + f.OFFER_MS, id)
      end
      redis.pcall('PUBLISH', channel, id) -- (refused, it must not stop the script half-way)
      return true
    end
    local key = h.wake_key(holders, id)
    redis.call('LPUSH', key, '1')
    redis.call('LTRIM', key, 0, 0)
    redis.call('PEXPIRE', key, until_ms - now)
    return true
  end

  -- Call (f.call) the head of each of the first `free` groups of fq that can be told, in
  -- fair order; a group whose head is away without a channel has its first present waiter
  -- called, and is passed over if it has none. Permits still free after a round over the
  -- groups go to the next waiters of the groups called, a round at a time (no group limit).
  function f.wake(free)
    local called, round = {}, 0
    while free > 0 do
      local i, looked, any = 0, 0, false
      while free > 0 and f.budget > 0 and looked < f.LOOK do
        local group = redis.call('ZRANGE', f.fq, i, i)[1]
        if not group then
          break
        end
        looked, i = looked + 1, i + 1
        local id, until_ms
        if round == 0 then
          id, until_ms = f.head(group)
          if not id then
            if f.budget > 0 then -- empty: its line is gone
              redis.call('ZREM', f.fq, group)
              redis.call('ZREM', f.fcap, group)
              i = i - 1
            end
          elseif not f.call(group, id, until_ms) then
            local present, _, present_until = f.present(group)
            id = present and f.call(group, present, present_until) and present
          end
          called[group] = id and 1 or nil
        elseif called[group] then
          id = redis.call('ZRANGE', f.key('fw', group), round, round)[1]
          until_ms = id and tonumber(redis.call('ZSCORE', f.key('fwx', group), id) or 0)
          if not (id and until_ms > now and f.call(group, id, until_ms)) then
            id, called[group] = nil, nil
          end
        end
        if id then
          free, any = free - 1, true
        end
      end
      if not any or tonumber(redis.call('HGET', f.fair, ':glimit') or 0) > 0 then
        return
      end
      round = round + 1
    end
  end

  -- Let `key` live until `at` (ms) or later, if it exists.
  function f.keep(key, at)
    if redis.call('PEXPIREAT', key, at, 'GT') == 0 and redis.call('PTTL', key) == -1 then
      redis.call('PEXPIREAT', key, at)
    end
  end

  return f
end
