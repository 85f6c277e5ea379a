-- A document job's status changes, atomically, only from the statuses it may leave: start
-- (queued -> running), cancel (queued or running -> cancelled), end (running -> succeeded
-- or failed). Cancelling or ending drops its document; a job whose record is gone
-- (expired, evicted) is not written again. (Its place among its tenant's open jobs is
-- another hash tag's key: the caller removes it.)
--
-- KEYS[1] the job's record (hash)  KEYS[2] its document
-- ARGV[1] the new status  ARGV[2] now (Unix seconds)  ARGV[3] the error ("" none)
-- ARGV[4...] the statuses it may leave ("queued": no status written yet)
-- Other keys: none (both share the job id's hash tag).
--
-- Returns the status after ("" when the record is gone).
if redis.call('EXISTS', KEYS[1]) == 0 then return '' end
local current = redis.call('HGET', KEYS[1], 'status') or 'queued'
local may = false
for i = 4, #ARGV do
  if ARGV[i] == current then may = true end
end
if not may then return current end
local new = ARGV[1]
redis.call('HSET', KEYS[1], 'status', new)
if new == 'running' then
  redis.call('HSETNX', KEYS[1], 'started', ARGV[2])  -- a driver taking over keeps the first
else
  redis.call('HSET', KEYS[1], 'finished', ARGV[2], 'error', ARGV[3])
  redis.call('DEL', KEYS[2])
end
return new
