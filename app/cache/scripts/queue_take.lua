-- The lane scheduler: deficit round robin over engine time, in one atomic step shared by
-- every worker and replica (app/engine_side/scheduler.py tells the rules). Takes up to ARGV[3]
-- tickets of one lane for this consumer (XREADGROUP), charges the lane its mean ticket cost
-- per ticket, and writes the ring back in its new order.
-- To interject (ARGV[5], the live-engine window in ms; "" otherwise): only while every live
-- engine is busy, a ticket of the lane with the most credit among those that may pause the
-- call: lanes with nothing running but, at most, the call it would pause (all of that
-- lane's running tickets held by the paused engine's consumer, ARGV[7], in a call of that
-- lane alone, ARGV[6], while another lane has a ticket running). A lane that may not (it
-- runs elsewhere) is passed over, not waited for: it holds engines already, and its banked
-- credit would otherwise keep a lane with credit and nothing running waiting for a whole
-- call. A lane in debt still waits its turn, and a document job's lane never interjects.
-- Else nothing, and the ring is left as it was; and, told to pass (ARGV[8]), each lane owed a
-- turn that this engine may not serve but whose running tickets one engine alone holds has
-- that engine's interjector rung (its own bell, once: it may pause its call for its lane;
-- a ring heard on the shared bell reached one interjector, maybe not that one).
--
-- KEYS[1] the ring  KEYS[2] the deficits (hash)  KEYS[3] the shares (hash)
-- KEYS[4] the mean costs (hash)  KEYS[5] the live-engine register  KEYS[6] the lanes
-- KEYS[7] the lanes' stream prefix (not a key: lane L's stream is KEYS[7] .. L)
-- KEYS[8] the engines' own interjector bells' prefix (not a key: engine E's is KEYS[8] .. E)
-- ARGV[1] consumer group  ARGV[2] consumer  ARGV[3] how many at most
-- ARGV[4] a ticket's cost where a lane has none yet (this engine's mean call, seconds)
-- ARGV[5] interjection's live window (ms) or ""  ARGV[6] the lane of the call to pause
-- ("": several)  ARGV[7] the consumer of the engine to pause  ARGV[8] "1": pass a ring on
-- Other keys: every lane's stream, KEYS[7] .. lane for each lane in KEYS[1] and KEYS[6];
-- an engine's own bell, KEYS[8] .. engine (same hash tag).
--
-- Returns {lane, {entries}, what each was charged} or {} when no lane has one to give.
local ring, deficits, shares, costs = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local prefix = KEYS[7]
local group, consumer, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
local fallback = math.max(tonumber(ARGV[4]) or 1, 0.001)
local interject, paused, pauser = tonumber(ARGV[5]), ARGV[6], ARGV[7]
-- Over every lane, once: the consumers holding tickets, and how many each lane has running.
local function holdings()
  local busy, held = {}, {}
  for _, lane in ipairs(redis.call('SMEMBERS', KEYS[6])) do
    local ok, pending = pcall(redis.call, 'XPENDING', prefix .. lane, group)
    if ok then
      held[lane] = pending[1]
      if type(pending[4]) == 'table' then
        for _, holder in ipairs(pending[4]) do busy[holder[1]] = true end
      end
    end
  end
  return busy, held
end
-- Every engine that reported within the window holds a ticket (its consumer has one pending).
local function every_engine_busy(busy)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local live = redis.call('ZRANGEBYSCORE', KEYS[5], now - interject, '+inf')
  for _, engine in ipairs(live) do
    if not busy[engine] then return false end
  end
  return #live > 0
end
-- Another lane than ``lane`` has a ticket running: the engines are contended.
local function others_running(held, lane)
  for other, running in pairs(held) do
    if other ~= lane and running > 0 then return true end
  end
  return false
end
-- A document job's lane ("<tenant>+jobs") waits for an engine: it never pauses a call.
local function background(lane) return string.sub(lane, -5) == '+jobs' end
-- What a ticket of ``lane`` is charged: its mean cost, else this engine's mean call.
local function mean_cost(lane)
  return math.max(tonumber(redis.call('HGET', costs, lane) or '') or fallback, 0.001)
