-- key_revoke: delete one API key of a tenant; the next request with it is refused.
-- KEYS: none passed. Reads and writes fs:{t}:keys, fs:apikey:<digest>.
-- ARGV: 3 tenant, 4 key id.
-- Returns {"ok"} or {"missing"}.
local t, key_id = ARGV[3], ARGV[4]
local digest = redis.call('HGET', key('api_keys', t), key_id)
if not digest then return {'missing'} end
redis.call('DEL', key('api_key', digest))
redis.call('HDEL', key('api_keys', t), key_id)
return {'ok'}
