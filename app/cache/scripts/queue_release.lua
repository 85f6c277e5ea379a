-- Free an entry key of a failed ticket, atomically: its marker is removed only if it still
-- names that ticket (a newer ticket's marker is left alone).
--
-- KEYS[1] the entry's marker
-- ARGV[1] the ticket's id
-- Other keys: none.
--
-- Returns 1 (removed) or 0.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
