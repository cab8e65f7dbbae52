-- tollgate budget scripts: the prelude prepended to reserve.lua, settle.lua, renew.lua and
-- usage.lua (see src/budget/redis.rs). The window arithmetic mirrors src/budget/window.rs, the
-- reference semantics; the contract tests run both stores against the same expectations.
--
-- A window is a HASH: one field per nonzero bucket (field = bucket number = ms / bucket_ms,
-- value = its usage; a bucket that reaches zero is deleted) plus four bookkeeping fields:
--   total   the sum of the bucket fields
--   oldest  the smallest bucket number held (exact)
--   newest  no bucket number held is above it (an upper bound: a refund may empty the newest)
--   bms     the bucket_ms the numbers are in (a reload that changes it renumbers the buckets)
--
-- Numbers are Lua doubles, exact below 2^53; the Rust side clamps every argument below that,
-- and times (ms since 1970) and bucket numbers are far below it.

-- Redis 3.2 to 4 need this to allow writes after TIME; later versions replicate effects anyway.
if redis.replicate_commands then
  redis.replicate_commands()
end

local META = 4
-- A lease ZSET is kept this long after its last lease expires (it is dead then anyway).
local LEASE_KEY_MARGIN_MS = 1000

-- The server's clock, so every replica of tollgate agrees on the time.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- An integer as a Redis argument: '%d' keeps every digit where tostring would switch to an
-- exponent past 14 digits.
local function int(x)
  return string.format('%d', x)
end

-- A window at `now`. The geometry is made total as in window.rs: bucket_ms 0 counts as 1 and a
-- window shorter than one bucket as one bucket.
local function window(key, window_ms, bucket_ms, now)
  local bms = math.max(bucket_ms, 1)
  local n = math.max(math.floor(window_ms / bms), 1)
  local nb = math.floor(now / bms)
  return {
    key = key,
    bms = bms,
    n = n,
    -- Bucket `nb` expires at (nb + n) * bms <= now + n * bms; one bucket more is margin.
    ttl = (n + 1) * bms,
    now = now,
    nb = nb,
    -- The oldest live bucket: bucket b is live while b + n > nb.
    first = nb - n + 1,
    total = 0,
    oldest = nil,
    newest = nil,
  }
end

local function save_meta(w)
  if w.oldest == nil then
    redis.call('DEL', w.key)
  else
    redis.call('HSET', w.key, 'total', int(w.total), 'oldest', int(w.oldest),
      'newest', int(w.newest), 'bms', int(w.bms))
  end
end

-- The smallest bucket number >= from held by the window, or nil. Walks one number at a time
-- while that is no dearer than scanning every field, then scans: O(min(gap, buckets held)).
local function next_bucket(w, from)
  local fields = redis.call('HLEN', w.key) - META
  if fields <= 0 or w.newest == nil then
    return nil
  end
  local last = math.min(from + fields - 1, w.newest)
  for b = from, last do
    if redis.call('HEXISTS', w.key, int(b)) == 1 then
      return b
    end
  end
  if last >= w.newest then
    return nil
  end
  local best = nil
  local names = redis.call('HKEYS', w.key)
  for i = 1, #names do
    local b = tonumber(names[i])
    if b ~= nil and b >= from and (best == nil or b < best) then
      best = b
    end
  end
  return best
end

-- A reload changed bucket_ms: each bucket keeps its start time (old number * old bucket_ms) and
-- so expires with the new bucket holding that start, as window.rs keeps buckets by start time.
-- Two approximations, both within one bucket and only across reloads: buckets that land on the
-- same new number are merged (window.rs keeps them apart, so one refund may reach across them
-- here), and a start is remembered only to the bucket size it was last stored at (so after a
-- coarser then a finer size, a bucket may expire up to one coarse bucket early).
local function renumber(w, old_bms)
  local all = redis.call('HGETALL', w.key)
  redis.call('DEL', w.key)
  local sums = {}
  for i = 1, #all, 2 do
    local b, v = tonumber(all[i]), tonumber(all[i + 1])
    if b ~= nil and v ~= nil and v > 0 then
      local nb = math.floor(b * old_bms / w.bms)
      sums[nb] = (sums[nb] or 0) + v
    end
  end
  w.total, w.oldest, w.newest = 0, nil, nil
  for b, v in pairs(sums) do
    redis.call('HSET', w.key, int(b), int(v))
    w.total = w.total + v
    if w.oldest == nil or b < w.oldest then
      w.oldest = b
    end
    if w.newest == nil or b > w.newest then
      w.newest = b
    end
  end
  save_meta(w)
  if w.oldest ~= nil then
    redis.call('PEXPIRE', w.key, int(w.ttl))
  end
end

