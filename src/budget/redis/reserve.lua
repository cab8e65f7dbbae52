-- reserve: check every limit, then take all of them or nothing (see `Reserve` in budget.rs).
--
-- KEYS[1]      the tenant's lease ZSET (member = lease id, score = expiry ms)
-- KEYS[1 + i]  window i's HASH
-- ARGV[1]      lease id
-- ARGV[2]      lease TTL, ms
-- ARGV[3]      max concurrent leases, -1 for no limit
-- ARGV[4 * i] .. ARGV[4 * i + 3]  window i: cost, window_ms, bucket_ms, limit
--
-- Reply, integers:
--   granted: 1, now_ms, live leases including this one (-1 with no limit), then per window:
--            used, reset_ms (after the reservation)
--   denied:  0, now_ms, failing limit (window index from 1, 0 for concurrency), used, allowed,
--            requested, retry_after_ms (-1: never), then per window: used, reset_ms
local now = now_ms()
local leases = KEYS[1]
local lease_id = ARGV[1]
local lease_ttl = tonumber(ARGV[2])
local max_concurrent = tonumber(ARGV[3])

-- Per window: its state (shared by windows that name the same key, so a repeated name is
-- charged twice, as the embedded store does), cost and limit.
local windows, by_key = {}, {}
for i = 1, #KEYS - 1 do
  local a = 4 * i
  local key = KEYS[i + 1]
  local w = by_key[key]
  if w == nil then
    w = window(key, tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), now)
    load(w, w.nb)
    by_key[key] = w
  end
  windows[i] = { w = w, cost = tonumber(ARGV[a]), limit = tonumber(ARGV[a + 3]) }
end

local function reply(head)
  for _, x in ipairs(windows) do
    head[#head + 1] = x.w.total
    head[#head + 1] = reset_ms(x.w)
  end
  return head
end

for i, x in ipairs(windows) do
  if x.w.total + x.cost > x.limit then
    return reply({ 0, now, i, x.w.total, x.limit, x.cost, retry_after(x.w, x.cost, x.limit) })
  end
end

-- Live leases are those whose expiry is after now.
redis.call('ZREMRANGEBYSCORE', leases, '-inf', int(now))
local live = -1
if max_concurrent >= 0 then
  live = redis.call('ZCARD', leases)
  if live >= max_concurrent then
    -- With no slot at all it can never fit; else when the first lease expires.
    local retry = -1
    if max_concurrent > 0 then
      local first = redis.call('ZRANGE', leases, 0, 0, 'WITHSCORES')
      retry = math.max(0, tonumber(first[2]) - now)
    end
    return reply({ 0, now, 0, live, max_concurrent, 1, retry })
  end
end

for _, x in ipairs(windows) do
  add(x.w, x.w.nb, x.cost)
end
local added = redis.call('ZADD', leases, int(now + lease_ttl), lease_id)
keep_leases_key(leases, now + lease_ttl, now)
if max_concurrent >= 0 then
  -- ZADD answers 1 for a new lease id, 0 for one already there (a retried reservation).
  live = live + added
end
return reply({ 1, now, live })
