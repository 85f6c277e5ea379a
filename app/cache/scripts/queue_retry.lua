-- Hand a ticket its engine failed with an unexpected error back to the queue, atomically, for
-- another engine to run once more: only while another engine process is live. The ticket
-- stays pending, moved to a consumer no engine reports (its holder's name and ":handed"), so
-- the next reclaim of any other engine takes it as a dead holder's (``queue_stale.lua``),
-- counted as a second delivery (the failing process's own reclaim skips it for a while), and
-- the idle engines are woken to reclaim it now. Its idle time is set to the live window: the
-- least idle time a reclaim claims (two engines never both claim one ticket).
--
-- KEYS[1] the lane's stream  KEYS[2] the live-engine register  KEYS[3] the idle engines' bell
-- ARGV[1] consumer group  ARGV[2] the consumer holding it  ARGV[3] the ticket's id
-- ARGV[4] its idle time (ms)  ARGV[5] live window (ms)
-- ARGV[6] the failing process's consumer prefix (its engines are not "another")
-- Other keys: none.
--
-- Returns 1 (handed back) or 0 (no other live engine, or the ticket is gone).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[2], now - tonumber(ARGV[5]), '+inf')
local others = 0
for _, engine in ipairs(live) do
  if string.sub(engine, 1, #ARGV[6]) ~= ARGV[6] then others = others + 1 end
end
if others == 0 then return 0 end
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2]) == 0 then
  return 0  -- not its holder's any more (reclaimed meanwhile), or gone
end
local claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2] .. ':handed', 0, ARGV[3],
                           'IDLE', ARGV[4], 'JUSTID')
if #claimed == 0 then return 0 end
-- A ring for every live engine: the failing process's own idle engines may take some.
for _ = 1, #live do redis.call('LPUSH', KEYS[3], 'retry') end
redis.call('LTRIM', KEYS[3], 0, #live - 1)
return 1
