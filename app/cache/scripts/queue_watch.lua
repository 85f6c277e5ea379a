-- A front's fallback check on its waiting tickets of one lane, one call for all of them
-- (``app/queue/watch.py``): which are still in the lane's stream (queued or running)? Then,
-- atomically, if any is, the lane stays schedulable: put back in the ring and among the lanes
-- if the LRU took it from there; and the idle engines' doorbell rung: "retry" (reclaim) if a
-- ticket of the lane is held by an engine that stopped reporting (it died, or a fail-over
-- lost its report: engines reclaim only when told), else "1" if tickets wait untaken and the
-- bell is silent (its rings lost with a fail-over or to the LRU: idle engines take when rung).
--
-- KEYS[1] the lane's stream  KEYS[2] the ring  KEYS[3] the lanes  KEYS[4] the idle engines' bell
-- KEYS[5] the live-engine register  KEYS[6] the lanes' deficits (a lane put back is just active)
-- ARGV[1] the lane  ARGV[2] consumer group  ARGV[3] the register's cutoff (ms: a report older
-- is an engine gone)  ARGV[4] the interjectors' suffix (an engine's interjector lives while its
-- engine reports)
-- ARGV[5] the oldest id asked  ARGV[6] the newest  ARGV[7...] the ids asked
-- Other keys: none.
--
-- Returns {the ids asked that are still in the stream (finished, dropped, or evicted with the
-- stream: absent), state}: state 2, a holder of the lane's tickets is silent; 1, tickets wait
-- untaken; 0, neither (with queue shards, the front asks another shard for help on 1 and 2,
-- to reclaim on 2). One XRANGE over the asked ids' span, filtered here: the entries between
-- are other tickets of the same lane, a lane's length at most.
local asked = {}
for i = 7, #ARGV do asked[ARGV[i]] = true end
local present = {}
for _, entry in ipairs(redis.call('XRANGE', KEYS[1], ARGV[5], ARGV[6])) do
  if asked[entry[1]] then table.insert(present, entry[1]) end
end
if #present == 0 then return {present, 0} end
if not redis.call('LPOS', KEYS[2], ARGV[1]) then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[6], ARGV[1])
end
redis.call('SADD', KEYS[3], ARGV[1])
local held = 0
local ok, summary = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[2])
if ok and type(summary[4]) == 'table' then
  held = tonumber(summary[1])
  for _, holder in ipairs(summary[4]) do
    -- A holder is silent as queue_stale.lua's silent() has it: its engine (an interjector is
    -- its engine's name plus ARGV[4]) absent from the register, or its report older than ARGV[3].
    local engine = holder[1]
    if string.sub(engine, -#ARGV[4]) == ARGV[4] then engine = string.sub(engine, 1, -#ARGV[4] - 1) end
    local score = redis.call('ZSCORE', KEYS[5], engine)
    if not score or tonumber(score) < tonumber(ARGV[3]) then
      redis.call('LPUSH', KEYS[4], 'retry')
      return {present, 2}
    end
  end
end
local untaken = redis.call('XLEN', KEYS[1]) > held
if untaken and redis.call('LLEN', KEYS[4]) == 0 then redis.call('LPUSH', KEYS[4], '1') end
return {present, untaken and 1 or 0}
