-- cancel: a queued request leaves its queue with its reservation refunded; a running one is
-- flagged so that its dispatcher aborts it (and then completes it as "cancelled").
-- KEYS: none passed. Reads and writes fs:{t}:req:<id>; when queued also fs:{t}:queue,
--   fs:{t}:state, fs:{t}:budget:<day>, fs:{t}:stream:<id>, fs:{t}:stats,
--   fs:{sched}:ready:<class>, fs:{sched}:classes.
-- ARGV: 2 tenant, 3 request id, 4 reason.
-- Returns {"cancelled"} (was queued), {"flagged"} (is running), {"ended", state} or
--   {"missing"}.
local t, rid = ARGV[2], ARGV[3]
local r = load_request(t, rid)
if not r then return {'missing'} end
if r.state == 'leased' then
  redis.call('HSET', key('request', t, rid), 'cancel', 1)
  return {'flagged'}
end
if r.state ~= 'queued' then return {'ended', r.state} end
local tenant = load_tenant(t, false)
redis.call('LREM', queue_key(t, r.pool), 1, rid)
queued_cost(t, -(tonumber(r.cost) or 0), r.pool)
settle_ready(t, tenant.priority, r.pool)
end_unserved(t, rid, tenant, r, 'cancelled', ARGV[4], clock_ms())
return {'cancelled'}
