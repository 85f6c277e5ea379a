-- Record one pointer of the pixel index, atomically: set the field, keep the bucket at most
-- ARGV[4] fields (ARGV[5] random ones go when it is over, never this one) and alive at least
-- as long as its newest pointer.
--
-- KEYS[1] the bucket (hash)
-- ARGV[1] the field  ARGV[2] the pointer  ARGV[3] its life (ms)  ARGV[4] most fields
-- ARGV[5] how many to drop when over
-- Other keys: none.
--
-- Returns 1.
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if redis.call('HLEN', KEYS[1]) > tonumber(ARGV[4]) then
  for _, field in ipairs(redis.call('HRANDFIELD', KEYS[1], tonumber(ARGV[5]))) do
    if field ~= ARGV[1] then redis.call('HDEL', KEYS[1], field) end
  end
end
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return 1
