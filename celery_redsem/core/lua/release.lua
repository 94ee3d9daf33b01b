-- release: give a permit back, or leave the waiting line. Idempotent and owner-checked.
--
-- KEYS[1] holders (on Redis Cluster also KEYS[2..4]: waiters, wexp, wdue; see _common.lua)
-- ARGV[1] '<token>:<permit id>': the fencing token of the grant being released, or nothing
--         before the ':' to release whatever grant the id holds (used by the worker's main
--         process, which knows only the task id). One argument, not two: each costs the client
--         time on every task end.
--
-- Returns 1 if the grant was released (also one whose lease just ended but that no acquire has
-- swept yet), 2 if a place in line was given up (only without a token: a token names a grant,
-- and a place the same id took since is not its holder's to give up), 0 if there was neither
-- (already released or swept, or a different grant with the same id).
-- With nobody waiting this is two calls: HMGET, HDEL. The TTL is left alone: it may outlive the
-- remaining leases a little, never fall short of them.
local holders = KEYS[1]
local token, id = string.match(ARGV[1], '^(%d*:)(.*)$') -- the token keeps its ':'
local any = token == ':' -- no token: whatever grant the id holds

local got = redis.call('HMGET', holders, id, ':queued')
local mine, queued = got[1], got[2]
local result = 0
-- (A grant is '<token>:<expiry>': its token and ':' are the first #token bytes.)
if mine and (any or string.sub(mine, 1, #token) == token) then
  redis.call('HDEL', holders, id)
  result = 1
end
-- Done if nobody waits (':queued' compared as the server stored it), or nothing was given up.
if queued == '0' or (result == 0 and (mine or not any)) then
  return result
end
-- No ':queued' counter: the hash is gone (evicted, deleted), and a line may have outlived it.
local gone = queued == false

-- @common
-- Someone waits: leave the line if this id was in it, then wake whoever a permit is free for.
local h = helpers()
local waiters, wexp, wdue = h.sibling_keys(holders)
if not mine and h.leave_line(holders, waiters, wexp, wdue, id) then
  result = 2
end
if result > 0 then
  local now = server_now()
  local held, earliest = h.sweep_holders(holders, now)
  local left = h.sweep_waiters(waiters, wexp, wdue, now)
  if not gone then -- (a new hash is acquire's to make: it gives it its counters and TTL)
    redis.call('HSET', holders, ':queued', left, ':next', earliest, ':gate', 0) -- acquire reopens it
  end
  h.wake(holders, waiters, wexp, wdue, tonumber(redis.call('HGET', holders, ':limit') or 1) - held, now)
end
return result
