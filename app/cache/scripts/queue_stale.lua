-- The tickets held by an engine that stopped reporting (its member of the live-engine
-- register older than ARGV[3], or gone: it died; or a name no engine reports, a ticket
-- handed back: ``queue_retry.lua``), and the orphans of the calling process (pending under
-- one of its consumers, ARGV[5] a prefix of their names, but not among the tickets its
-- engines run now, ARGV[6...]: a take whose answer a fail-over lost, a finish that failed),
-- in any lane, read atomically in one step over every
-- lane, at most ARGV[2] of them; and the engines of the register that stopped reporting and
-- hold no ticket, removed from it (an engine reporting in is how the others learn that one
-- died: ``heartbeat.py``). Whether a holder lives is its process's report, not the ticket's
-- idle time: a long call costs nothing to keep (no touching while it runs).
--
-- KEYS[1] the lanes  KEYS[2] the lanes' stream prefix (not a key: lane L's stream is
-- KEYS[2] .. L)  KEYS[3] the live-engine register
-- ARGV[1] consumer group  ARGV[2] how many at most
-- ARGV[3] the register's cutoff (ms, the engines' clock: a report older is an engine gone)
-- ARGV[4] the interjectors' suffix (an engine's interjector, ``{engine}-interject``, lives
-- while its engine reports)  ARGV[5] the calling process's consumers' prefix ("": none)
-- ARGV[6...] the tickets its engines run now
-- Other keys: every lane's stream, KEYS[2] .. lane for each lane in KEYS[1] (same hash tag).
--
-- Returns {lane, id, holder, deliveries, lane, id, ...}.
local out, found, most, cutoff = {}, 0, tonumber(ARGV[2]), tonumber(ARGV[3])
local holding, gone, running, own = {}, {}, {}, ARGV[5]
for i = 6, #ARGV do running[ARGV[i]] = true end
-- The same rule as queue_watch.lua's (Redis scripts share no code): keep the two alike.
local function silent(holder)
  local engine = holder
  if string.sub(holder, -#ARGV[4]) == ARGV[4] then engine = string.sub(holder, 1, -#ARGV[4] - 1) end
  if gone[engine] == nil then
    local score = redis.call('ZSCORE', KEYS[3], engine)
    gone[engine] = not score or tonumber(score) < cutoff
  end
  return gone[engine]
end
for _, lane in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local stream = KEYS[2] .. lane
  local ok, summary = pcall(redis.call, 'XPENDING', stream, ARGV[1])
  if ok and type(summary[4]) == 'table' then
    for _, holder in ipairs(summary[4]) do
      holding[holder[1]] = true
      local mine = #own > 0 and string.sub(holder[1], 1, #own) == own
      if found < most and (mine or silent(holder[1])) then
        local held = redis.call('XPENDING', stream, ARGV[1], '-', '+', most - found, holder[1])
        for _, entry in ipairs(held) do
          if not (mine and running[entry[1]]) then
            table.insert(out, lane); table.insert(out, entry[1])
            table.insert(out, entry[2]); table.insert(out, entry[4])
            found = found + 1
          end
        end
      end
    end
  end
end
for _, engine in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[3])) do
  if not holding[engine] then redis.call('ZREM', KEYS[3], engine) end
end
return out
