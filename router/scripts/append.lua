-- append: add response events to requests' streams, for the current lease holders only (a
-- dispatcher whose lease was taken over cannot write a duplicate token). One call appends for
-- a batch of requests (the chunks one engine step produced for all of them); each entry is
-- checked on its own.
-- KEYS: none passed. Reads fs:{t}:req:<id>; writes fs:{t}:stream:<id>.
-- ARGV: 2 number of entries n, then n groups: tenant, request id, holder id, attempt, number
--   of events m, then m pairs of (event type, data).
-- Returns a list of n replies, in order: {"ok", last event id, cancel requested 0/1} or
--   {"stale", state or "missing"}.
local n = tonumber(ARGV[2])
local replies = {}
local b = 3
for e = 1, n do
  local t, rid, holder, attempt = ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
  local m = tonumber(ARGV[b + 4])
  local first, after = b + 5, b + 5 + 2 * m
  local r = load_request(t, rid)
  if not lease_ok(r, holder, attempt) then
    replies[e] = {'stale', r and r.state or 'missing'}
  else
    local sk = key('stream', t, rid)
    local last = ''
    for i = first, after - 1, 2 do
      last = redis.call('XADD', sk, 'MAXLEN', '~', K.stream_max_events, '*', 'type', ARGV[i],
                        'data', ARGV[i + 1])
    end
    redis.call('EXPIRE', sk, K.stream_idle_ttl_s)
    replies[e] = {'ok', last, tonumber(r.cancel)}
  end
  b = after
end
return replies
