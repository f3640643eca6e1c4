-- admit: accept one request into its tenant's queue, or refuse it, atomically.
-- KEYS: none passed (standalone Redis; see router/state/keys.py). Reads fs:{t}:tenant, fs:{t}:state,
--   fs:{t}:queue, fs:{t}:budget:<day>, fs:{t}:req:<id>; writes fs:{t}:req:<id>, fs:{t}:queue,
--   fs:{t}:state (GCRA times, queued_cost, open_stream), fs:{t}:budget:<day>, fs:{t}:stats, fs:{sched}:ready:<class>,
--   fs:{sched}:classes.
-- ARGV: 2 tenant, 3 request id, 4 prompt tokens, 5 max_tokens (per choice), 6 expected output
--   tokens (per choice), 7 body (opaque), 8 meta (opaque), 9 retry-after ms when the queue is
--   full, 10 choices (n; the output is reserved and costed n times, the prompt once), 11 the
--   id of the client's reader (its stream, or its wait for the answer; "" for none) and 12 its
--   lease end (ms): the admitted request is attached to it, counted against max_streams, 13 "1"
--   when the id comes from an Idempotency-Key (its body's digest is kept K.idempotency_ttl_s,
--   longer than the record), 14 the model the request names ("" for none): refused unless the
--   tenant's `models` (a comma-separated allow-list) is absent or lists it, 15 the pool (the
--   model's queues; "" or absent: the default model's) the request waits in: max_queued counts
--   the tenant's requests in that pool.
-- Returns one of (L: the tenant's limiters after the verdict, for the rate-limit headers:
--   {rpm, rpm TAT, tpm, tpm TAT, daily_tokens, tokens used today, now ms}, "" where no limit)
--   {"admitted", queue depth after the push, L}
--   {"duplicate", state}                  the id is known and its body is the same: no second copy
--   {"conflict", state}                   the id is known with another body
--   {"expired"}                           the id's request ended and its record expired
--   {"refused", reason, retry-after ms, L} reason: disabled, queue_full, streams, rpm, tpm,
--                                         daily_budget
--   {"too_large", reason, limit}          the request alone exceeds max_tokens, tpm or daily_budget
--   {"model"}                             the tenant may not use that model
-- Errors: FSNOTFOUND tenant, FSSTORED (malformed tenant settings or limiter state).
local t, rid = ARGV[2], ARGV[3]
local prompt, max_tokens, expected = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local body, meta, full_retry_ms = ARGV[7], ARGV[8], tonumber(ARGV[9])
local choices = tonumber(ARGV[10] or '1')
local reader = ARGV[11] or ''
local now = clock_ms()

local rk = key('request', t, rid)
local digest = redis.sha1hex(body)
local known = redis.call('HMGET', rk, 'state', 'body_sha1')
if known[1] then
  if known[2] ~= digest then return {'conflict', known[1]} end
  return {'duplicate', known[1]}
end
local ik = ARGV[13] == '1' and key('idempotency', t, rid)
if ik then
  local seen = redis.call('GET', ik)
  if seen then
    if seen ~= digest then return {'conflict', 'expired'} end
    return {'expired'}
  end
end

local tenant, err = load_tenant(t, true)
if not tenant then return err end
if tenant.disabled then return {'refused', 'disabled', 0} end
local model = ARGV[14] or ''
if model ~= '' then
  local allowed = redis.call('HGET', key('tenant', t), 'models')
  if allowed and not string.find(',' .. allowed .. ',', ',' .. model .. ',', 1, true) then
    return {'model'}
  end
end
local reserved = prompt + choices * max_tokens
if tenant.max_tokens and max_tokens > tenant.max_tokens then
  return {'too_large', 'max_tokens', tenant.max_tokens}
end
if tenant.tpm and reserved > tenant.tpm then return {'too_large', 'tpm', tenant.tpm} end
if tenant.daily_tokens and reserved > tenant.daily_tokens then
  return {'too_large', 'daily_budget', tenant.daily_tokens}
end

