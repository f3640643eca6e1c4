-- fairserve Lua library: router/state/scripts.py puts this in front of every script.
--
-- Before this file router/state/scripts.py puts `local K = {...}`: the key templates of router/state/keys.py
-- (the only place key names are spelled) and the TTLs and limits, as string constants of the
-- source (Redis formats a number argument with snprintf; a string goes out as it is), and
-- `local KP = {...}`: each template split at its `%s` placeholders, for key() below.
-- ARGV[1] is the clock in ms, or "" for the server's own TIME. A script's own arguments start
-- at ARGV[2].
--
-- Errors are raised with redis.error_reply before a script writes anything (Redis does not roll
-- a script back): "FSNOTFOUND <what>", "FSSTORED <key> <field>" (malformed stored data),
-- "FSINVALID <param> <message>".

if redis.replicate_commands then redis.replicate_commands() end

-- fs:{t}:req:<id> is key('request', t, id): the template's parts joined around the arguments.
local function key(name, a, b)
  local p = KP[name]
  if b then return p[1] .. a .. p[2] .. b .. p[3] end
  if a then return p[1] .. a .. p[2] end
  return K[name]
end

-- One instant per call: a script runs atomically, so everything in it happens "now".
local NOW_MS
local function clock_ms()
  if NOW_MS then return NOW_MS end
  if ARGV[1] ~= '' then
    NOW_MS = tonumber(ARGV[1])
  else
    local t = redis.call('TIME')
    NOW_MS = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return NOW_MS
end

local function fmt(x) return string.format('%.17g', x) end

local TENANT_FIELDS = {'weight', 'priority', 'rpm', 'tpm', 'daily_tokens', 'max_tokens',
                       'max_queued', 'max_streams', 'max_resumes', 'disabled'}
local DISABLED = #TENANT_FIELDS

-- The tenant's settings as numbers; nil where unlimited. strict: malformed data raises (before
-- any write); lenient (the grant path, which must not stall every tenant for one): malformed
-- fields fall back to weight 1, priority 0, and the field's name is returned in `bad`.
local function load_tenant(t, strict)
  local tk = key('tenant', t)
  local v = redis.call('HMGET', tk, unpack(TENANT_FIELDS))
  local found = false
  for i = 1, #TENANT_FIELDS do if v[i] then found = true end end
  if not found then
    if strict then return nil, redis.error_reply('FSNOTFOUND tenant ' .. t) end
    return {weight = 1, priority = 0, disabled = false, bad = 'missing'}
  end
  if v[DISABLED] and v[DISABLED] ~= '0' and v[DISABLED] ~= '1' then
    if strict then return nil, redis.error_reply('FSSTORED ' .. tk .. ' disabled') end
  end
  -- anything but '0' refuses: a malformed flag fails closed
  local s = {disabled = (v[DISABLED] or '0') ~= '0'}
  for i = 1, DISABLED - 1 do
    local name = TENANT_FIELDS[i]
    if v[i] then
      local n = tonumber(v[i])
      local ok = n ~= nil and n == n and n >= 0
      if ok and (name == 'weight') then ok = n > 0 end
      if ok and name ~= 'weight' then ok = n == math.floor(n) end
      if ok and name == 'priority' then ok = n <= 9 end
      if not ok then
        if strict then return nil, redis.error_reply('FSSTORED ' .. tk .. ' ' .. name) end
        s.bad = name
      else
        s[name] = n
      end
    end
  end
  s.weight = s.weight or 1
  s.priority = s.priority or 0
  return s
end

local function stat(t, name, by) redis.call('HINCRBY', key('stats', t), name, by or 1) end

-- ---- usage records (router/state/usage.py): per tenant, UTC hour and model ----
-- fs:{t}:usage:<hour> is a hash of '<model>|<counter>' -> count, kept K.usage_ttl_s (0: none
-- written). Written by the scripts that admit and end requests: no round trip of its own.
local function usage(t, model, counts)
  local ttl = tonumber(K.usage_ttl_s)
  if ttl <= 0 then return end
  local uk = key('usage', t, math.floor(clock_ms() / 3600000))
  local prefix = (model or '') .. '|'
  for name, by in pairs(counts) do
    if by ~= 0 then redis.call('HINCRBY', uk, prefix .. name, math.floor(by + 0.5)) end
  end
  redis.call('EXPIRE', uk, ttl)