-- Loads the window, first deleting the buckets that have rolled off. Amortized O(1): `oldest`
-- only moves forward, so each bucket number is walked past once; a long gap over few buckets
-- is scanned instead, and a window whose newest bucket rolled off is deleted whole.
local function load(w)
  local meta = redis.call('HMGET', w.key, 'total', 'oldest', 'newest', 'bms')
  local total, oldest, newest, bms =
    tonumber(meta[1]), tonumber(meta[2]), tonumber(meta[3]), tonumber(meta[4])
  if total == nil or oldest == nil or newest == nil or bms == nil then
    -- No window yet (or a key these scripts did not write): start empty.
    redis.call('DEL', w.key)
    return
  end
  w.total, w.oldest, w.newest = total, oldest, newest
  if bms ~= w.bms then
    renumber(w, bms)
  end
  if w.oldest == nil or w.oldest >= w.first then
    return
  end
  if w.newest < w.first then
    redis.call('DEL', w.key)
    w.total, w.oldest, w.newest = 0, nil, nil
    return
  end
  local fields = redis.call('HLEN', w.key) - META
  if w.first - w.oldest <= fields then
    for b = w.oldest, w.first - 1 do
      local f = int(b)
      local v = tonumber(redis.call('HGET', w.key, f))
      if v ~= nil then
        w.total = w.total - v
        redis.call('HDEL', w.key, f)
      end
    end
    w.oldest = next_bucket(w, w.first)
  else
    local all = redis.call('HGETALL', w.key)
    w.total, w.oldest = 0, nil
    for i = 1, #all, 2 do
      local b = tonumber(all[i])
      if b ~= nil then
        if b < w.first then
          redis.call('HDEL', w.key, all[i])
        else
          w.total = w.total + tonumber(all[i + 1])
          if w.oldest == nil or b < w.oldest then
            w.oldest = b
          end
        end
      end
    end
  end
  if w.oldest == nil then
    w.total, w.newest = 0, nil
  end
  save_meta(w)
end

-- Like load, changing nothing (for usage): sums the live buckets from a scan.
local function peek(w)
  local all = redis.call('HGETALL', w.key)
  local bms = nil
  for i = 1, #all, 2 do
    if all[i] == 'bms' then
      bms = tonumber(all[i + 1])
    end
  end
  if bms == nil then
    return
  end
  for i = 1, #all, 2 do
    local b, v = tonumber(all[i]), tonumber(all[i + 1])
    if b ~= nil and v ~= nil and v > 0 then
      b = math.floor(b * bms / w.bms)
      if b >= w.first then
        w.total = w.total + v
        if w.oldest == nil or b < w.oldest then
          w.oldest = b
        end
      end
    end
  end
end

-- Adds `amount` to bucket b (a charge), and keeps the key until that bucket rolls off.
local function add(w, b, amount)
  if amount <= 0 then
    return
  end
  redis.call('HINCRBY', w.key, int(b), int(amount))
  w.total = w.total + amount
  if w.oldest == nil or b < w.oldest then
    w.oldest = b
  end
  if w.newest == nil or b > w.newest then
    w.newest = b
  end
  save_meta(w)
  redis.call('PEXPIRE', w.key, int(w.ttl))
end

-- Takes up to `amount` back from bucket b (a refund): never below zero, nothing if b is empty.
local function refund(w, b, amount)
  if amount <= 0 or w.oldest == nil then
    return
  end
  local f = int(b)
  local v = tonumber(redis.call('HGET', w.key, f))
  if v == nil then
    return
  end
  local take = math.min(v, amount)
  w.total = w.total - take
  if take >= v then
    redis.call('HDEL', w.key, f)
    if b == w.oldest then
      w.oldest = next_bucket(w, b + 1)
    end
    if w.oldest == nil then
      w.total, w.newest = 0, nil
    end
  else
    redis.call('HINCRBY', w.key, f, int(-take))
  end
  save_meta(w)
end

-- Settles a reservation made at `at` by `delta` (window.rs `adjust`): a refund (delta < 0) lowers
-- its bucket, never below zero, and does nothing if that bucket is empty or rolled off; a
-- charge (delta > 0) raises it, or now's bucket if it rolled off. A reservation "later" than
-- now (the clock stepped back) counts as now.
local function adjust(w, at, delta)
  local b = math.floor(math.min(at, w.now) / w.bms)
  if delta > 0 then
    if b < w.first then
      b = w.nb
    end
    add(w, b, delta)
  elseif delta < 0 and b >= w.first then
    refund(w, b, -delta)
  end
end

-- ms until the oldest usage rolls off; 0 for an empty window.
local function reset_ms(w)
  if w.oldest == nil then
    return 0
  end
  return math.max(0, (w.oldest + w.n) * w.bms - w.now)
end

-- ms until `cost` fits under `limit`: -1 (never) if cost > limit, else the expiry of the first
-- bucket, oldest first, after which enough has rolled off.
local function retry_after(w, cost, limit)
  if cost > limit then
    return -1
  end
  local must_free = w.total + cost - limit
  if must_free <= 0 or w.oldest == nil then
    return 0
  end
  -- Usually the oldest bucket alone frees enough.
  local oldest = tonumber(redis.call('HGET', w.key, int(w.oldest))) or 0
  if oldest >= must_free then
    return reset_ms(w)
  end
  local all = redis.call('HGETALL', w.key)
  local numbers, amounts = {}, {}
  for i = 1, #all, 2 do
    local b = tonumber(all[i])
    if b ~= nil then
      numbers[#numbers + 1] = b
      amounts[b] = tonumber(all[i + 1])
    end
  end
  table.sort(numbers)
  local freed = 0
  for _, b in ipairs(numbers) do
    freed = freed + amounts[b]
    if freed >= must_free then
      return math.max(0, (b + w.n) * w.bms - w.now)
    end
  end
  return 0
end

-- Keeps a lease ZSET until its last lease expires (plus a margin), so idle tenants' keys go.
local function expire_leases_key(key)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] ~= nil then
    redis.call('PEXPIREAT', key, int(tonumber(last[2]) + LEASE_KEY_MARGIN_MS))
  end
end