end
local order = redis.call('LRANGE', ring, 0, -1)
if #order == 0 then return {} end  -- nothing waits: one command (an idle engine's look)
-- A lane alone in the ring owes nobody and is owed nothing: its tickets are read in turn,
-- charged nothing ("-1": its finish has no deficit to correct), and it keeps no deficit (a
-- lane joining it later finds both just active): the pass that left it alone dropped it
-- (``ringed``). Three commands; the full pass below only when the read finds nothing (the
-- lane is empty, or holds entries nobody can read).
if not interject and #order == 1 then
  local lane = order[1]
  local ok, got = pcall(redis.call, 'XREADGROUP', 'GROUP', group, consumer, 'COUNT', count,
                        'STREAMS', prefix .. lane, '>')
  local entries = ok and got and got[1] and got[1][2] or {}
  if #entries > 0 then return {lane, entries, '-1'} end
end
-- The deficits written by this pass, in one HSET at its end (``flush``).
local written = {}
local function flush()
  local pairs_ = {}
  for lane, value in pairs(written) do
    pairs_[#pairs_ + 1] = lane
    pairs_[#pairs_ + 1] = string.format('%.6f', value)
  end
  if #pairs_ > 0 then redis.call('HSET', deficits, unpack(pairs_)) end
end
-- The lanes with tickets waiting, in ring order; the others leave it and forget their deficit.
local lanes, cost, share, credit, running, seen = {}, {}, {}, {}, {}, {}
local mine = {}  -- of a lane's running tickets, how many the engine to pause holds
local sole = {}  -- the one consumer holding all of a lane's running tickets, if one does
for _, lane in ipairs(order) do
  local stream = prefix .. lane
  local ok, pending, waiting = false, nil, 0
  if not seen[lane] then
    ok, pending = pcall(redis.call, 'XPENDING', stream, group)
    waiting = ok and (redis.call('XLEN', stream) - pending[1]) or 0
  end
  if waiting > 0 then
    local i = #lanes + 1
    lanes[i] = lane
    running[i] = pending[1]
    mine[i] = 0
    sole[i] = false
    if type(pending[4]) == 'table' then
      for _, holder in ipairs(pending[4]) do
        if holder[1] == pauser then mine[i] = tonumber(holder[2]) end
      end
      if #pending[4] == 1 then sole[i] = pending[4][1][1] end
    end
    cost[i] = mean_cost(lane)
    share[i] = math.max(tonumber(redis.call('HGET', shares, lane) or '') or 1, 0.001)
    credit[i] = tonumber(redis.call('HGET', deficits, lane) or '')  -- nil: just active
  elseif not seen[lane] then
    redis.call('HDEL', deficits, lane)
  end
  seen[lane] = true
end
-- A lane that has just become active starts with one quantum (the cheapest lane's ticket)
-- times its share, as a lane reaching the head of a round robin does: its first ticket is
-- the next an engine takes, unless another lane's credit is still larger.
local quantum = nil
for i = 1, #lanes do quantum = math.min(quantum or cost[i], cost[i]) end
for i = 1, #lanes do
  if credit[i] == nil then
    credit[i] = quantum * share[i]
    written[lanes[i]] = credit[i]
  end
end
local function ringed(first, spent)
  -- The ring again: from the lane served on (behind it the lanes passed over), and the
  -- served lane last once its credit is spent; written only if its order changed. The
  -- deficits of the pass written too, but for a lane left alone in the ring: it keeps none
  -- (the lone lane's takes above).
  local again = {}
  for i = (spent and first + 1 or first), #lanes do again[#again + 1] = lanes[i] end
  for i = 1, first - 1 do again[#again + 1] = lanes[i] end
  if spent and lanes[first] then again[#again + 1] = lanes[first] end
  local alone = #again == 1
  if alone then
    written[again[1]] = nil
    redis.call('HDEL', deficits, again[1])
  end
  flush()
  local same = #again == #order
  for i = 1, #again do same = same and again[i] == order[i] end
  if not same then
    redis.call('DEL', ring)
    if #again > 0 then redis.call('RPUSH', ring, unpack(again)) end
  end
  return alone
end
-- Interjecting: which lanes may pause the call. A lane whose running tickets are all the
-- call to pause (of that lane alone) pauses itself, while another lane holds an engine
-- (alone, a tenant's tickets keep their order).
local may = {}
if interject then
  local busy, held = holdings()
  if not every_engine_busy(busy) then
    ringed(1, false)  -- as it was: an idle engine takes it
    return {}
  end
  for i = 1, #lanes do
    may[i] = not background(lanes[i]) and (running[i] == 0 or (paused ~= '' and lanes[i] == paused
      and mine[i] == running[i] and others_running(held, lanes[i])))
  end
end
local function servable(i) return not interject or may[i] end
while #lanes > 0 do
  -- The lane with the most credit left (ties: ring order) among those that may be served;
  -- none has any: first as many rounds of a quantum (the cheapest lane's ticket) times each
  -- lane's share as it takes for one to have some.
  local chosen, owed = nil, false
  for i = 1, #lanes do
    if credit[i] > 0 then
      owed = true
      if servable(i) and (not chosen or credit[i] > credit[chosen]) then chosen = i end
    end
  end
  if not chosen and not owed then
    local rounds = nil
    for i = 1, #lanes do
      local need = math.floor(-credit[i] / (quantum * share[i])) + 1
      if not rounds or need < rounds then rounds = need end
    end
    for i = 1, #lanes do
      credit[i] = credit[i] + rounds * quantum * share[i]
      written[lanes[i]] = credit[i]
      if servable(i) and (not chosen or credit[i] > credit[chosen]) then chosen = i end
    end
    -- (a remainder of the rounds may leave the first lane at 0 rather than above it)
    if chosen and credit[chosen] < -1e-6 then chosen = nil end
  end
  if not chosen then
    ringed(1, false)  -- as it was: the lanes owed a turn run elsewhere, the others are in debt
    if interject and ARGV[8] == '1' then
      for i = 1, #lanes do
        if credit[i] > 0 and not may[i] and sole[i] and sole[i] ~= pauser
            and not background(lanes[i])
            and redis.call('ZSCORE', KEYS[5], sole[i]) then  -- an engine (no interjector)
          local bell = KEYS[8] .. sole[i]
          redis.call('LPUSH', bell, 'passed')
          redis.call('LTRIM', bell, 0, 0)
          redis.call('PEXPIRE', bell, interject)
        end
      end
    end
    return {}
  end
  local got = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count,
                         'STREAMS', prefix .. lanes[chosen], '>')
  local entries = got and got[1] and got[1][2] or {}
  if #entries > 0 then
    credit[chosen] = credit[chosen] - cost[chosen] * #entries
    written[lanes[chosen]] = credit[chosen]
    -- Left alone in the ring (the others had nothing waiting): charged nothing, as the lone
    -- lane's takes are (its finish must not correct a deficit a later pass writes).
    local alone = ringed(chosen, credit[chosen] <= 0)
    return {lanes[chosen], entries, alone and '-1' or string.format('%.6f', cost[chosen])}
  end
  -- Counted as waiting, yet nothing to deliver: entries neither pending nor deliverable
  -- (their consumer was deleted holding them). They are deleted, so their waiters submit
  -- again; the lane leaves the ring, and the next is asked.
  local stream, held = prefix .. lanes[chosen], {}
  local ok, pend = pcall(redis.call, 'XPENDING', stream, group, '-', '+', 1000)
  if ok then for _, e in ipairs(pend) do held[e[1]] = true end end
  for _, e in ipairs(redis.call('XRANGE', stream, '-', '+', 'COUNT', 1000)) do
    if not held[e[1]] then redis.call('XDEL', stream, e[1]) end
  end
  written[lanes[chosen]] = nil
  redis.call('HDEL', deficits, lanes[chosen])
  table.remove(lanes, chosen); table.remove(cost, chosen)
  table.remove(share, chosen); table.remove(credit, chosen); table.remove(running, chosen)
  table.remove(mine, chosen); table.remove(may, chosen); table.remove(sole, chosen)
end
flush()
redis.call('DEL', ring)
return {}
