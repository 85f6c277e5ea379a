-- Done with these tickets of one lane, atomically: acknowledged and deleted, their markers
-- (and images, when given) removed if the markers still name them, the lane's deficit
-- corrected from what they were charged to what they really cost (if they were charged, and
-- the lane still has one), and its mean ticket cost moved towards theirs (an average over about 5: the next
-- tickets' charge).
--
-- KEYS[1] the lane's stream  KEYS[2] the deficits (hash)  KEYS[3] the mean costs (hash)
-- KEYS[4...] each ticket's marker, in the order of the ids; then, optionally, each one's image
-- (a newer ticket of the same image needs it: removed only with its ticket's marker)
-- ARGV[1] consumer group  ARGV[2] the lane  ARGV[3] charged (seconds, all the tickets;
-- negative: not charged, taken from a lane alone, whose deficit was dropped)
-- ARGV[4] spent (seconds, all the tickets)  ARGV[5] how many ran  ARGV[6...] the ids
-- Other keys: none.
--
-- Returns how many entries were deleted.
local n = #ARGV - 5
local images = #KEYS >= 3 + 2 * n
for i = 1, n do
  if redis.call('GET', KEYS[i + 3]) == ARGV[i + 5] then
    if images then redis.call('DEL', KEYS[i + 3], KEYS[i + 3 + n])
    else redis.call('DEL', KEYS[i + 3]) end
  end
end
local charged, spent, ran = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if charged >= 0 and spent ~= charged and redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then
  redis.call('HINCRBYFLOAT', KEYS[2], ARGV[2], string.format('%.6f', charged - spent))
end
if ran > 0 then
  local sample = spent / ran
  local mean = tonumber(redis.call('HGET', KEYS[3], ARGV[2]) or '')
  if mean then sample = 0.8 * mean + 0.2 * sample end
  redis.call('HSET', KEYS[3], ARGV[2], string.format('%.6f', sample))
end
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 6))
return redis.call('XDEL', KEYS[1], unpack(ARGV, 6))
