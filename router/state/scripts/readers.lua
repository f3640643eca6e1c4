-- readers: a client starts reading a request's response stream (attach), goes away from it
-- (detach), or its lease ran out because its router stopped renewing it (sweep: the router
-- crashed, or lost Redis for longer than the lease). A request nobody reads is detached: it
-- goes on (a client may come back and resume it) until its grace deadline, when the reaper
-- cancels it (queued: it leaves its queue, refunded; running: its dispatcher aborts it). A
-- reader that comes back in time takes it off the detached set. See attach_reader and
-- detach_reader in _lib.lua.
-- KEYS: none passed. Reads and writes fs:{t}:req:<id> (field readers), fs:{t}:state
--   (open_<kind>), fs:{t}:tenant (read), fs:{sched}:readers, fs:{sched}:detached.
-- ARGV: 2 mode.
--   attach: 3 tenant, 4 request id, 5 reader id, 6 kind (stream, resume), 7 lease end (ms).
--     Returns {"ok", readers now}, {"missing"}, or {"refused", "<kind>s", retry-after ms}.
--   detach: 3 tenant, 4 request id, 5 reader id, 6 kind, 7 the grace deadline (ms).
--     Returns {"ok", readers now}; readers -1: that reader had been let go already.
--   sweep: 3 most leases to let go, 4 grace (ms). Returns {"ok", leases let go}.
local mode = ARGV[2]
if mode == 'sweep' then
  local now = clock_ms()
  local expired = redis.call('ZRANGEBYSCORE', K.readers, '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
  for _, member in ipairs(expired) do
    local t, rid, reader, kind = string.match(member, '^(%S+) (%S+) (%S+) (%S+)$')
    if t then
      detach_reader(t, rid, reader, kind, now + tonumber(ARGV[4]))
    else
      redis.call('ZREM', K.readers, member)  -- not of this form: nothing to count down
    end
  end
  return {'ok', #expired}
end
local t, rid, reader, kind = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
if mode == 'attach' then
  if not redis.call('HGET', key('request', t, rid), 'state') then return {'missing'} end
  local tenant = load_tenant(t, false)
  return attach_reader(t, rid, tenant, reader, kind, tonumber(ARGV[7]))
end
return {'ok', detach_reader(t, rid, reader, kind, tonumber(ARGV[7]))}