end

-- ---- pools: each model's own queues (its replicas serve only it) ----
-- A request waits in the pool of its model: the default model's pool is '' and its keys and
-- fields are named as they always were; another model's end in ':<pool>' (the pool's name is
-- checked by router/state/keys.py). Fair share, queue limits and backlog are per pool: one
-- model's flood neither delays nor scales another's requests.
local function sfx(pool) if pool == '' then return '' end return ':' .. pool end
local function queue_key(t, pool) return key('queue', t) .. sfx(pool) end
local function ready_key(class, pool) return key('ready', class) .. sfx(pool) end
local function classes_key(pool) return K.classes .. sfx(pool) end
local function leases_key(pool) return K.leases .. sfx(pool) end
local function vtime_field(class, pool) return tostring(class) .. sfx(pool) end

-- The fair-share cost of what waits in a tenant's queue (fs:{t}:state queued_cost), kept as
-- requests enter and leave it, so that the backlog is read in O(tenants), never O(queued);
-- exact again (0) whenever the queue is empty, so no drift outlives a backlog.
local function queued_cost(t, delta, pool)
  local field = 'queued_cost' .. sfx(pool)
  if redis.call('LLEN', queue_key(t, pool)) == 0 then
    redis.call('HSET', key('state', t), field, 0)
  elseif delta ~= 0 then
    redis.call('HINCRBY', key('state', t), field, delta)
  end
end

-- Counters gathered over a batch, written once per tenant and name at the end.
local function count(counts, t, name, by)
  counts[t] = counts[t] or {}
  counts[t][name] = (counts[t][name] or 0) + (by or 1)
end

local function flush_counts(counts)
  for t, names in pairs(counts) do
    for name, by in pairs(names) do
      if by ~= 0 then stat(t, name, by) end
    end
  end
end

-- ---- fair share (start-time fair queuing per priority class; see the NOTE in router/state/queues.py) ----

local function vtime(class, pool)
  return tonumber(redis.call('HGET', K.vtime, vtime_field(class, pool)) or '0')
end

local function finish_tag(t, pool)
  return tonumber(redis.call('HGET', key('state', t), 'vfinish' .. sfx(pool)) or '0')
end

-- Every pool with something in it: the default, and those in K.pools (a pool joins when a
-- request is queued in it, and reap.lua drops it once it has neither backlog nor leases).
local function all_pools()
  local pools = redis.call('SMEMBERS', K.pools)
  table.sort(pools)
  table.insert(pools, 1, '')
  return pools
end

-- The tenant has work queued: give it a start tag if it has none (max of virtual time and its
-- own finish tag, so idle time never banks credit). A finish tag from another class is on that
-- class's clock: it carries nothing over.
local function mark_ready(t, class, pool)
  local ready = ready_key(class, pool)
  if redis.call('ZSCORE', ready, t) then return end
  local sk = key('state', t)
  local st = redis.call('HMGET', sk, 'vfinish' .. sfx(pool), 'vclass' .. sfx(pool))
  local start = vtime(class, pool)
  if st[2] == tostring(class) then start = math.max(start, tonumber(st[1]) or 0) end
  redis.call('ZADD', ready, fmt(start), t)
  redis.call('ZADD', classes_key(pool), class, class)
  if pool ~= '' then redis.call('SADD', K.pools, pool) end
end

-- A tenant with backlog changes priority class: it keeps its lag behind the old class's
-- virtual time (its place in line), measured on the new class's clock.
local function move_class(t, old, new, pool)
  local start = redis.call('ZSCORE', ready_key(old, pool), t)
  if not start then return end
  redis.call('ZREM', ready_key(old, pool), t)
  if redis.call('ZCARD', ready_key(old, pool)) == 0 then
    redis.call('ZREM', classes_key(pool), old)
  end
  local moved = vtime(new, pool) + math.max(0, tonumber(start) - vtime(old, pool))
  redis.call('HSET', key('state', t), 'vfinish' .. sfx(pool), fmt(moved), 'vclass' .. sfx(pool),
             new)
  redis.call('ZADD', ready_key(new, pool), fmt(moved), t)
  redis.call('ZADD', classes_key(pool), new, new)
end

