-- grant: hand the next requests across all tenants to one dispatcher, with a lease on each.
-- NOTE: strict priority classes first (the highest class with backlog), then start-time fair
-- queuing by token cost inside the class (the NOTE in router/queues.py explains the choice).
-- KEYS: none passed. Reads and writes fs:{sched}:classes, fs:{sched}:ready:<class>,
--   fs:{sched}:vtime, fs:{sched}:leases, and of the chosen tenants fs:{t}:queue, fs:{t}:req:<id>,
--   fs:{t}:state (finish tag), fs:{t}:stats; reads fs:{t}:tenant (weight).
-- ARGV: 2 holder id, 3 lease ms, 4 free capacity (slots), 5 most grants to return.
-- Returns {grants, warnings}: grants is a list of {tenant, id, attempt, lease deadline ms,
--   body, meta, prompt tokens, max_tokens, created ms, grant sequence number}; warnings names
--   stored data the script had to skip or read leniently ("<key> <field>").
local holder, lease_ms = ARGV[2], tonumber(ARGV[3])
local wanted = math.min(tonumber(ARGV[4]), tonumber(ARGV[5]))
local now = clock_ms()
local grants, warnings = {}, {}

-- Read once per call, written back once at the end: tenants' settings, the classes' virtual
-- times, the grant counter.
local tenants, vtimes = {}, {}
local seq = tonumber(redis.call('HGET', K.vtime, 'grants') or '0')

local function tenant_of(t)
  if not tenants[t] then
    tenants[t] = load_tenant(t, false)
    if tenants[t].bad then warnings[#warnings + 1] = key('tenant', t) .. ' ' .. tenants[t].bad end
  end
  return tenants[t]
end

local function grant_one(t, class, start, rid)
  local rk = key('request', t, rid)
  local r = redis.call('HMGET', rk, 'state', 'cost', 'body', 'meta', 'prompt_tokens',
                       'max_tokens', 'created_ms')
  local cost = tonumber(r[2])
  if r[1] ~= 'queued' or cost == nil then
    -- an id without a usable queued record (deleted or hand-edited): drop it, dead-letter what
    -- is left of it, say so, go on
    warnings[#warnings + 1] = rk .. (r[1] == 'queued' and ' cost' or ' state')
    stat(t, 'skipped_malformed')
    if r[1] == 'queued' then
      redis.call('HSET', rk, 'state', 'dead', 'finished_ms', now, 'end_reason', 'malformed')
      redis.call('ZADD', key('dead', t), now, rid)
      end_stream(t, rid, 'error', cjson.encode({outcome = 'dead', reason = 'malformed'}),
                 K.stream_ended_ttl_s)
    end
    return
  end
  local tenant = tenant_of(t)
  vtimes[class] = math.max(vtimes[class] or vtime(class), start)
  local finish = start + cost / tenant.weight
  redis.call('HSET', key('state', t), 'vfinish', fmt(finish), 'vclass', class)
  if redis.call('LLEN', key('queue', t)) > 0 then
    redis.call('ZADD', key('ready', class), fmt(finish), t)
  else
    settle_ready(t, class)
  end
  local attempt = redis.call('HINCRBY', rk, 'deliveries', 1)
  local deadline = now + lease_ms
  seq = seq + 1
  redis.call('HSET', rk, 'state', 'leased', 'holder', holder, 'lease_deadline', deadline,
             'granted_ms', now, 'grant_seq', seq)
  redis.call('ZADD', K.leases, deadline, t .. ' ' .. rid)
  stat(t, 'granted')
  grants[#grants + 1] = {t, rid, attempt, deadline, r[3], r[4], r[5], r[6], r[7], seq}
end

local guard = 0
while #grants < wanted and guard < wanted + 1000 do
  guard = guard + 1
  local top = redis.call('ZREVRANGE', K.classes, 0, 0)
  if #top == 0 then break end
  local class = top[1]
  local head = redis.call('ZRANGE', key('ready', class), 0, 0, 'WITHSCORES')
  if #head == 0 then
    redis.call('ZREM', K.classes, class)
  else
    local t, start = head[1], tonumber(head[2])
    local rid = redis.call('LPOP', key('queue', t))
    if rid then grant_one(t, class, start, rid) else settle_ready(t, class) end
  end
end
if #grants > 0 then
  local writes = {'grants', seq}
  for class, v in pairs(vtimes) do
    writes[#writes + 1] = class
    writes[#writes + 1] = fmt(v)
  end
  redis.call('HSET', K.vtime, unpack(writes))
end
return {grants, warnings}
