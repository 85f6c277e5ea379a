-- The lanes' upkeep, atomically, by an engine process now and then (``heartbeat.py``): every
-- lane's waiting tickets read; a lane with tickets waiting is put back in the ring if the
-- LRU took it from there (just active: no deficit); a lane with no stream entries left and
-- out of the ring is forgotten; a lane out of the ring keeps no deficit; and, if tickets
-- wait while the idle engines' doorbell is silent (its rings lost: the LRU took the list),
-- it is rung once.
--
-- KEYS[1] the lanes  KEYS[2] the ring  KEYS[3] the idle engines' bell
-- KEYS[4] the lanes' stream prefix (not a key: lane L's stream is KEYS[4] .. L)
-- KEYS[5] the lanes' deficits (hash)
-- ARGV[1] consumer group
-- Other keys: every lane's stream, KEYS[4] .. lane for each lane in KEYS[1] (same hash tag).
--
-- Returns {lane, waiting, lane, waiting, ...} for every lane kept.
local out, total = {}, 0
for _, lane in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local stream = KEYS[4] .. lane
  local length = redis.call('XLEN', stream)
  local ok, pending = pcall(redis.call, 'XPENDING', stream, ARGV[1])
  local waiting = length - (ok and pending[1] or 0)
  local ringed = redis.call('LPOS', KEYS[2], lane)
  if length == 0 and not ringed then
    redis.call('SREM', KEYS[1], lane)
  else
    if waiting > 0 and not ringed then
      redis.call('RPUSH', KEYS[2], lane)
      redis.call('HDEL', KEYS[5], lane)
    end
    table.insert(out, lane)
    table.insert(out, waiting)
    total = total + waiting
  end
end
if total > 0 and redis.call('LLEN', KEYS[3]) == 0 then redis.call('LPUSH', KEYS[3], '1') end
-- A deficit of a lane out of the ring was left by a ring the LRU took (a lane leaves the ring
-- with its deficit dropped otherwise): dropped, so the lane rejoins just active.
local ringed = {}
for _, lane in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do ringed[lane] = true end
for _, lane in ipairs(redis.call('HKEYS', KEYS[5])) do
  if not ringed[lane] then redis.call('HDEL', KEYS[5], lane) end
end
return out