-- After a request left the tenant's queue: drop the tenant from its class when nothing is left.
local function settle_ready(t, class, pool)
  if redis.call('LLEN', queue_key(t, pool)) > 0 then return end
  local ready = ready_key(class, pool)
  redis.call('ZREM', ready, t)
  if redis.call('ZCARD', ready) == 0 then redis.call('ZREM', classes_key(pool), class) end
end

-- Move the tenant's tags by delta (virtual time): a refund of a failed attempt's charge, or the
-- correction from expected to actual tokens at completion.
local function shift_tags(t, class, delta, pool)
  if delta == 0 then return end
  redis.call('HSET', key('state', t), 'vfinish' .. sfx(pool), fmt(finish_tag(t, pool) + delta))
  local ready = ready_key(class, pool)
  local start = redis.call('ZSCORE', ready, t)
  if start then
    redis.call('ZADD', ready, fmt(math.max(vtime(class, pool), tonumber(start) + delta)), t)
  end
end

-- ---- quotas ----

local DAY_MS = 86400000

-- Move the reservation of a request to `actual` tokens: the daily budget of the day it was
-- reserved and the TPM limiter get back (or pay) the difference. Returns reserved - actual.
local function settle_tokens(t, tenant, reserved, day, actual)
  local diff = actual - reserved
  if diff ~= 0 then
    local bk = key('budget', t, day)
    -- today's counter exists (admission made it); an older one may have expired: never
    -- recreate it without its TTL
    if tonumber(day) == math.floor(clock_ms() / DAY_MS) or redis.call('EXISTS', bk) == 1 then
      redis.call('INCRBY', bk, diff)
    end
    if tenant.tpm then
      redis.call('HINCRBYFLOAT', key('state', t), 'tpm_tat', fmt(diff * 60000 / tenant.tpm))
    end
  end
  return -diff
end

-- ---- request ends ----

local function end_stream(t, rid, event, data, ttl_s)
  local sk = key('stream', t, rid)
  redis.call('XADD', sk, 'MAXLEN', '~', K.stream_max_events, '*', 'type', event, 'data', data)
  redis.call('EXPIRE', sk, ttl_s)
end

-- Ends a request that is not coming back: dead-lettered, or cancelled while queued. The whole
-- reservation is refunded; the stream gets its terminal event.
local function end_unserved(t, rid, tenant, r, new_state, reason, now)
  local rk = key('request', t, rid)
  -- what it cost before it died is charged (its prompt, if any output was sent, and that
  -- output); the rest of the reservation is refunded
  local streamed = tonumber(redis.call('HGET', rk, 'streamed') or '0')
  local used = 0
  if streamed > 0 then
    used = streamed + tonumber(redis.call('HGET', rk, 'prompt_tokens') or '0')
  end
  settle_tokens(t, tenant, tonumber(r.reserved), r.day, used)
  redis.call('HSET', rk, 'state', new_state, 'finished_ms', now, 'end_reason', reason,
             'holder', '', 'lease_deadline', '')
  redis.call('HDEL', rk, 'body')  -- never to be served: its prompt is not needed any more
  redis.call('EXPIRE', rk, K.resume_window_s)
  if new_state == 'dead' then
    local dk = key('dead', t)
    redis.call('ZADD', dk, now, rid)
    redis.call('EXPIRE', dk, K.dead_ttl_s)
  end
  end_stream(t, rid, new_state == 'dead' and 'error' or 'end',
             cjson.encode({outcome = new_state, reason = reason}), K.resume_window_s)
  stat(t, new_state)
  local served = used > 0 and tonumber(redis.call('HGET', rk, 'prompt_tokens') or '0') or 0
  usage(t, r.model, {requests = 1, [new_state] = 1, prompt_tokens = served,
                     completion_tokens = streamed})
end

local REQUEST_FIELDS = {'state', 'holder', 'deliveries', 'cost', 'reserved', 'day', 'cancel',
                        'writer', 'forgiven', 'pool', 'model'}

local function load_request(t, rid)
  local v = redis.call('HMGET', key('request', t, rid), unpack(REQUEST_FIELDS))
  if not v[1] then return nil end
  local r = {}
  for i = 1, #REQUEST_FIELDS do r[REQUEST_FIELDS[i]] = v[i] end
  r.pool = r.pool or ''
  return r
end

-- The caller must hold the request's current lease (holder and attempt), else it is stale.
local function lease_ok(r, holder, attempt)
  return r ~= nil and r.state == 'leased' and r.holder == holder and r.deliveries == attempt
