-- complete: the dispatcher is done with a request it holds: acknowledge it and settle its
-- quota (refund the unused reservation, charge the actual tokens, correct the fair-share tags
-- from expected to actual cost), append the terminal stream event, start the result TTL.
-- KEYS: none passed. Reads fs:{t}:tenant; writes fs:{t}:req:<id>, fs:{t}:state,
--   fs:{t}:budget:<day>, fs:{t}:stream:<id>, fs:{t}:stats, fs:{sched}:ready:<class>,
--   fs:{sched}:leases.
-- ARGV: 2 tenant, 3 request id, 4 holder id, 5 attempt, 6 outcome ("completed" or
--   "cancelled"), 7 prompt tokens used, 8 output tokens used, 9 finish reason,
--   10 terminal event data (JSON, opaque).
-- Returns {"ok", tokens refunded (negative: charged beyond the reservation)} or
--   {"stale", state or "missing"} when the caller does not hold the lease (nothing changes).
local t, rid, holder, attempt, outcome = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local prompt_used, output_used = tonumber(ARGV[7]), tonumber(ARGV[8])
local finish_reason, data = ARGV[9], ARGV[10]
local r = load_request(t, rid)
if not lease_ok(r, holder, attempt) then return {'stale', r and r.state or 'missing'} end
local now = clock_ms()
local tenant = load_tenant(t, false)
local actual = prompt_used + output_used
local refund = settle_tokens(t, tenant, tonumber(r.reserved), r.day, actual)
shift_tags(t, tenant.priority, (actual - tonumber(r.cost)) / tenant.weight)
local rk = key('request', t, rid)
redis.call('HSET', rk, 'state', outcome, 'finished_ms', now, 'finish_reason', finish_reason,
           'prompt_tokens_used', prompt_used, 'output_tokens_used', output_used)
redis.call('EXPIRE', rk, K.result_ttl_s)
redis.call('ZREM', K.leases, t .. ' ' .. rid)
end_stream(t, rid, 'end', data, K.stream_ended_ttl_s)
stat(t, outcome)
stat(t, 'prompt_tokens', prompt_used)
stat(t, 'output_tokens', output_used)
return {'ok', refund}
