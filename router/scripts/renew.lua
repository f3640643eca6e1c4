-- renew: extend the lease the caller holds on one request.
-- KEYS: none passed. Reads and writes fs:{t}:req:<id>, fs:{sched}:leases.
-- ARGV: 3 tenant, 4 request id, 5 holder id, 6 attempt, 7 lease ms.
-- Returns {"ok", new deadline ms, cancel requested 0/1} or {"stale", state or "missing"}.
local t, rid, holder, attempt, lease_ms = ARGV[3], ARGV[4], ARGV[5], ARGV[6], tonumber(ARGV[7])
local r = load_request(t, rid)
if not lease_ok(r, holder, attempt) then return {'stale', r and r.state or 'missing'} end
local deadline = clock_ms() + lease_ms
redis.call('HSET', key('request', t, rid), 'lease_deadline', deadline)
redis.call('ZADD', K.leases, deadline, t .. ' ' .. rid)
return {'ok', deadline, tonumber(r.cancel)}
