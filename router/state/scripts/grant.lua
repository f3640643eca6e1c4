-- grant: hand the next requests across all tenants to one dispatcher, with a lease on each.
-- NOTE: strict priority classes first (the highest class with backlog), then start-time fair
-- queuing by token cost inside the class (the NOTE in router/state/queues.py explains the choice).
-- KEYS: none passed. Reads and writes fs:{sched}:classes, fs:{sched}:ready:<class>,
--   fs:{sched}:vtime, fs:{sched}:leases, and of the chosen tenants fs:{t}:queue, fs:{t}:req:<id>,
--   fs:{t}:state (finish tag, queued_cost), fs:{t}:stats; reads fs:{t}:tenant (weight).
-- ARGV: 2 holder id, 3 lease ms, 4 free capacity (slots), 5 most grants to return, 6 the
--   pool's total capacity in slots or "" (given: never more leases live than that, however
--   many dispatchers call at once; the live leases are counted in this same atomic call),
--   7 the pool (a model's queues, _lib.lua; "" or absent: the default model's) granted from:
--   its own classes, ready sets, virtual times and tenants' finish tags.
-- Returns {grants, warnings}: grants is a list of {tenant, id, attempt, lease deadline ms,
--   body, meta, prompt tokens, max_tokens, created ms, grant sequence number, priority class,
--   the tenant's queue depth right after its admission, the tenant's weight (a string: the
--   replica's fair scheduler weighs the tenant's tokens by it), the tenant's cache group (""
--   for none: its prefix cache is its own)}; warnings names
--   stored data the script had to skip or read leniently ("<key> <field>").
local holder, lease_ms, pool = ARGV[2], tonumber(ARGV[3]), ARGV[7] or ''
local wanted = math.min(tonumber(ARGV[4]), tonumber(ARGV[5]))
if ARGV[6] and ARGV[6] ~= '' then
  wanted = math.min(wanted, tonumber(ARGV[6]) - redis.call('ZCARD', leases_key(pool)))
end
local now = clock_ms()
local deadline = now + lease_ms
-- as strings once: Redis formats a number argument with snprintf on every call
local now_s, deadline_s = fmt(now), fmt(deadline)
local grants, warnings, counts = {}, {}, {}

-- Read once per call, written back once at the end: tenants' settings and finish tags, the
-- classes' virtual times, the grant counter.
local tenants, finishes, vtimes = {}, {}, {}
local dequeued = {}  -- tenant -> the cost granted out of its queue (queued_cost)
local seq = tonumber(redis.call('HGET', K.vtime, 'grants') or '0')

