-- reap: requeue (or dead-letter) every request whose lease deadline has passed, in every pool
-- (_lib.lua), and forget a pool with neither backlog nor leases. Any dispatcher may run it; a
-- lease renewed in time is never touched.
-- KEYS: none passed. Reads fs:{sched}:leases (each pool's), fs:{sched}:pools; per expired
--   lease as requeue.lua.
-- ARGV: 2 max deliveries, 3 most leases to look at (per pool).
-- Returns {number requeued, number dead-lettered, number of stale lease entries dropped}.
local max_deliveries, limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local now = clock_ms()
local num_queued, num_dead, num_dropped = 0, 0, 0
for _, pool in ipairs(all_pools()) do
  local leases = leases_key(pool)
  local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, limit)
  for _, member in ipairs(expired) do
    local sep = string.find(member, ' ', 1, true)
    local t, rid = string.sub(member, 1, sep - 1), string.sub(member, sep + 1)
    local r = load_request(t, rid)
    if r and r.state == 'leased' and r.pool == pool then
      if requeue(t, rid, r, 'lease_expired', max_deliveries, now, false) == 'dead' then
        num_dead = num_dead + 1
      else
        num_queued = num_queued + 1
      end
    else
      redis.call('ZREM', leases, member)
      num_dropped = num_dropped + 1
    end
  end
  if pool ~= '' and redis.call('ZCARD', leases) == 0 and
      redis.call('ZCARD', classes_key(pool)) == 0 then
    redis.call('SREM', K.pools, pool)
  end
end
return {num_queued, num_dead, num_dropped}
