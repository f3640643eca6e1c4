-- reap: requeue (or dead-letter) every request whose lease deadline has passed. Any dispatcher
-- may run it; a lease renewed in time is never touched.
-- KEYS: none passed. Reads fs:{sched}:leases; per expired lease as requeue.lua.
-- ARGV: 2 max deliveries, 3 most leases to look at.
-- Returns {number requeued, number dead-lettered, number of stale lease entries dropped}.
local max_deliveries, limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local now = clock_ms()
local expired = redis.call('ZRANGEBYSCORE', K.leases, '-inf', now, 'LIMIT', 0, limit)
local num_queued, num_dead, num_dropped = 0, 0, 0
for _, member in ipairs(expired) do
  local sep = string.find(member, ' ', 1, true)
  local t, rid = string.sub(member, 1, sep - 1), string.sub(member, sep + 1)
  local r = load_request(t, rid)
  if r and r.state == 'leased' then
    if requeue(t, rid, r, 'lease_expired', max_deliveries, now, false) == 'dead' then
      num_dead = num_dead + 1
    else
      num_queued = num_queued + 1
    end
  else
    redis.call('ZREM', K.leases, member)
    num_dropped = num_dropped + 1
  end
end
return {num_queued, num_dead, num_dropped}