local function tenant_of(t)
  if not tenants[t] then
    tenants[t] = load_tenant(t, false)
    tenants[t].cache_group = redis.call('HGET', key('tenant', t), 'cache_group') or ''
    if tenants[t].bad then warnings[#warnings + 1] = key('tenant', t) .. ' ' .. tenants[t].bad end
  end
  return tenants[t]
end

-- An id without a usable queued record (deleted or hand-edited): drop it, dead-letter what is
-- left of it, say so, go on.
local function skip_malformed(t, rid, rk, state)
  warnings[#warnings + 1] = rk .. (state == 'queued' and ' cost' or ' state')
  count(counts, t, 'skipped_malformed')
  if state == 'queued' then
    redis.call('HSET', rk, 'state', 'dead', 'finished_ms', now, 'end_reason', 'malformed')
    redis.call('HDEL', rk, 'body')
    redis.call('ZADD', key('dead', t), now, rid)
    end_stream(t, rid, 'error', cjson.encode({outcome = 'dead', reason = 'malformed'}),
               K.resume_window_s)
  end
end

local function grant_one(t, class, start, rid)
  local rk = key('request', t, rid)
  local r = redis.call('HMGET', rk, 'state', 'cost', 'body', 'meta', 'prompt_tokens',
                       'max_tokens', 'created_ms', 'deliveries', 'admit_depth')
  local cost = tonumber(r[2])
  if r[1] ~= 'queued' or cost == nil then return skip_malformed(t, rid, rk, r[1]) end
  dequeued[t] = dequeued[t] + cost
  vtimes[class] = math.max(vtimes[class] or vtime(class, pool), start)
  local finish = start + cost / tenant_of(t).weight
  finishes[t] = {finish, class}
  local attempt = (tonumber(r[8]) or 0) + 1
  seq = seq + 1
  redis.call('HSET', rk, 'state', 'leased', 'holder', holder, 'lease_deadline', deadline_s,
             'granted_ms', now_s, 'grant_seq', seq, 'deliveries', attempt, 'writer', '')
  redis.call('ZADD', leases_key(pool), deadline_s, t .. ' ' .. rid)
  count(counts, t, 'granted')
  grants[#grants + 1] = {t, rid, attempt, deadline, r[3], r[4], r[5], r[6], r[7], seq,
                         class, tonumber(r[9]) or 0, fmt(tenant_of(t).weight),
                         tenant_of(t).cache_group}
  return finish
end

-- The ready set of one class, worked on locally: its first n entries plus the next one as a
-- boundary. A loaded entry may be picked while it sorts before the boundary (so before every
-- entry not loaded); past it, the changes are written back and the set is read again.
local function before(a, b) return a.s < b.s or (a.s == b.s and a.t < b.t) end

local Ready = {}
Ready.__index = Ready

function Ready.load(class, n)
  local flat = redis.call('ZRANGE', ready_key(class, pool), 0, n, 'WITHSCORES')
  local self = setmetatable({class = class, entries = {}, boundary = nil}, Ready)
  for i = 1, #flat, 2 do self.entries[#self.entries + 1] = {t = flat[i], s = tonumber(flat[i + 1])} end
  if #self.entries == n + 1 then self.boundary = table.remove(self.entries) end
  return self
end

function Ready:first()
  local best = nil
  for i, e in ipairs(self.entries) do
    if not best or before(e, self.entries[best]) then best = i end
  end
  return best
end

function Ready:save()
  local ready = ready_key(self.class, pool)
  for _, e in ipairs(self.entries) do
    if e.dirty then redis.call('ZADD', ready, fmt(e.s), e.t) end
  end
  if redis.call('ZCARD', ready) == 0 then redis.call('ZREM', classes_key(pool), self.class) end
end

function Ready:drop(i)
  redis.call('ZREM', ready_key(self.class, pool), self.entries[i].t)
  table.remove(self.entries, i)
end

local queue_lengths = {}
local function queue_length(t)
  queue_lengths[t] = queue_lengths[t] or redis.call('LLEN', queue_key(t, pool))
  return queue_lengths[t]
end

-- One step: grant from the first tenant of the class, or say why not (nil: the class is done
-- or must be read again).
local function step(ready)
  local i = ready:first()
  if not i then return false end
  local e = ready.entries[i]
  if ready.boundary and before(ready.boundary, e) then return false end
  if queue_length(e.t) == 0 then  -- a tenant with nothing queued has no place in line
    ready:drop(i)
    return true
  end
  local rid = redis.call('LPOP', queue_key(e.t, pool))
  queue_lengths[e.t] = queue_lengths[e.t] - 1
  dequeued[e.t] = dequeued[e.t] or 0
  local finish = grant_one(e.t, ready.class, e.s, rid)
  if queue_lengths[e.t] == 0 then
    ready:drop(i)
  elseif finish then
    e.s, e.dirty = finish, true
  end
  return true
end

-- Strict priority: the highest class with backlog until it runs dry, then the next.
local guard = 0
while #grants < wanted and guard < wanted + 1000 do
  guard = guard + 1
  local class = redis.call('ZREVRANGE', classes_key(pool), 0, 0)[1]
  if not class then break end
  local ready = Ready.load(class, wanted - #grants)
  while #grants < wanted and step(ready) do guard = guard + 1 end
  ready:save()
end

for t, cost in pairs(dequeued) do queued_cost(t, -cost, pool) end
for t, fc in pairs(finishes) do
  redis.call('HSET', key('state', t), 'vfinish' .. sfx(pool), fmt(fc[1]), 'vclass' .. sfx(pool),
             fc[2])
end
if #grants > 0 then
  local writes = {'grants', seq}
  for c, v in pairs(vtimes) do
    writes[#writes + 1] = vtime_field(c, pool)
    writes[#writes + 1] = fmt(v)
  end
  redis.call('HSET', K.vtime, unpack(writes))
end
flush_counts(counts)
return {grants, warnings}
