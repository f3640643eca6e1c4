-- tenant_put: create or replace a tenant's settings; a tenant with backlog that changes
-- priority class moves to its new class keeping its place in line (see move_class).
-- KEYS: none passed. Writes fs:tenants, fs:{t}:tenant; may move fs:{sched}:ready:<class>,
--   fs:{sched}:classes (of each pool, fs:{sched}:pools).
-- ARGV: 2 tenant, 3 settings JSON (field -> value; absent fields are unlimited/unset),
--   4 "create" (refuse if it exists), "update" (refuse if missing) or "upsert".
-- Returns {"ok", "created" or "updated"} or {"exists"} or {"missing"}.
local t, settings, mode = ARGV[2], cjson.decode(ARGV[3]), ARGV[4]
local tk = key('tenant', t)
local exists = redis.call('EXISTS', tk) == 1
if mode == 'create' and exists then return {'exists'} end
if mode == 'update' and not exists then return {'missing'} end
local old = tonumber(redis.call('HGET', tk, 'priority') or '0') or 0
redis.call('DEL', tk)
local args = {}
for field, value in pairs(settings) do
  args[#args + 1] = field
  args[#args + 1] = tostring(value)
end
redis.call('HSET', tk, unpack(args))
redis.call('SADD', K.tenants, t)
local new = tonumber(settings.priority or 0)
if new ~= old then
  for _, pool in ipairs(all_pools()) do move_class(t, old, new, pool) end
end
return {'ok', exists and 'updated' or 'created'}
