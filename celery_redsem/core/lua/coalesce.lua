-- coalesce: newest wins (dedupe='coalesce', debounce). Per semaphore name, at most one run
-- running and one pending behind it; a send while one is pending gives the pending run its
-- arguments instead of queueing another. One call decides, so two senders never both queue.
--
-- KEYS[1] record   HASH '<prefix>:{name}:dedupe' (the dedupe mark's key; one task's mode):
--                  'id'/'run'  the running run's task id and permit id (live while
--                              holders[run] is a lease that has not ended, server time)
--                  'p'         the pending run's task id; 'pc' '1' if it is a canvas step
--                  'pexp'      when the pending run counts as lost (ms; set when it becomes
--                              pending or defers itself, never by a send it absorbs)
--                  'args','ct','ce'  its newest arguments, serialized, content type, encoding
--                  'due','first'     debounce: it may start from 'due' (ms); its first send
--                  'a:<id>'          a message the pending run answers for
--                  'd:<id>'          a pending run whose place a canvas step took: its message
--                                    still comes, and must end absorbed whenever it does (kept
--                                    until the record expires)
--                  'ra','rt','re'    the arguments the running run took over (for a repeat)
--                  'r:<run>:<id>'    a message the running run <run> answers for
-- KEYS[2] holders  the semaphore's holders hash (same hash tag)
-- ARGV[1] 'send', 'receive', 'start', 'keep', 'finish' or 'state'
-- ARGV[2] task id
-- ARGV[3] TTL in ms (send, receive, start, keep), 1 <= ttl <= MAX_MS: how long a pending
--         run counts as live, and at least how long the record lives
-- send/receive/start: ARGV[4] arguments, ARGV[5] content type, ARGV[6] content encoding,
--         ARGV[7] debounce ms (0: none), ARGV[8] debounce_max ms (0: none), ARGV[9] '1' to
--         record the id as answered for (send: an explicit task id; receive/start: a canvas
--         step, never absorbed, since its canvas goes on from its own message)
-- start/keep: ARGV[10] / ARGV[4] the run's permit id
--
-- send:    (plain .delay) a live pending run absorbs it: {'absorbed', pending id, 0}; else
--          the task becomes the pending run: {'publish', id, debounce ms}.
-- receive: (a message reaching a worker) {'known', id} (the running or pending run, or one
--          absorbed already); no live pending run: it becomes it, {'pending', id}; a plain
--          message is absorbed, {'absorbed', p}; a canvas step takes over a plain pending
--          run, which it then answers for, {'took', old p}; behind a canvas step, a canvas
--          step waits its turn, {'queued', p}.
-- start:   (the run, holding its permit) {'run', args|false, ct, ce, answered ids...}: it
--          runs (args false: with its own); {'defer', ms}: not yet due; {'wait', ms}: another
--          run is running or pending; {'absorbed', p}: another run answers for it. Repeated
--          by the running run (a retry, a redelivery, a client's retry), the same 'run' reply.
-- keep:    push the record's TTL while the task runs under the permit; 1, or 0 if it is not.
-- finish:  the run ended: drop it as running or pending; returns the ids it answers for.
-- state:   {running id|false, running live 0/1, pending id|false, due in ms, answered count}.
local record, holders, op, id = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local now = server_now()
local f = redis.call('HMGET', record, 'id', 'run', 'p', 'pc', 'pexp', 'due', 'first')
local running, run, pending, pcanvas = f[1], f[2], f[3], f[4] == '1'
local pexp, due, first = tonumber(f[5] or 0), tonumber(f[6] or 0), tonumber(f[7] or 0)

local function running_live()
  if not (running and run) then
    return false
  end
  local entry = redis.call('HGET', holders, run)
  local expiry = entry and tonumber(string.match(entry, '^%d+:(%d+)$')) or 0
  return expiry > now
end

local function ids_with(prefix)
  local found, all = {}, redis.call('HGETALL', record)
  for i = 1, #all, 2 do
    local field = all[i]
    if string.sub(field, 1, #prefix) == prefix then
      found[#found + 1] = string.sub(field, #prefix + 1)
    end
  end
  return found
end

if op == 'state' then
  local live = running_live() and 1 or 0
  local answered = #ids_with('a:')
  return {running or false, live, (pexp > now) and pending or false, math.max(0, due - now), answered}
end

if op == 'finish' then
  local ids = ids_with('r:' .. id .. ':')
  for _, other in ipairs(ids) do
    redis.call('HDEL', record, 'r:' .. id .. ':' .. other)
  end
  if running == id then
    redis.call('HDEL', record, 'id', 'run', 'ra', 'rt', 're')
  end
  if pending == id then
    for _, other in ipairs(ids_with('a:')) do
      ids[#ids + 1] = other
      redis.call('HDEL', record, 'a:' .. other)
    end
    redis.call('HDEL', record, 'p', 'pc', 'pexp', 'args', 'ct', 'ce', 'due', 'first')
  end
  if redis.call('HLEN', record) == 0 then
    redis.call('DEL', record)
  end
  return ids
end

local ttl = tonumber(ARGV[3])
if not (ttl and ttl >= 1 and ttl <= MAX_MS) then
  return redis.error_reply('ERR coalesce.lua: ttl out of bounds or malformed: ' .. tostring(ARGV[3]))
end

local function live_at_least(ms)
  if redis.call('PTTL', record) < ms then
    redis.call('PEXPIRE', record, ms)
  end
end

if op == 'keep' then
  if running == id and run == ARGV[4] then
    live_at_least(ttl)
    return 1
  end
  return 0
end

local debounce, most = tonumber(ARGV[7]), tonumber(ARGV[8])
if not (debounce and most and debounce >= 0 and most >= 0 and debounce <= MAX_MS and most <= MAX_MS) then
  return redis.error_reply('ERR coalesce.lua: debounce out of bounds or malformed')
end
local flag = ARGV[9] == '1'

-- The newest arguments go to the pending run; with debounce it is due `debounce` from now,
-- but no later than `debounce_max` after its first send.
local function newest_arguments()
  redis.call('HSET', record, 'args', ARGV[4], 'ct', ARGV[5], 'ce', ARGV[6])
  if debounce > 0 then
    local at = now + debounce
    if most > 0 and first > 0 then
      at = math.min(at, first + most)
    end
    redis.call('HSET', record, 'due', at)
  end
end

local function become_pending(canvas)
  redis.call('HDEL', record, 'due', 'first')
  redis.call('HSET', record, 'p', id, 'pc', canvas and '1' or '0', 'pexp', now + ttl + debounce,
    'first', now)
  pending, pcanvas, pexp, first = id, canvas, now + ttl + debounce, now
  newest_arguments()
  live_at_least(ttl + debounce)
end

local pending_live = pending and pexp > now

if op == 'send' then
  if pending_live and pending ~= id then
    newest_arguments()
    if flag then
      redis.call('HSET', record, 'a:' .. id, 1)
    end
    return {'absorbed', pending, 0}
  end
  become_pending(false)
  return {'publish', id, debounce}
end

if op ~= 'receive' and op ~= 'start' then
  return redis.error_reply('ERR coalesce.lua: unknown operation ' .. tostring(op))
end

local function receive()
  if running == id or pending == id or redis.call('HGET', record, 'a:' .. id)
      or redis.call('HGET', record, 'd:' .. id) then
    return {'known', id}
  end
  if not pending_live then
    become_pending(flag)
    return {'pending', id}
  end
  if not flag then
    newest_arguments()
    redis.call('HSET', record, 'a:' .. id, 1)
    return {'absorbed', pending}
  end
  if pcanvas then
    return {'queued', pending}
  end
  local old = pending
  become_pending(true)
  redis.call('HSET', record, 'a:' .. old, 1, 'd:' .. old, 1)
  return {'took', old}
end

if op == 'receive' then
  return receive()
end

-- start: the run holds its permit.
local permit = ARGV[10]
if running == id then
  redis.call('HSET', record, 'run', permit)
  live_at_least(ttl)
  local took = redis.call('HMGET', record, 'ra', 'rt', 're')
  local reply = {'run', took[1] or false, took[2] or '', took[3] or ''}
  for _, other in ipairs(ids_with('r:' .. id .. ':')) do
    reply[#reply + 1] = other
  end
  return reply
end
if pending ~= id then
  local said = receive()
  if said[1] == 'absorbed' or (said[1] == 'known' and pending ~= id) then
    return {'absorbed', pending or running or said[2]}
  end
  if said[1] == 'queued' then
    return {'wait', math.min(1000, ttl)}
  end
end
if due > now then
  pexp = due + ttl
  redis.call('HSET', record, 'pexp', pexp)
  live_at_least(due - now + ttl)
  return {'defer', due - now}
end
if running_live() then
  return {'wait', math.min(1000, ttl)}
end
local got = redis.call('HMGET', record, 'args', 'ct', 'ce')
local reply = {'run', got[1] or false, got[2] or '', got[3] or ''}
for _, other in ipairs(ids_with('a:')) do
  redis.call('HDEL', record, 'a:' .. other)
  redis.call('HSET', record, 'r:' .. id .. ':' .. other, 1)
  reply[#reply + 1] = other
end
redis.call('HDEL', record, 'p', 'pc', 'pexp', 'args', 'ct', 'ce', 'due', 'first', 'ra', 'rt', 're')
redis.call('HSET', record, 'id', id, 'run', permit)
if got[1] then
  redis.call('HSET', record, 'ra', got[1], 'rt', got[2], 're', got[3])
end
live_at_least(ttl)
return reply
