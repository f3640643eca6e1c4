-- adapter_put: add (or repoint) a LoRA adapter registered at run time, within the bound: a new
-- name is refused once K.max_adapters are registered (the count and the write in one step,
-- however many operators add at once).
-- KEYS: none passed. Reads and writes fs:adapters.
-- ARGV: 2 adapter name, 3 its record (JSON, router/state/adapters.py).
-- Returns {"ok"} or {"full"}.
local name, record = ARGV[2], ARGV[3]
if redis.call('HEXISTS', K.adapters, name) == 0 and
    redis.call('HLEN', K.adapters) >= tonumber(K.max_adapters) then
  return {'full'}
end
redis.call('HSET', K.adapters, name, record)
return {'ok'}
