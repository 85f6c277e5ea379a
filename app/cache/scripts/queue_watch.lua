-- A front's fallback check on its waiting tickets of one lane, one call for all of them
-- (``app/queue/watch.py``): which are still in the lane's stream (queued or running)? Then,
-- atomically, if any is, the lane stays schedulable: put back in the ring and among the lanes
-- if the LRU took it from there; and the idle engines' doorbell rung: "retry" (reclaim) if an
-- engine holds a ticket of the lane untouched past the idle time (its holder lost its
-- connection with a fail-over, or died: engines reclaim only when told), else "1" if tickets
-- wait untaken and the bell is silent (its rings lost with a fail-over or to the LRU: idle
-- engines take when rung).
--
-- KEYS[1] the lane's stream  KEYS[2] the ring  KEYS[3] the lanes  KEYS[4] the idle engines' bell
-- ARGV[1] the lane  ARGV[2] consumer group  ARGV[3] idle time (ms)
-- ARGV[4] the oldest id asked  ARGV[5] the newest  ARGV[6...] the ids asked
-- Other keys: none.
--
-- Returns the ids asked that are still in the stream (finished, dropped, or evicted with the
-- stream: absent). One XRANGE over the asked ids' span, filtered here: the entries between
-- are other tickets of the same lane, a lane's length at most.
local asked = {}
for i = 6, #ARGV do asked[ARGV[i]] = true end
local present = {}
for _, entry in ipairs(redis.call('XRANGE', KEYS[1], ARGV[4], ARGV[5])) do
  if asked[entry[1]] then table.insert(present, entry[1]) end
end
if #present == 0 then return present end
if not redis.call('LPOS', KEYS[2], ARGV[1]) then redis.call('RPUSH', KEYS[2], ARGV[1]) end
redis.call('SADD', KEYS[3], ARGV[1])
local ok, stale = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[2], 'IDLE', ARGV[3], '-', '+', 1)
if ok and #stale > 0 then
  redis.call('LPUSH', KEYS[4], 'retry')
  return present
end
local held = 0
local ok_summary, summary = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[2])
if ok_summary then held = tonumber(summary[1]) end
if redis.call('XLEN', KEYS[1]) > held and redis.call('LLEN', KEYS[4]) == 0 then
  redis.call('LPUSH', KEYS[4], '1')
end
return present
