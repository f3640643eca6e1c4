-- writer: the lease holder names the one call that may append to the request's stream from
-- now on (append.lua checks it): a replica call it starts, or '' (the holder itself, and no
-- call: what was written is now final, for the holder to read back before it migrates).
-- KEYS: none passed. Reads and writes fs:{t}:req:<id> (field writer).
-- ARGV: 2 tenant, 3 request id, 4 holder id, 5 attempt, 6 writer.
-- Returns {"ok", cancel requested 0/1} or {"stale", state or "missing"}.
local t, rid, holder, attempt, writer = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local r = load_request(t, rid)
if not lease_ok(r, holder, attempt) then return {'stale', r and r.state or 'missing'} end
redis.call('HSET', key('request', t, rid), 'writer', writer)
return {'ok', tonumber(r.cancel)}
