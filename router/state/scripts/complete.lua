-- complete: the dispatcher is done with requests it holds: acknowledge each and settle its
-- quota (refund the unused reservation, charge the actual tokens, correct the fair-share tags
-- from expected to actual cost), append the terminal stream event, start the result TTL.
-- One call completes a batch; each entry is checked and settled on its own.
-- KEYS: none passed. Reads fs:{t}:tenant; writes fs:{t}:req:<id>, fs:{t}:state,
--   fs:{t}:budget:<day>, fs:{t}:stream:<id>, fs:{t}:stats, fs:{sched}:ready:<class>,
--   fs:{sched}:leases.
-- ARGV: 2 number of completions n, then n groups of 10: tenant, request id, holder id, attempt,
--   outcome ("completed" or "cancelled"), prompt tokens used, output tokens used,
--   finish reason, terminal event data (JSON, opaque), output tokens the stream must hold
--   (-1: unchecked).
-- Returns a list of n replies, in order: {"ok", tokens refunded (negative: charged beyond the
--   reservation)} or {"stale", state or "missing"} when the caller does not hold that lease,
--   or {"gap", output tokens in the stream} when the stream holds fewer than it must (a Redis
--   failover lost its last chunks: the caller has them made again); in both nothing about
--   that request changes.
-- A served request's usage counts, from its terminal event (cached tokens, phase times).
local function served_usage(event, outcome, prompt_used, output_used)
  local ok, e = pcall(cjson.decode, event)
  if not ok or type(e) ~= 'table' then e = {} end
  local tm = type(e.timings) == 'table' and e.timings or {}
  local function span_ms(from, to)
    local a, b = tonumber(tm[from]), tonumber(tm[to])
    if a and b and b > a then return (b - a) * 1000 end
    return 0
  end
  local counts = {requests = 1, prompt_tokens = prompt_used, completion_tokens = output_used,
                  cached_tokens = tonumber(e.cached_tokens) or 0,
                  queue_ms = span_ms('admitted_s', 'granted_s'),
                  engine_ms = span_ms('arrived_s', 'finished_s')}
  if outcome == 'cancelled' then counts.cancelled = 1 end
  if type(e.error) == 'table' then counts.failed = 1 end
  return counts
end

local n = tonumber(ARGV[2])
local now_s = fmt(clock_ms())
local tenants, deltas, counts, replies = {}, {}, {}, {}

for i = 0, n - 1 do
  local b = 3 + i * 10
  local t, rid, holder, attempt, outcome = ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3],
                                           ARGV[b + 4]
  local prompt_used, output_used = tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6])
  local r = load_request(t, rid)
  local must_hold = tonumber(ARGV[b + 9])
  local streamed = must_hold < 0 and 0 or
                   tonumber(redis.call('HGET', key('request', t, rid), 'streamed') or '0')
  if not lease_ok(r, holder, attempt) then
    replies[i + 1] = {'stale', r and r.state or 'missing'}
  elseif streamed < must_hold then
    replies[i + 1] = {'gap', streamed}
  else
    tenants[t] = tenants[t] or load_tenant(t, false)
    local tenant = tenants[t]
    local actual = prompt_used + output_used
    replies[i + 1] = {'ok', settle_tokens(t, tenant, tonumber(r.reserved), r.day, actual)}
    deltas[t] = deltas[t] or {}  -- pool -> the correction of its tags
    deltas[t][r.pool] = (deltas[t][r.pool] or 0) + (actual - tonumber(r.cost)) / tenant.weight
    local rk = key('request', t, rid)
    redis.call('HSET', rk, 'state', outcome, 'finished_ms', now_s, 'finish_reason', ARGV[b + 7],
               'prompt_tokens_used', ARGV[b + 5], 'output_tokens_used', ARGV[b + 6])
    redis.call('HDEL', rk, 'body')  -- served: its prompt and sampling are never read again
    redis.call('EXPIRE', rk, K.resume_window_s)
    redis.call('ZREM', leases_key(r.pool), t .. ' ' .. rid)
    end_stream(t, rid, 'end', ARGV[b + 8], K.resume_window_s)
    count(counts, t, outcome)
    count(counts, t, 'prompt_tokens', prompt_used)
    count(counts, t, 'output_tokens', output_used)
    usage(t, r.model, served_usage(ARGV[b + 8], outcome, prompt_used, output_used))
  end
end
for t, pools in pairs(deltas) do
  for pool, delta in pairs(pools) do shift_tags(t, tenants[t].priority, delta, pool) end
end
flush_counts(counts)
return replies
