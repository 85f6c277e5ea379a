-- One request against a client's rate limit, GCRA on Redis's clock, atomically: allowed when
-- max(TAT, now) - now is within the tolerance B/R, and then (unless only looking) the TAT
-- moves on by the emission interval 1/R. The key expires once its TAT has passed.
-- Numbers are written with %.0f: Lua's tostring keeps 14 digits, a TAT has 16.
--
-- KEYS[1] the client's TAT (microseconds on Redis's clock)
-- ARGV[1] the emission interval (microseconds)  ARGV[2] the tolerance (microseconds)
-- ARGV[3] "1" to only look (no cell spent)
-- Other keys: none.
--
-- Returns {1, 0} (allowed) or {0, wait in ms}.
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now) or now
if tat < now then tat = now end
local wait = tat - tolerance - now
if wait > 0 then return {0, math.ceil(wait / 1000)} end
if ARGV[3] == '1' then return {1, 0} end
tat = tat + interval
redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
return {1, 0}
