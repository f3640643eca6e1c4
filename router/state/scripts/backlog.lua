-- backlog: what waits and what runs, per tenant and pool (for metrics, `fairserve top` and
-- autoscaling; a pool is one model's queues, _lib.lua).
-- KEYS: none passed. Reads fs:tenants, fs:{sched}:pools, each pool's fs:{sched}:leases, and
--   per tenant fs:{t}:tenant (priority), its queues (their length) and fs:{t}:state
--   (queued_cost of each pool, kept as requests move: _lib.lua). O(tenants x pools + running
--   requests), whatever waits in the queues.
-- ARGV: none beyond the clock.
-- Returns a list of {tenant, pool, priority, queued requests, queued tokens (fair-share cost:
--   prompt + expected output), leased requests}: one per tenant in the default pool (""), and
--   one per tenant and other pool where it has queued or leased requests.
local pools = all_pools()
local leased = {}  -- pool -> tenant -> leases
for _, pool in ipairs(pools) do
  leased[pool] = {}
  for _, member in ipairs(redis.call('ZRANGE', leases_key(pool), 0, -1)) do
    local t = string.sub(member, 1, string.find(member, ' ', 1, true) - 1)
    leased[pool][t] = (leased[pool][t] or 0) + 1
  end
end
local out = {}
for _, t in ipairs(redis.call('SMEMBERS', K.tenants)) do
  local priority = tonumber(redis.call('HGET', key('tenant', t), 'priority')) or 0
  for _, pool in ipairs(pools) do
    local depth, tokens = redis.call('LLEN', queue_key(t, pool)), 0
    if depth > 0 then
      tokens = math.max(0, tonumber(redis.call('HGET', key('state', t), 'queued_cost' .. sfx(pool))
                                   or '0') or 0)
    end
    local running = leased[pool][t] or 0
    if pool == '' or depth > 0 or running > 0 then
      out[#out + 1] = {t, pool, priority, depth, tokens, running}
    end
  end
end
return out
