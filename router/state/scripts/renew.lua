-- renew: extend the lease the caller holds on one request.
-- KEYS: none passed. Reads and writes fs:{t}:req:<id>, fs:{sched}:leases (of its pool).
-- ARGV: 2 tenant, 3 request id, 4 holder id, 5 attempt, 6 lease ms.
-- Returns {"ok", new deadline ms, cancel requested 0/1} or {"stale", state or "missing"}.
local t, rid, holder, attempt, lease_ms = ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
local r = load_request(t, rid)
if not lease_ok(r, holder, attempt) then return {'stale', r and r.state or 'missing'} end
local deadline = clock_ms() + lease_ms
redis.call('HSET', key('request', t, rid), 'lease_deadline', deadline)
redis.call('ZADD', leases_key(r.pool), deadline, t .. ' ' .. rid)
return {'ok', deadline, tonumber(r.cancel)}
