-- backlog: what waits and what runs, per tenant (for metrics, `fairserve top` and autoscaling).
-- KEYS: none passed. Reads fs:tenants, fs:{sched}:leases, and per tenant fs:{t}:tenant
--   (priority), fs:{t}:queue (its length) and fs:{t}:state (queued_cost, kept as requests move:
--   _lib.lua). O(tenants + running requests), whatever waits in the queues.
-- ARGV: none beyond the clock.
-- Returns a list of {tenant, priority, queued requests, queued tokens (fair-share cost:
--   prompt + expected output), leased requests}, one per tenant.
local leased = {}
for _, member in ipairs(redis.call('ZRANGE', K.leases, 0, -1)) do
  local t = string.sub(member, 1, string.find(member, ' ', 1, true) - 1)
  leased[t] = (leased[t] or 0) + 1
end
local out = {}
for _, t in ipairs(redis.call('SMEMBERS', K.tenants)) do
  local depth = redis.call('LLEN', key('queue', t))
  local tokens = 0
  if depth > 0 then
    tokens = math.max(0, tonumber(redis.call('HGET', key('state', t), 'queued_cost') or '0') or 0)
  end
  local priority = tonumber(redis.call('HGET', key('tenant', t), 'priority')) or 0
  out[#out + 1] = {t, priority, depth, tokens, leased[t] or 0}
end
return out
