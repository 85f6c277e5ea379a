-- The tickets idle past the claim time in any lane (their holder stopped touching them: it
-- died), read atomically in one step over every lane, at most ARGV[3] of them. Reads only.
--
-- KEYS[1] the lanes
-- KEYS[2] the lanes' stream prefix (not a key: lane L's stream is KEYS[2] .. L)
-- ARGV[1] consumer group  ARGV[2] idle time (ms)  ARGV[3] how many at most
-- Other keys: every lane's stream, KEYS[2] .. lane for each lane in KEYS[1] (same hash tag).
--
-- Returns {lane, id, holder, deliveries, lane, id, ...}.
local out, found = {}, 0
for _, lane in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local ok, stale = pcall(redis.call, 'XPENDING', KEYS[2] .. lane, ARGV[1], 'IDLE', ARGV[2],
                          '-', '+', tonumber(ARGV[3]) - found)
  if ok then
    for _, entry in ipairs(stale) do
      table.insert(out, lane); table.insert(out, entry[1])
      table.insert(out, entry[2]); table.insert(out, entry[4])
      found = found + 1
    end
  end
  if found >= tonumber(ARGV[3]) then break end
end
return out
