-- key_revoke: delete one API key of a tenant; the next request with it is refused.
-- KEYS: none passed. Reads and writes fs:{t}:keys, fs:apikey:<digest>.
-- ARGV: 2 tenant, 3 key id.
-- Returns {"ok"} or {"missing"}.
local t, key_id = ARGV[2], ARGV[3]
local digest = redis.call('HGET', key('api_keys', t), key_id)
if not digest then return {'missing'} end
redis.call('DEL', key('api_key', digest))
redis.call('HDEL', key('api_keys', t), key_id)
return {'ok'}
