-- dedupe: the de-duplication mark of one semaphore name: which task run is queued or running
-- for it. One call decides, so two concurrent senders never both get through.
--
-- KEYS[1] mark     HASH '<prefix>:{name}:dedupe': 'id' the task id the name is marked for,
--                  'run' the permit id of that run while it holds its permit (absent while
--                  it is queued or waits)
-- KEYS[2] holders  the semaphore's holders hash (same hash tag): a running mark is live only
--                  while holders[run] is a lease that has not ended (server time)
-- ARGV[1] 'take', 'claim', 'hold', 'keep' or 'clear'
-- ARGV[2] task id
-- ARGV[3] mark TTL in ms (all but clear), 1 <= ttl <= MAX_MS
-- ARGV[4] permit id (hold, keep)
--
-- take:  (a send) mark the name for the task if it is free, stale (its run's permit is gone)
--        or the task's own (then 'run' is dropped: queued again, as a retry is); returns the
--        task id. If another live task has it, its id is returned and the mark is left as it
--        is: a duplicate send never extends it, so a lost message frees the name after its
--        own TTL however often the task is sent meanwhile.
-- claim: (a message reaching a worker, a run starting) as take, but the task's own mark is
--        left as it is (a redelivered copy must not unpin a running run's mark).
-- hold:  mark the name for the task, running under the permit id (whoever had it); returns 1.
-- keep:  push the TTL of the task's mark, running under the permit id, to ttl; returns 1, or
--        0 if the mark is not (or no longer) that.
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

if op == 'keep' then
  if current == id and run == ARGV[4] then
    redis.call('PEXPIRE', mark, ttl)
    return 1
  end
  return 0
end

if op ~= 'take' and op ~= 'claim' then
  return redis.error_reply('ERR dedupe.lua: unknown operation ' .. tostring(op))
end
if current == id and op == 'claim' then
  return id
end
if current and current ~= id then
  local live = true
  if run then
    local entry = redis.call('HGET', holders, run)
    local expiry = entry and tonumber(string.match(entry, '^%d+:(%d+)$')) or 0
    live = expiry > server_now()
  end
  if live then
    return current
  end
end
redis.call('DEL', mark)
redis.call('HSET', mark, 'id', id)
redis.call('PEXPIRE', mark, ttl)
return id
