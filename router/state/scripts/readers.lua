-- readers: a client starts reading a request's response stream (attach), or goes away from it
-- (detach). A request nobody reads is detached: it goes on (a client may come back and resume
-- it) until its grace deadline, when the reaper cancels it (queued: it leaves its queue,
-- refunded; running: its dispatcher aborts it). A reader that comes back in time takes it off
-- the detached set.
-- KEYS: none passed. Reads and writes fs:{t}:req:<id> (field readers), fs:{sched}:detached.
-- ARGV: 2 tenant, 3 request id, 4 "attach" or "detach", 5 the grace deadline (ms) of a detach.
-- Returns {"ok", readers now} or {"missing"}.
local t, rid, mode = ARGV[2], ARGV[3], ARGV[4]
local rk = key('request', t, rid)
local state = redis.call('HGET', rk, 'state')
if not state then return {'missing'} end
local member = t .. ' ' .. rid
if mode == 'attach' then
  redis.call('ZREM', K.detached, member)
  return {'ok', redis.call('HINCRBY', rk, 'readers', 1)}
end
local readers = redis.call('HINCRBY', rk, 'readers', -1)
if readers <= 0 and (state == 'queued' or state == 'leased') then
  redis.call('ZADD', K.detached, ARGV[5], member)
end
return {'ok', readers}
