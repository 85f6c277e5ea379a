-- A document job's finished page, atomically: its answer recorded once (a driver that took
-- the job over may finish the same page again: the first answer stands), the job's count
-- of done or failed pages moved with it, and the job's keys kept for their TTL again. A job
-- whose record is gone (expired, evicted) is not written again.
--
-- KEYS[1] the job's pages (hash)  KEYS[2] the job's record (hash)  KEYS[3] its document
-- ARGV[1] the page's place in the job  ARGV[2] its answer (JSON)  ARGV[3] "done" or
-- "failed"  ARGV[4] the TTL (seconds)
-- Other keys: none (all three share the job id's hash tag).
--
-- Returns 1 (recorded), 0 (recorded before) or -1 (the job's record is gone).
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return 1
