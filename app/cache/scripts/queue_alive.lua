-- Is this ticket still queued or running (its marker names it and its entry is in the
-- stream)? Then, atomically, its lane stays schedulable: put back in the ring and among the
-- lanes if the LRU took it from there; and the idle engines' doorbell rung: "retry" (reclaim)
-- if an engine holds it untouched past the idle time (its holder lost its connection with a
-- fail-over, or could not finish it: engines reclaim only when told), else "1" if the bell
-- is silent (its rings lost with a fail-over or to the LRU: idle engines take when rung).
--
-- KEYS[1] the lane's stream  KEYS[2] the entry's marker  KEYS[3] the ring  KEYS[4] the lanes
-- KEYS[5] the idle engines' bell
-- ARGV[1] the ticket's id  ARGV[2] its lane  ARGV[3] consumer group  ARGV[4] idle time (ms)
-- Other keys: none.
--
-- Returns 1 (alive) or 0 (finished, dropped, or its marker or stream evicted).
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then return 0 end
if not redis.call('LPOS', KEYS[3], ARGV[2]) then redis.call('RPUSH', KEYS[3], ARGV[2]) end
redis.call('SADD', KEYS[4], ARGV[2])
local ok, held = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[3], ARGV[1], ARGV[1], 1)
if ok and #held > 0 then
  if tonumber(held[1][3]) > tonumber(ARGV[4]) then redis.call('LPUSH', KEYS[5], 'retry') end
elseif redis.call('LLEN', KEYS[5]) == 0 then
  redis.call('LPUSH', KEYS[5], '1')
end
return 1
