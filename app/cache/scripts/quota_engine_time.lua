-- A tenant's engine seconds per minute, a GCRA over engine time on Redis's clock, atomically:
-- with a cost, the tenant's theoretical arrival time (TAT) moves on by it (spent after the
-- engine call, never refused); without one (0), only look how long until the TAT is within
-- the tolerance (a minute) again. The key expires once its TAT has passed.
--
-- KEYS[1] the tenant's engine-time TAT (microseconds)
-- ARGV[1] the cost in microseconds (0: only look)  ARGV[2] the tolerance (microseconds)
-- Other keys: none.
--
-- Returns the wait in ms (0: allowed).
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now) or now
if tat < now then tat = now end
local cost = tonumber(ARGV[1])
if cost <= 0 then
  local wait = tat - tonumber(ARGV[2]) - now
  if wait > 0 then return math.ceil(wait / 1000) end
  return 0
end
tat = tat + cost
redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
return 0
