-- fair_acquire: grant a permit by fair share across groups, or take / keep a place in the
-- caller's group's line (see _fair.lua for the keys and the order).
--
-- KEYS[1] holders (on Redis Cluster also KEYS[2..4], as for acquire.lua; the fair keys are
--         derived from KEYS[1], in the same slot)
-- ARGV[1] acquire.lua's ARGV[1] ('<limit>:<lease>:<waiter lease>:<idle ttl>:<join>:<back in>
--         [:1]|<permit id>'); back in (ms): the caller is away until then, and its place
--         holds no free permit for it meanwhile (see fwd in _fair.lua)
-- ARGV[2] '<weight>:<group limit>|<group>': 0 < weight <= MAX_WEIGHT, group limit 0 = none
-- ARGV[3] (optional) a Pub/Sub channel: a caller that gets no permit and is away (back in)
--         is offered one when its turn comes, and told on this channel (see fwn in _fair.lua)
--
-- Returns as acquire.lua: status '<token>:<lease expiry ms>' if granted (or already held:
-- same token, lease renewed, ':renewed' appended if ':1' asked), else {position, waiter
-- expiry ms} (position: 1 + groups served before the caller's group + waiters ahead in it
-- times the groups waiting / its weight: about how many grants come first; 0 if not in line),
-- or {0, 0, pause ms} while the name is paused (holders still renew).
--
-- Granted when a permit is free, the caller's group holds fewer than the group limit, no
-- present waiter of its group comes before it (waiters away on their back in do not count),
-- and fewer groups with present heads come before its group than permits are free. Idempotent per permit id. One call, server clock.
-- @common
-- @fair
local COUNTERS = 7 -- counter fields in the holders hash (see _common.lua)
local holders = KEYS[1]
local limit, lease, waiter_lease, idle_ttl, join, back_in, mark =
  string.match(ARGV[1], '^(%d+):(%d+):(%d+):(%d+):(%d):(%d+):?(%d?)|')
