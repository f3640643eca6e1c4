-- key_create: store a new API key of a tenant, as its SHA-256 digest only.
-- KEYS: none passed. Reads fs:{t}:tenant; writes fs:apikey:<digest>, fs:{t}:keys.
-- ARGV: 2 tenant, 3 key id, 4 digest (hex), 5 label.
-- Returns {"ok"} or {"missing"} (no such tenant) or {"exists"} (digest or key id taken).
local t, key_id, digest, label = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if redis.call('EXISTS', key('tenant', t)) == 0 then return {'missing'} end
local ak = key('api_key', digest)
if redis.call('EXISTS', ak) == 1 or redis.call('HEXISTS', key('api_keys', t), key_id) == 1 then
  return {'exists'}
end
redis.call('HSET', ak, 'tenant', t, 'key_id', key_id, 'digest', digest, 'label', label,
           'created_ms', clock_ms())
redis.call('HSET', key('api_keys', t), key_id, digest)
return {'ok'}
