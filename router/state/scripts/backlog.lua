-- backlog: what waits and what runs, per tenant (for metrics, `fairserve top` and autoscaling).
-- KEYS: none passed. Reads fs:tenants, fs:{sched}:leases, and per tenant fs:{t}:tenant
--   (priority), fs:{t}:queue and the cost of each queued fs:{t}:req:<id>. O(queued requests).
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
  local tokens = 0
  local ids = redis.call('LRANGE', key('queue', t), 0, -1)
  for _, rid in ipairs(ids) do
    tokens = tokens + (tonumber(redis.call('HGET', key('request', t, rid), 'cost')) or 0)
  end
  local priority = tonumber(redis.call('HGET', key('tenant', t), 'priority')) or 0
  out[#out + 1] = {t, priority, #ids, tokens, leased[t] or 0}
end
return out