local sk = key('state', t)
local st = redis.call('HMGET', sk, 'rpm_tat', 'tpm_tat')
local rpm_tat, tpm_tat = tonumber(st[1] or '0'), tonumber(st[2] or '0')
if rpm_tat == nil then return redis.error_reply('FSSTORED ' .. sk .. ' rpm_tat') end
if tpm_tat == nil then return redis.error_reply('FSSTORED ' .. sk .. ' tpm_tat') end
local day = math.floor(now / DAY_MS)
local bk = key('budget', t, day)
local used = tonumber(redis.call('GET', bk) or '0')
if used == nil then return redis.error_reply('FSSTORED ' .. bk .. ' value') end

-- Each limit that says no, with the time until it would say yes; the longest wait wins.
local reason, retry_ms = nil, 0
local function refuse(why, wait_ms)
  if wait_ms > retry_ms or reason == nil then reason, retry_ms = why, wait_ms end
end
local pool = ARGV[15] or ''
if redis.call('LLEN', queue_key(t, pool)) >= (tenant.max_queued or math.huge) then
  refuse('queue_full', full_retry_ms)
end
if reader ~= '' and tenant.max_streams and
    tonumber(redis.call('HGET', sk, 'open_stream') or '0') >= tenant.max_streams then
  refuse('streams', tonumber(K.reader_retry_ms))
end
-- GCRA: a limit of N per minute allows a burst of N, then one every 60000/N ms.
local new_rpm_tat, new_tpm_tat
if tenant.rpm then
  new_rpm_tat = math.max(rpm_tat, now) + 60000 / tenant.rpm
  if new_rpm_tat - now > 60000 then refuse('rpm', new_rpm_tat - 60000 - now) end
end
if tenant.tpm then
  new_tpm_tat = math.max(tpm_tat, now) + reserved * 60000 / tenant.tpm
  if new_tpm_tat - now > 60000 then refuse('tpm', new_tpm_tat - 60000 - now) end
end
if tenant.daily_tokens and used + reserved > tenant.daily_tokens then
  refuse('daily_budget', (day + 1) * DAY_MS - now)
end
local function limiters(rpm_at, tpm_at, used_now)
  return {tenant.rpm and fmt(tenant.rpm) or '', fmt(rpm_at), tenant.tpm and fmt(tenant.tpm) or '',
          fmt(tpm_at), tenant.daily_tokens and fmt(tenant.daily_tokens) or '', fmt(used_now),
          fmt(now)}
end
if reason then
  stat(t, 'refused_' .. reason)
  usage(t, model, {['refused_' .. reason] = 1})
  return {'refused', reason, math.ceil(retry_ms), limiters(rpm_tat, tpm_tat, used)}
end

if new_rpm_tat then redis.call('HSET', sk, 'rpm_tat', fmt(new_rpm_tat)) end
if new_tpm_tat then redis.call('HSET', sk, 'tpm_tat', fmt(new_tpm_tat)) end
redis.call('INCRBY', bk, reserved)
redis.call('EXPIRE', bk, K.budget_ttl_s)
redis.call('HSET', rk, 'tenant', t, 'id', rid, 'state', 'queued', 'body', body, 'body_sha1', digest,
           'meta', meta, 'prompt_tokens', prompt, 'max_tokens', max_tokens,
           'cost', prompt + choices * expected, 'reserved', reserved, 'day', day, 'priority', tenant.priority,
           'created_ms', now, 'deliveries', 0, 'cancel', 0)
if pool ~= '' then redis.call('HSET', rk, 'pool', pool) end
if model ~= '' then redis.call('HSET', rk, 'model', model) end
local depth = redis.call('RPUSH', queue_key(t, pool), rid)
queued_cost(t, prompt + choices * expected, pool)
redis.call('HSET', rk, 'admit_depth', depth)
mark_ready(t, tenant.priority, pool)
stat(t, 'admitted')
if reader ~= '' then attach_reader(t, rid, tenant, reader, 'stream', tonumber(ARGV[12])) end
if ik then redis.call('SET', ik, digest, 'EX', K.idempotency_ttl_s) end
return {'admitted', depth, limiters(new_rpm_tat or rpm_tat, new_tpm_tat or tpm_tat,
                                    used + reserved)}
