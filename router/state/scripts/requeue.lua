-- requeue: the holder gives a request back (its replica died before the first token, say): it
-- goes to the head of its tenant's queue with its fairness credit, or to the dead-letter set
-- once it has been delivered max_deliveries times.
-- KEYS: none passed. Writes fs:{t}:req:<id>, fs:{t}:queue, fs:{t}:state, fs:{t}:stats,
--   fs:{sched}:ready:<class>, fs:{sched}:classes, fs:{sched}:leases; when dead also
--   fs:{t}:dead, fs:{t}:budget:<day>, fs:{t}:stream:<id>.
-- ARGV: 2 tenant, 3 request id, 4 holder id, 5 attempt, 6 max deliveries, 7 reason, 8 '1' when
--   the holder is stopping (not the request's failure: the delivery is forgiven) else '0'.
-- Returns {"queued"} or {"dead"}, or {"stale", state or "missing"}.
local t, rid, holder, attempt = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local r = load_request(t, rid)
if not lease_ok(r, holder, attempt) then return {'stale', r and r.state or 'missing'} end
return {requeue(t, rid, r, ARGV[7], tonumber(ARGV[6]), clock_ms(), ARGV[8] == '1')}
