-- The tickets idle past the claim time in any lane (their holder stopped touching them: it
-- died), read atomically in one step over every lane, at most ARGV[3] of them; and the
-- engines of the live-engine register that stopped reporting (before ARGV[4]) and hold no
-- ticket, removed from it (an engine reporting in is how the others learn that one died:
-- ``heartbeat.py``).
--
-- KEYS[1] the lanes  KEYS[2] the lanes' stream prefix (not a key: lane L's stream is
-- KEYS[2] .. L)  KEYS[3] the live-engine register
-- ARGV[1] consumer group  ARGV[2] idle time (ms)  ARGV[3] how many at most
-- ARGV[4] the register's cutoff (ms, the engines' clock: a report older is an engine gone)
-- Other keys: every lane's stream, KEYS[2] .. lane for each lane in KEYS[1] (same hash tag).
--
-- Returns {lane, id, holder, deliveries, lane, id, ...}.
local out, found, holding = {}, 0, {}
for _, lane in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local stream = KEYS[2] .. lane
  local ok, summary = pcall(redis.call, 'XPENDING', stream, ARGV[1])
  if ok and type(summary[4]) == 'table' then
    for _, holder in ipairs(summary[4]) do holding[holder[1]] = true end
    if found < tonumber(ARGV[3]) then
      local stale = redis.call('XPENDING', stream, ARGV[1], 'IDLE', ARGV[2], '-', '+',
                               tonumber(ARGV[3]) - found)
      for _, entry in ipairs(stale) do
        table.insert(out, lane); table.insert(out, entry[1])
        table.insert(out, entry[2]); table.insert(out, entry[4])
        found = found + 1
      end
    end
  end
end
for _, engine in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[4])) do
  if not holding[engine] then redis.call('ZREM', KEYS[3], engine) end
end
return out