local id = string.match(ARGV[1], '^[^|]*|(.*)$')
local weight, group_limit, group = string.match(ARGV[2] or '', '^([^:]+):(%d+)|(.+)$')
limit, lease, waiter_lease = tonumber(limit), tonumber(lease), tonumber(waiter_lease)
idle_ttl, back_in = tonumber(idle_ttl), tonumber(back_in)
weight, group_limit = tonumber(weight), tonumber(group_limit)
local notify = ARGV[3]
if notify == '' or (notify and #notify > 512) then
  return redis.error_reply('ERR fair_acquire.lua: the channel to notify is empty or too long')
end
if not (back_in and weight and id and limit >= 1 and limit <= MAX_COUNT and lease <= MAX_MS
    and waiter_lease <= MAX_MS and idle_ttl <= MAX_MS and back_in <= MAX_MS and weight > 0 and weight <= MAX_WEIGHT
    and group_limit <= MAX_COUNT) then
  return redis.error_reply('ERR fair_acquire.lua: settings out of bounds or malformed: '
    .. ARGV[1] .. ' ' .. tostring(ARGV[2]))
end
local now, now_us = server_now()
local h = helpers()
local f = fair_helpers(holders, now, h)
local expires = now + lease
local half_idle = math.floor(idle_ttl / 2)
local got = redis.call('HMGET', holders, id, ':fence', ':next', ':horizon')
local mine, fresh = got[1], not got[2]
local fence, next_expiry, horizon = tonumber(got[2] or 0), tonumber(got[3] or 0), tonumber(got[4] or 0)

-- Write the holders hash's counters with `field`, and push its TTL past `keep_until`.
local function save(field, value, keep_until)
  local fields = {':fence', fence, ':limit', limit, ':next', next_expiry, ':gate', 0, field, value}
  if fresh then -- a new hash gets all seven counters (acquire.lua counts holders by HLEN)
    fields[#fields + 1], fields[#fields + 2] = ':ticket', 0
    fields[#fields + 1], fields[#fields + 2] = ':queued', 0
  end
  local push = fresh or horizon < keep_until + half_idle
  if push then
    horizon = keep_until + idle_ttl
    fields[#fields + 1], fields[#fields + 2] = ':horizon', horizon
  end
  redis.call('HSET', holders, unpack(fields))
  if push then
    redis.call('PEXPIREAT', holders, horizon)
  end
end

local owner = redis.call('HGET', f.fair, id)
if mine then
  local entry
  entry, next_expiry = h.renew(mine, now, expires, next_expiry)
  if not entry then
    redis.call('HDEL', holders, id) -- expired: the caller is a newcomer
  else
    save(id, entry, expires)
    f.keep(f.fair, expires + idle_ttl)
    f.keep(f.fh, expires + idle_ttl)
    return {ok = mark == '1' and entry .. ':renewed' or entry}
  end
end
local paused = redis.call('PTTL', string.sub(holders, 1, #holders - 7) .. 'pause')
if paused > 0 then
  return {0, 0, paused}
end
if owner and owner ~= group then -- it held or waited in another group: that is over
  f.leave(owner, id)
  redis.call('ZREM', f.fh, f.grant(owner, id))
  redis.call('HDEL', f.fair, id)
end

local held = fresh and 0 or redis.call('HLEN', holders) - COUNTERS
if held >= limit and (next_expiry == 0 or next_expiry <= now) then
  held, next_expiry = h.sweep_holders(holders, now)
end
local free = limit - held
local vt = tonumber(redis.call('HGET', f.fair, ':vt') or 0)
local line = f.key('fw', group)
local in_line = redis.call('ZSCORE', line, id)
if in_line and tonumber(redis.call('ZSCORE', f.key('fwx', group), id) or 0) <= now then
  f.leave(group, id) -- its place lapsed: it comes back as a newcomer
  in_line = nil
end
local group_held = 0
if group_limit > 0 then
  group_held = f.held(group)
elseif redis.call('ZCARD', f.fh) > limit then
  f.held(nil) -- more entries than can be live: clear the ended ones
end
local capped = group_limit > 0 and group_held >= group_limit
f.park(group, capped, vt)
local head = f.head(group) -- (clears dead heads; an emptied group leaves the queues)
local tag = redis.call('ZSCORE', f.fq, group) or redis.call('ZSCORE', f.fcap, group)
local queued = tag ~= false
if not queued then -- the group starts waiting now: no earlier than the virtual time
  tag = math.max(vt, tonumber(redis.call('HGET', f.key('fg', group), 'f') or 0))
end
tag = tonumber(tag)

-- May the caller have a permit now?
local eligible = false
if free > 0 and not capped then
  local first = in_line and head == id -- (then no one of its group comes before it)
  local other, other_ticket
  if not first then
    other, other_ticket = f.present(group, id)
  end
  if first or not other or (in_line and other_ticket > tonumber(in_line)) then
    local ahead, i, reached = 0, 0, false
    while ahead < free and f.budget > 0 and i < f.LOOK do
      local row = redis.call('ZRANGE', f.fq, i, i, 'WITHSCORES')
      if not row[1] or row[1] == group or (not queued and tonumber(row[2]) > tag) then
        reached = true
        break
      end
      if f.present(row[1]) then
        ahead, i = ahead + 1, i + 1
      elseif f.head(row[1]) then
        i = i + 1 -- every waiter of it is away: it holds no free permit
      elseif f.budget > 0 then
        redis.call('ZREM', f.fq, row[1]) -- its line is empty
      end
    end
    eligible = reached and ahead < free
  end
end

if eligible then
  if in_line then
    redis.call('ZREM', line, id)
    redis.call('ZREM', f.key('fwx', group), id)
    redis.call('ZREM', f.key('fwd', group), id)
    redis.call('HDEL', f.key('fwn', group), id)
  end
  local gk = f.key('fg', group)
  local served = tonumber(redis.call('HGET', gk, 'n') or 0) + 1
  local finish = tag + 1 / weight
  vt = math.max(vt, tag)
  fence = math.max(fence + 1, now_us)
  redis.call('HSET', gk, 'f', f.tag(finish), 'w', f.tag(weight), 'n', served)
  redis.call('HSET', f.fair, ':vt', f.tag(vt), ':glimit', group_limit, id, group)
  redis.call('ZADD', f.fh, 0, f.grant(group, id))
  redis.call('ZREM', f.fq, group)
  redis.call('ZREM', f.fcap, group)
  if f.head(group) then -- still waiting: its next head starts where this grant finishes
    local full = group_limit > 0 and group_held + 1 >= group_limit
    redis.call('ZADD', full and f.fcap or f.fq, f.tag(finish), group)
  end
  next_expiry = next_expiry == 0 and expires or math.min(next_expiry, expires)
  local entry = string.format('%d:%d', fence, expires)
  save(id, entry, expires)
  local keep = expires + idle_ttl
  for _, key in ipairs({f.fair, gk, f.fh, f.fq, f.fcap}) do
    f.keep(key, keep)
  end
  f.wake(free - 1)
  return {ok = entry}
end

if join ~= '1' then
  return {0, 0}
end
if not in_line then
  local ticket = redis.call('HINCRBY', f.fair, ':ticket', 1)
  redis.call('ZADD', line, ticket, id)
  if not queued then
    redis.call('ZADD', capped and f.fcap or f.fq, f.tag(tag), group)
  end
end
local waiter_until = now + waiter_lease
local keep = waiter_until + idle_ttl
local gk = f.key('fg', group)
redis.call('ZADD', f.key('fwx', group), waiter_until, id)
redis.call('ZADD', f.key('fwd', group), now + back_in, id)
redis.call('HSET', f.fair, id, group, ':glimit', group_limit)
redis.call('HSET', gk, 'w', f.tag(weight))
local told = f.key('fwn', group)
if notify and back_in > 0 then
  redis.call('HSET', told, id, notify)
else
  redis.call('HDEL', told, id)
end
for _, key in ipairs({line, f.key('fwx', group), f.key('fwd', group), told, f.fair, gk, f.fq,
    f.fcap}) do
  f.keep(key, keep)
end
save(':limit', limit, waiter_until + half_idle)
-- Served about one round of the waiting groups per place ahead in its own line (a round
-- serves a group of weight w about w times).
local groups = redis.call('ZCARD', f.fq)
local position = math.floor(redis.call('ZRANK', line, id) * math.max(1, groups) / weight) + 1
position = position + (redis.call('ZRANK', f.fq, group) or groups)
return {position, waiter_until}
