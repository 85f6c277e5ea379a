-- Submit a miss to the global queue, atomically: join the ticket already queued or running
-- for this entry key (its marker names it), else add one to its tenant's lane, bounded per
-- lane (per-engine max times the live engines, at least one: with none live the ticket
-- waits for an engine to start); a lane becoming active joins the ring at its head (it was
-- served least lately) and the lanes, with its share; and ring both doorbells (idle
-- engines', and busy engines' interjectors'; each holds a ring per live engine at most, one
-- with none) while fewer tickets than engines wait in the lane. Few commands: this runs
-- once per miss on the queue's one master.
--
-- KEYS[1] the lane's stream        KEYS[2] the live-engine register (sorted set)
-- KEYS[3] the entry's marker       KEYS[4] the ring of lanes with waiting tickets
-- KEYS[5] every lane with a stream KEYS[6] the lanes' shares (hash)
-- KEYS[7] the idle engines' bell   KEYS[8] the interjectors' bell
-- KEYS[9] the lanes' stream prefix (not a key: lane L's stream is KEYS[9] .. L)
-- ARGV[1] consumer group  ARGV[2] per-engine max  ARGV[3] live window (ms)
-- ARGV[4] marker life (ms)  ARGV[5] lane  ARGV[6] share  ARGV[7] the front's clock (ms:
-- engines report by their own clocks, all roughly in sync; no TIME command)
-- ARGV[8...] the ticket's fields (not its image: the front wrote it to its own key first)
-- Other keys: the other lanes' streams, KEYS[9] .. lane for each lane in KEYS[5], read only
-- to find a ticket joined in another lane (same hash tag).
--
-- Returns {id, waiting, engines, rings, busy}: rings, how many rings the idle engines' bell
-- holds unheard, this one's included (0: not rung; over 1: no engine listened since the last
-- ring, so all are busy); busy, the consumers holding this lane's tickets (engines busy with
-- it); or {id, -1, 0, lane} when it joined (the lane that holds
-- the ticket joined: a document job's page and a request for the same image share one
-- ticket whichever lane it waits in); id "" when the lane is full.
local current = redis.call('GET', KEYS[3])
if current then
  if #redis.call('XRANGE', KEYS[1], current, current) > 0 then
    return {current, -1, 0, ARGV[5]}
  end
  for _, other in ipairs(redis.call('SMEMBERS', KEYS[5])) do
    if other ~= ARGV[5] and #redis.call('XRANGE', KEYS[9] .. other, current, current) > 0 then
      return {current, -1, 0, other}
    end
  end
end
local now = tonumber(ARGV[7])
local engines = redis.call('ZCOUNT', KEYS[2], now - tonumber(ARGV[3]), '+inf')
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1])
if not ok then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
  pending = {0}
end
local waiting = redis.call('XLEN', KEYS[1]) - pending[1]
local room = math.max(1, engines)
if waiting >= tonumber(ARGV[2]) * room then return {'', waiting, engines} end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 8))
redis.call('SET', KEYS[3], id, 'PX', ARGV[4])
-- A lane with tickets waiting is in the ring already (a take drops only lanes with none; the
-- lanes' upkeep and the waiters' checks put back one the LRU took): its first one looks.
if waiting == 0 and not redis.call('LPOS', KEYS[4], ARGV[5]) then
  redis.call('LPUSH', KEYS[4], ARGV[5])
  redis.call('SADD', KEYS[5], ARGV[5])
  redis.call('HSET', KEYS[6], ARGV[5], ARGV[6])
end
-- With as many tickets waiting as engines, every engine was rung or is busy (and takes
-- again when its call ends): no ring.
local rings = 0
if waiting < room then
  for bell = 7, 8 do
    local held = redis.call('LPUSH', KEYS[bell], '1')
    if held > room then redis.call('LTRIM', KEYS[bell], 0, room - 1) end
    if bell == 7 then rings = held end
  end
end
local busy = type(pending[4]) == 'table' and #pending[4] or 0
return {id, waiting + 1, engines, rings, busy}
