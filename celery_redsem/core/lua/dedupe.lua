-- dedupe: the de-duplication mark of one semaphore name: which task run is queued or running
-- for it. One call decides, so two concurrent senders never both get through.
--
-- KEYS[1] mark     HASH '<prefix>:{name}:dedupe': 'id' the task id the name is marked for,
--                  'run' the permit id of that run while it holds its permit (absent while
--                  it is queued or waits)
-- KEYS[2] holders  the semaphore's holders hash (same hash tag): a running mark is live only
--                  while holders[run] is a lease that has not ended (server time)
-- ARGV[1] 'take', 'hold' or 'clear'
-- ARGV[2] task id
-- ARGV[3] mark TTL in ms (take, hold), 1 <= ttl <= MAX_MS
-- ARGV[4] permit id (hold)
--
-- take:  mark the name for the task if it is free, stale (its run's permit is gone) or the
--        task's own (then 'run' is dropped: queued again); returns the task id. If another
--        live task has it: its TTL is pushed to ttl if shorter, and its id is returned.
-- hold:  mark the name for the task, running under the permit id (whoever had it); returns 1.
-- clear: delete the mark if it is the task's; returns 1 if it was, else 0.
local mark, holders, op, id = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local got = redis.call('HMGET', mark, 'id', 'run')
local current, run = got[1], got[2]

if op == 'clear' then
  if current == id then
    redis.call('DEL', mark)
    return 1
  end
  return 0
end

local ttl = tonumber(ARGV[3])
if not (ttl and ttl >= 1 and ttl <= MAX_MS) then
  return redis.error_reply('ERR dedupe.lua: ttl out of bounds or malformed: ' .. tostring(ARGV[3]))
end

if op == 'hold' then
  redis.call('DEL', mark)
  redis.call('HSET', mark, 'id', id, 'run', ARGV[4])
  redis.call('PEXPIRE', mark, ttl)
  return 1
end

if op ~= 'take' then
  return redis.error_reply('ERR dedupe.lua: unknown operation ' .. tostring(op))
end
if current and current ~= id then
  local live = true
  if run then
    local entry = redis.call('HGET', holders, run)
    local expiry = entry and tonumber(string.match(entry, '^%d+:(%d+)$')) or 0
    live = expiry > server_now()
  end
  if live then
    if redis.call('PTTL', mark) < ttl then
      redis.call('PEXPIRE', mark, ttl)
    end
    return current
  end
end
redis.call('DEL', mark)
redis.call('HSET', mark, 'id', id)
redis.call('PEXPIRE', mark, ttl)
return id
