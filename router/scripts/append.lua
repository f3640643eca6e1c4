-- append: add response events to a request's stream, for the current lease holder only (a
-- dispatcher whose lease was taken over cannot write a duplicate token).
-- KEYS: none passed. Reads fs:{t}:req:<id>; writes fs:{t}:stream:<id>.
-- ARGV: 2 tenant, 3 request id, 4 holder id, 5 attempt, then pairs of (event type, data).
-- Returns {"ok", last event id, cancel requested 0/1} or {"stale", state or "missing"}.
local t, rid, holder, attempt = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local r = load_request(t, rid)
if not lease_ok(r, holder, attempt) then return {'stale', r and r.state or 'missing'} end
local sk = key('stream', t, rid)
local last = ''
for i = 6, #ARGV, 2 do
  last = redis.call('XADD', sk, 'MAXLEN', '~', K.stream_max_events, '*', 'type', ARGV[i],
                    'data', ARGV[i + 1])
end
redis.call('EXPIRE', sk, K.stream_idle_ttl_s)
return {'ok', last, tonumber(r.cancel)}
