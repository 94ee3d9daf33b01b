-- fair_state: the groups of a grouped semaphore, for inspection. Read-only.
--
-- KEYS[1] holders (on Redis Cluster also KEYS[2..4], as for state.lua)
-- Returns {virtual time, {group, live holders, live waiters, weight or '', grants served,
--          start tag of its head or '', 1 if at its group limit else 0, ...}}, groups by tag
--          (waiting ones first), then those that only hold.
-- @common
-- @fair
local holders = KEYS[1]
local now = server_now()
local h = helpers()
local f = fair_helpers(holders, now, h)
local groups, order = {}, {}
local function add(group, tag, capped)
  if not groups[group] then
    groups[group] = {group, 0, 0, '', 0, tag or '', capped}
    order[#order + 1] = group
  end
  return groups[group]
end
for _, queue in ipairs({{f.fq, 0}, {f.fcap, 1}}) do
  local rows = redis.call('ZRANGE', queue[1], 0, -1, 'WITHSCORES')
  for i = 1, #rows, 2 do
    add(rows[i], rows[i + 1], queue[2])
  end
end
local all = redis.call('HGETALL', holders)
for i = 1, #all, 2 do
  if string.sub(all[i], 1, 1) ~= ':' then
    local _, expiry = h.parse(all[i + 1])
    local group = expiry > now and redis.call('HGET', f.fair, all[i])
    if group then
      local row = add(group, nil, 0)
      row[2] = row[2] + 1
    end
  end
end
for _, group in ipairs(order) do
  local row = groups[group]
  row[3] = redis.call('ZCOUNT', f.key('fwx', group), '(' .. now, '+inf')
  local weight, served = unpack(redis.call('HMGET', f.key('fg', group), 'w', 'n'))
  row[4], row[5] = weight or '', tonumber(served or 0)
end
local out = {}
for i, group in ipairs(order) do
  out[i] = groups[group]
end
return {redis.call('HGET', f.fair, ':vt') or '0', out}