end

-- Back to the head of its tenant's queue with its fairness credit, or dead past the limit.
-- A delivery handed back by a holder that is stopping (a router's graceful shutdown: a rolling
-- restart) is not the request's failure: it is forgiven, so it does not count towards
-- max_deliveries (the attempt number still grows: it fences the old holder).
local function requeue(t, rid, r, reason, max_deliveries, now, forgive)
  redis.call('ZREM', leases_key(r.pool), t .. ' ' .. rid)
  local tenant = load_tenant(t, false)
  local forgiven = tonumber(r.forgiven or '0') + (forgive and 1 or 0)
  if tonumber(r.deliveries) - forgiven >= max_deliveries then
    end_unserved(t, rid, tenant, r, 'dead', reason, now)
    return 'dead'
  end
  redis.call('HSET', key('request', t, rid), 'state', 'queued', 'holder', '', 'lease_deadline', '',
             'requeued_ms', now, 'requeue_reason', reason, 'forgiven', forgiven)
  redis.call('LPUSH', queue_key(t, r.pool), rid)
  queued_cost(t, tonumber(r.cost), r.pool)
  shift_tags(t, tenant.priority, -tonumber(r.cost) / tenant.weight, r.pool)
  mark_ready(t, tenant.priority, r.pool)
  stat(t, 'requeued')
  return 'queued'
end

-- Readers: the clients reading a request's response stream, each with a lease (a member
-- "<tenant> <id> <reader> <kind>" of K.readers, scored by when it runs out) its router renews
-- while the client is connected. The open readers of each kind are counted per tenant
-- (fs:{t}:state open_<kind>) against the tenant's limit; the request counts its own (readers).
local READER_LIMITS = {stream = 'max_streams', resume = 'max_resumes'}

-- A reader of request rid starts, unless its tenant has its limit of this kind open already
-- ({'refused', kind .. 's', retry ms}) or the request has K.max_readers_per_request readers
-- ({'refused', 'readers', retry ms}); else {'ok', the request's readers now}. The request must
-- exist.
local function attach_reader(t, rid, tenant, reader, kind, expiry_ms)
  local limit_name = READER_LIMITS[kind]
  if not limit_name then return redis.error_reply('FSINVALID kind reader kind ' .. tostring(kind)) end
  local sk = key('state', t)
  local open = tonumber(redis.call('HGET', sk, 'open_' .. kind) or '0') or 0
  local limit = tenant[limit_name]
  if limit and open >= limit then
    stat(t, 'refused_' .. kind .. 's')
    return {'refused', kind .. 's', K.reader_retry_ms}
  end
  local rk = key('request', t, rid)
  if (tonumber(redis.call('HGET', rk, 'readers') or '0') or 0) >= tonumber(K.max_readers_per_request) then
    stat(t, 'refused_readers')
    return {'refused', 'readers', K.reader_retry_ms}
  end
  redis.call('ZADD', K.readers, expiry_ms, t .. ' ' .. rid .. ' ' .. reader .. ' ' .. kind)
  redis.call('HINCRBY', sk, 'open_' .. kind, 1)
  redis.call('ZREM', K.detached, t .. ' ' .. rid)
  return {'ok', redis.call('HINCRBY', rk, 'readers', 1)}
end

-- A reader goes away (its client left, its stream ended, or its lease ran out): its tenant's
-- count goes down, and a request still to run that nobody reads any more is detached, to be
-- cancelled at deadline_ms unless a reader comes back. Returns the request's readers now; -1
-- when the reader was gone already (so a detach and a sweep of one reader count once).
local function detach_reader(t, rid, reader, kind, deadline_ms)
  if redis.call('ZREM', K.readers, t .. ' ' .. rid .. ' ' .. reader .. ' ' .. kind) == 0 then
    return -1
  end
  local sk = key('state', t)
  if redis.call('HINCRBY', sk, 'open_' .. kind, -1) < 0 then
    redis.call('HSET', sk, 'open_' .. kind, 0)
  end
  local rk = key('request', t, rid)
  local state = redis.call('HGET', rk, 'state')
  if not state then return 0 end
  local readers = redis.call('HINCRBY', rk, 'readers', -1)
  if readers <= 0 and (state == 'queued' or state == 'leased') then
    redis.call('ZADD', K.detached, deadline_ms, t .. ' ' .. rid)
  end
  return readers
end
