-- fair_release: give a permit of a grouped semaphore back, or leave its group's line, and wake
-- the heads of the groups a permit is now free for. Idempotent and owner-checked.
--
-- KEYS[1] holders (on Redis Cluster also KEYS[2..4], as for release.lua)
-- ARGV[1] '<token>:<permit id>' as for release.lua (no token: whatever the id holds)
--
-- Returns as release.lua: 1 a grant released, 2 a place in line given up, 0 neither.
-- @common
-- @fair
local holders = KEYS[1]
local token, id = string.match(ARGV[1], '^(%d*:)(.*)$')
local any = token == ':' -- no token: whatever grant the id holds
local base = string.sub(holders, 1, #holders - 7)
local group = redis.call('HGET', base .. 'fair', id)
local mine = redis.call('HGET', holders, id)
local result = 0
if mine and (any or string.sub(mine, 1, #token) == token) then
  redis.call('HDEL', holders, id)
  result = 1
end
if not group then -- no place in a group's line, and no group's bookkeeping to update
  return result
end
local now = server_now()
local h = helpers()
local f = fair_helpers(holders, now, h)
if result == 1 then
  redis.call('ZREM', f.fh, f.grant(group, id))
  redis.call('HDEL', f.fair, id)
elseif not mine and any and f.leave(group, id) then
  result = 2
end
if result == 0 then
  return 0
end
local limit, next_expiry = unpack(redis.call('HMGET', holders, ':limit', ':next'))
limit = tonumber(limit or 1)
local held = redis.call('HLEN', holders)
held = held > 0 and held - 7 or 0 -- (7 counters; no hash: none held)
if held >= limit and tonumber(next_expiry or 0) <= now then
  held = h.sweep_holders(holders, now)
end
local vt = tonumber(redis.call('HGET', f.fair, ':vt') or 0)
local group_limit = tonumber(redis.call('HGET', f.fair, ':glimit') or 0)
if group_limit > 0 and redis.call('ZSCORE', f.fcap, group) then
  f.park(group, f.held(group) >= group_limit, vt)
end
f.wake(limit - held)
return result
