-- append: add response events to requests' streams, for the current lease holders only (a
-- dispatcher whose lease was taken over cannot write), and each token chunk only once: a chunk
-- carries the position it brings its choice to (the choice's output tokens so far), and one at
-- or below the position already written is dropped (a migrated or revived writer that sends
-- tokens the client already has writes nothing). The writer is fenced too: the lease holder
-- names the one call that may write (writer.lua; a model replica appends its call's chunks
-- itself), so a replica it gave up on (frozen, then thawed) cannot write after the one that
-- took over. A chunk must also follow what its choice has: one that starts past the position
-- written (a Redis failover lost the chunks before it: replication is asynchronous) is refused
-- with "gap", and so is the rest of its entry; the dispatcher then reads the stream back and
-- has the tokens made again from where it stands. One call appends for a batch of requests (the chunks one engine step produced
-- for all of them); each entry is checked on its own.
-- KEYS: none passed. Reads fs:{t}:req:<id>; writes fs:{t}:stream:<id>, fs:{t}:req:<id>
--   (fields pos:<choice>, streamed).
-- ARGV: 2 number of entries n, then n groups: tenant, request id, holder id, attempt, writer
--   ('' when the holder writes itself and named no writer), number of events m, then m groups
--   of (event type, data, choice, position; position 0: unfenced, start: the position before
--   the chunk's tokens, -1: unchecked).
-- Returns a list of n replies, in order: {"ok" or "gap", last event id, cancel requested 0/1,
--   events dropped as already written} or {"stale", state or "missing"}.
local n = tonumber(ARGV[2])
local replies = {}
local b = 3
for e = 1, n do
  local t, rid, holder, attempt, writer = ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3],
    ARGV[b + 4]
  local m = tonumber(ARGV[b + 5])
  local first, after = b + 6, b + 6 + 5 * m
  local rk = key('request', t, rid)
  -- one read for the fences and every choice's position (a step brings one chunk per choice)
  local fields, slot = {'state', 'holder', 'deliveries', 'writer', 'cancel', 'streamed'}, {}
  for i = first, after - 1, 5 do
    local field = 'pos:' .. ARGV[i + 2]
    if tonumber(ARGV[i + 3]) > 0 and not slot[field] then
      fields[#fields + 1] = field
      slot[field] = #fields
    end
  end
  local v = redis.call('HMGET', rk, unpack(fields))
  if not (v[1] == 'leased' and v[2] == holder and v[3] == attempt) then
    replies[e] = {'stale', v[1] or 'missing'}
  elseif (v[4] or '') ~= writer then
    replies[e] = {'stale', 'another writer'}
  else
    local sk = key('stream', t, rid)
    local pos, streamed = {}, tonumber(v[6] or '0')
    for field, i in pairs(slot) do pos[field] = tonumber(v[i] or '0') end
    local last, dropped, moved, verdict = '', 0, false, 'ok'
    for i = first, after - 1, 5 do
      local position = tonumber(ARGV[i + 3])
      local field = 'pos:' .. ARGV[i + 2]
      if position > 0 and position <= pos[field] then
        dropped = dropped + 1
      elseif position > 0 and tonumber(ARGV[i + 4]) > pos[field] then
        verdict = 'gap'
        break
      else
        last = redis.call('XADD', sk, 'MAXLEN', '~', K.stream_max_events, '*', 'type', ARGV[i],
                          'data', ARGV[i + 1])
        if position > 0 then
          -- output tokens sent, all choices: what a request that dies later is charged
          streamed = streamed + position - pos[field]
          pos[field] = position
          moved = true
        end
      end
    end
    if moved then
      local writes = {'streamed', streamed}
      for field, position in pairs(pos) do
        writes[#writes + 1] = field
        writes[#writes + 1] = position
      end
      redis.call('HSET', rk, unpack(writes))
    end
    redis.call('EXPIRE', sk, K.stream_idle_ttl_s)
    replies[e] = {verdict, last, tonumber(v[5]), dropped}
  end
  b = after
end
return replies
