-- Take one of a tenant's misses-in-flight slots, atomically, on Redis's clock: the expired
-- slots (a killed worker's, past their deadline) are dropped first, then a slot is added
-- unless the limit is reached. The set lives a second longer than its newest slot.
--
-- KEYS[1] the tenant's slots (sorted set, scored by when each expires, ms)
-- ARGV[1] the limit  ARGV[2] a slot's life (ms)  ARGV[3] the slot's name
-- Other keys: none.
--
-- Returns 1 (taken) or 0 (full).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) + 1000)
return 1
