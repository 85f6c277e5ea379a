-- An engine reports in, atomically: scored in the live-engine register at Redis's clock
-- (which lives four claim times past the last report), and every lane's waiting tickets
-- read. A lane with tickets waiting is put back in the ring if the LRU took it from there;
-- a lane with no stream entries left and out of the ring is forgotten.
--
-- KEYS[1] the live-engine register  KEYS[2] the lanes  KEYS[3] the ring
-- KEYS[4] the lanes' stream prefix (not a key: lane L's stream is KEYS[4] .. L)
-- ARGV[1] this engine's consumer  ARGV[2] the register's life (ms)  ARGV[3] consumer group
-- Other keys: every lane's stream, KEYS[4] .. lane for each lane in KEYS[2] (same hash tag).
--
-- Returns {lane, waiting, lane, waiting, ...} for every lane kept.
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local out = {}
for _, lane in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local stream = KEYS[4] .. lane
  local length = redis.call('XLEN', stream)
  local ok, pending = pcall(redis.call, 'XPENDING', stream, ARGV[3])
  local waiting = length - (ok and pending[1] or 0)
  local ringed = redis.call('LPOS', KEYS[3], lane)
  if length == 0 and not ringed then
    redis.call('SREM', KEYS[2], lane)
  else
    if waiting > 0 and not ringed then redis.call('RPUSH', KEYS[3], lane) end
    table.insert(out, lane)
    table.insert(out, waiting)
  end
end
return out
