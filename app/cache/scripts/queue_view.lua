-- The queue as it stands, read in one atomic step and written nowhere (app/queue/inspect.py:
-- `ocr-cache queue`, GET /admin/queue, the queue's gauges). For every lane (those in KEYS[2]
-- and in the ring): its stream's length, its running tickets (the consumer group's pending
-- entries: how many each consumer holds, and up to ARGV[2] of them one by one), the id of
-- its oldest waiting ticket (the first entry past the group's last delivered one; an id is
-- its enqueue time in ms), its deficit, share and mean cost; and the live-engine register.
-- A script so that the picture is of one instant and no image bytes leave Redis.
--
-- KEYS[1] the live-engine register  KEYS[2] the lanes  KEYS[3] the ring
-- KEYS[4] the deficits (hash)  KEYS[5] the shares (hash)  KEYS[6] the mean costs (hash)
-- KEYS[7] the lanes' stream prefix (not a key: lane L's stream is KEYS[7] .. L)
-- ARGV[1] consumer group  ARGV[2] running tickets listed per lane at most (0: counts only)
-- Other keys: every lane's stream, KEYS[7] .. lane for each lane in KEYS[2] and KEYS[3]
-- (same hash tag).
--
-- Returns {now (ms, Redis' clock), {engine, last report (ms), ...}, {the ring's lanes},
-- {row, ...}}, a row per lane (sorted): {lane, length, running, oldest waiting id or "",
-- deficit or "", share or "", cost or "", {consumer, tickets, ...},
-- {id, consumer, idle ms, deliveries, ...}}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local group, most = ARGV[1], tonumber(ARGV[2]) or 0
local ring = redis.call('LRANGE', KEYS[3], 0, -1)
local lanes, seen = {}, {}
for _, lane in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if not seen[lane] then seen[lane] = true; table.insert(lanes, lane) end
end
for _, lane in ipairs(ring) do
  if not seen[lane] then seen[lane] = true; table.insert(lanes, lane) end
end
table.sort(lanes)
-- The group's last delivered id: what follows it waits ("-": no group, everything waits).
local function delivered(stream)
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local name, last = nil, nil
    for i = 1, #info, 2 do
      if info[i] == 'name' then name = info[i + 1] end
      if info[i] == 'last-delivered-id' then last = info[i + 1] end
    end
    if name == group and last then return '(' .. last end
  end
  return '-'
end
local rows = {}
for _, lane in ipairs(lanes) do
  local stream = KEYS[7] .. lane
  local length = redis.call('XLEN', stream)
  local running, holders, held, after = 0, {}, {}, '-'
  local ok, summary = pcall(redis.call, 'XPENDING', stream, group)
  if ok then
    running = summary[1]
    if type(summary[4]) == 'table' then
      for _, holder in ipairs(summary[4]) do
        table.insert(holders, holder[1])
        table.insert(holders, holder[2])
      end
    end
    if most > 0 and running > 0 then
      for _, e in ipairs(redis.call('XPENDING', stream, group, '-', '+', most)) do
        for i = 1, 4 do table.insert(held, e[i]) end
      end
    end
    after = delivered(stream)
  end
  local oldest = ''
  if length > running then
    local first = redis.call('XRANGE', stream, after, '+', 'COUNT', 1)
    if first[1] then oldest = first[1][1] end
  end
  table.insert(rows, {lane, length, running, oldest,
                      redis.call('HGET', KEYS[4], lane) or '',
                      redis.call('HGET', KEYS[5], lane) or '',
                      redis.call('HGET', KEYS[6], lane) or '', holders, held})
end
return {now, redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'), ring, rows}
