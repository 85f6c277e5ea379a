-- Free an entry key of a failed ticket, atomically: its marker (and image, when given) is
-- removed only if it still names that ticket (a newer ticket's are left alone).
--
-- KEYS[1] the entry's marker  KEYS[2] (optional) its image
-- ARGV[1] the ticket's id
-- Other keys: none.
--
-- Returns 1 (removed) or 0.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', unpack(KEYS))
return 1
