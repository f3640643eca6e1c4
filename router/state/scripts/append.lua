-- append: add response events to requests' streams, for the current lease holders only (a
-- dispatcher whose lease was taken over cannot write), and each token chunk only once: a chunk
-- carries the position it brings its choice to (the choice's output tokens so far), and one at
-- or below the position already written is dropped (a migrated or revived writer that sends
-- tokens the client already has writes nothing). The writer is fenced too: the lease holder
-- names the one call that may write (writer.lua; a model replica appends its call's chunks
-- itself), so a replica it gave up on (frozen, then thawed) cannot write after the one that
-- took over. One call appends for a batch of requests (the chunks one engine step produced
-- for all of them); each entry is checked on its own.
-- KEYS: none passed. Reads fs:{t}:req:<id>; writes fs:{t}:stream:<id>, fs:{t}:req:<id>
--   (fields pos:<choice>, streamed).
-- ARGV: 2 number of entries n, then n groups: tenant, request id, holder id, attempt, writer
--   ('' when the holder writes itself and named no writer), number of events m, then m groups of (event type, data, choice, position; position 0: unfenced).
-- Returns a list of n replies, in order: {"ok", last event id, cancel requested 0/1, events
--   dropped as already written} or {"stale", state or "missing"}.
local n = tonumber(ARGV[2])
local replies = {}
local b = 3
for e = 1, n do
  local t, rid, holder, attempt, writer = ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3],
    ARGV[b + 4]
  local m = tonumber(ARGV[b + 5])
  local first, after = b + 6, b + 6 + 4 * m
  local r = load_request(t, rid)
  if not lease_ok(r, holder, attempt) then
    replies[e] = {'stale', r and r.state or 'missing'}
  elseif (r.writer or '') ~= writer then
    replies[e] = {'stale', 'another writer'}
  else
    local sk, rk = key('stream', t, rid), key('request', t, rid)
    local last, dropped = '', 0
    for i = first, after - 1, 4 do
      local position = tonumber(ARGV[i + 3])
      local field = 'pos:' .. ARGV[i + 2]
      local before = position > 0 and tonumber(redis.call('HGET', rk, field) or '0') or 0
      if position > 0 and position <= before then
        dropped = dropped + 1
      else
        last = redis.call('XADD', sk, 'MAXLEN', '~', K.stream_max_events, '*', 'type', ARGV[i],
                          'data', ARGV[i + 1])
        if position > 0 then
          redis.call('HSET', rk, field, position)
          -- output tokens sent, all choices: what a request that dies later is charged
          redis.call('HINCRBY', rk, 'streamed', position - before)
        end
      end
    end
    redis.call('EXPIRE', sk, K.stream_idle_ttl_s)
    replies[e] = {'ok', last, tonumber(r.cancel), dropped}
  end
  b = after
end
return replies
