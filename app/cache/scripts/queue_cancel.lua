-- Withdraw a ticket no engine has read yet, atomically: deleted from its stream, and its
-- marker (and image, when given) removed if the marker still names it; a ticket already
-- delivered is left alone (it runs or has run).
--
-- KEYS[1] the lane's stream  KEYS[2] the entry's marker  KEYS[3] (optional) its image
-- ARGV[1] consumer group  ARGV[2] the ticket's id
-- Other keys: none.
--
-- Returns 1 (deleted) or 0 (left: delivered, or already gone).
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if ok and #p > 0 then return 0 end
if redis.call('GET', KEYS[2]) == ARGV[2] then redis.call('DEL', unpack(KEYS, 2)) end
return redis.call('XDEL', KEYS[1], ARGV[2])
