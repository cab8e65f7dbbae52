-- tollgate budget scripts: the prelude prepended to reserve.lua, settle.lua, renew.lua and
-- usage.lua (see src/budget/redis.rs). The window arithmetic mirrors src/budget/window.rs, the
-- reference semantics; the contract tests run both stores against the same expectations.
--
-- A window is a HASH: one field per nonzero bucket (field = bucket number = ms / bucket_ms,
-- value = its usage; a bucket that reaches zero is deleted) plus five bookkeeping fields:
--   total   the sum of the bucket fields
--   oldest  the smallest bucket number held (exact)
--   newest  no bucket number held is above it (an upper bound: a refund may empty the newest)
--   bms     the bucket_ms the numbers are in (a reload that changes it renumbers the buckets)
--   exp     when the key was last set to expire, in the scripts' clock (ms): one bucket after
--           the newest bucket rolls off. A charge sets the expiry only when that moves (a new
--           newest bucket, or a reload that changed the window), not on every write. Keys
--           written before this field existed have none, and get it with their next charge.
--
-- Each redis.call converts its arguments and reply between Lua and Redis, and each write goes to
-- every replica and the AOF as well, so the scripts make few: a window's meta and the bucket
-- about to be written are read in one HMGET, and the bucket and the meta fields that changed
-- written back in one HSET (docs/benchmarks.md, "What Redis runs per decision").
--
-- Numbers are Lua doubles, exact below 2^53; the Rust side clamps every argument below that,
-- and times (ms since 1970) and bucket numbers are far below it.

-- Redis 3.2 to 4 need this to allow writes after TIME; later versions replicate effects anyway.
if redis.replicate_commands then
  redis.replicate_commands()
end

-- The bookkeeping fields every window hash has. `exp` makes a fifth in most, so HLEN - META may
-- count one bucket too many: that only lets a walk go one number further, where one too few
-- could end it before the last bucket.
local META = 4
-- A lease ZSET is kept one to two of these after its last lease expires (it is dead then
-- anyway; see keep_leases_key).
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
    now = now,
    nb = nb,
    -- The oldest live bucket: bucket b is live while b + n > nb.
    first = nb - n + 1,
    total = 0,
    oldest = nil,
    newest = nil,
    exp = nil,
    -- The meta fields as the key holds them (nil: not held).
    st_total = nil,
    st_oldest = nil,
    st_newest = nil,
    st_bms = nil,
    st_exp = nil,
    -- Bucket `vb`'s value is `vv`, as read with the meta or last written (nil: not known).
    vb = nil,
    vv = 0,
  }
end

-- When the key should expire: one bucket after its newest bucket rolls off (bucket b is live
-- while b + n > now's bucket, so it rolls off at (b + n) * bms).
local function expiry(w)
  return (w.newest + w.n + 1) * w.bms
end

-- Deletes the window's key; its expiry and stored meta go with it (the next charge sets both).
local function drop_key(w)
  redis.call('DEL', w.key)
  w.exp = nil
  w.st_total, w.st_oldest, w.st_newest, w.st_bms, w.st_exp = nil, nil, nil, nil, nil
end

-- Writes the meta, and bucket b's value `w.vv` with it when b is given, in one HSET; deletes
-- the key once it holds nothing. Most charges and refunds change only `total` and the bucket,
-- and write just those: an argument list built field by field costs more Lua than the HSET
-- arguments it saves, so anything else (a new oldest or newest bucket, a roll-off, a reload)
-- writes every field.
local function save_meta(w, b)
  if w.oldest == nil then
    drop_key(w)
    return
  end
  if b ~= nil and w.oldest == w.st_oldest and w.newest == w.st_newest and w.bms == w.st_bms
    and w.exp == w.st_exp then
    redis.call('HSET', w.key, 'total', int(w.total), int(b), int(w.vv))
    w.st_total = w.total
    return
  end
  local args = { w.key, 'total', int(w.total), 'oldest', int(w.oldest), 'newest', int(w.newest),
    'bms', int(w.bms) }
  if w.exp ~= nil then
    args[#args + 1] = 'exp'
    args[#args + 1] = int(w.exp)
  end
  if b ~= nil then
    args[#args + 1] = int(b)
    args[#args + 1] = int(w.vv)
  end
  redis.call('HSET', unpack(args))
  -- An `exp` left unread stays unknown (nil), as if not held.
  w.st_total, w.st_oldest, w.st_newest, w.st_bms, w.st_exp = w.total, w.oldest, w.newest, w.bms,
    w.exp
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
  drop_key(w)
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
  if w.oldest ~= nil then
    w.exp = expiry(w)
  end
  save_meta(w)
  if w.oldest ~= nil then
    redis.call('PEXPIRE', w.key, int(w.exp - w.now))
  end
end

-- Loads the window, first deleting the buckets that have rolled off. Amortized O(1): `oldest`
-- only moves forward, so each bucket number is walked past once; a long gap over few buckets
-- is scanned instead, and a window whose newest bucket rolled off is deleted whole.
--
-- `b`, if given, is a live bucket (b >= w.first) the caller is about to write: its value is read
-- in the same HMGET as the meta (rolling off never deletes a live bucket). `without_exp` leaves
-- `exp` unread, for a caller that only gives back: left unknown, it is neither written nor
-- trusted (a charge would set the expiry again).
local function load(w, b, without_exp)
  local meta, exp, value
  if b == nil then
    meta = redis.call('HMGET', w.key, 'total', 'oldest', 'newest', 'bms', 'exp')
    exp = meta[5]
  elseif without_exp then
    meta = redis.call('HMGET', w.key, 'total', 'oldest', 'newest', 'bms', int(b))
    value = meta[5]
  else
    meta = redis.call('HMGET', w.key, 'total', 'oldest', 'newest', 'bms', 'exp', int(b))
    exp, value = meta[5], meta[6]
  end
  local total, oldest, newest, bms =
    tonumber(meta[1]), tonumber(meta[2]), tonumber(meta[3]), tonumber(meta[4])
  if total == nil or oldest == nil or newest == nil or bms == nil then
    -- No window yet (or a key these scripts did not write): start empty.
    drop_key(w)
    if b ~= nil then
      w.vb, w.vv = b, 0
    end
    return
  end
  w.total, w.oldest, w.newest, w.exp = total, oldest, newest, tonumber(exp)
  w.st_total, w.st_oldest, w.st_newest, w.st_bms, w.st_exp = total, oldest, newest, bms, w.exp
  if bms ~= w.bms then
    -- Every number changes: the value read is not bucket b's.
    renumber(w, bms)
  elseif b ~= nil then
    w.vb, w.vv = b, tonumber(value) or 0
  end
  if w.oldest == nil or w.oldest >= w.first then
    return
  end
  if w.newest < w.first then
    drop_key(w)
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

-- Bucket b's value: the one read or written last if it is b's, else read now.
local function bucket_value(w, b)
  if w.vb ~= b then
    w.vb, w.vv = b, tonumber(redis.call('HGET', w.key, int(b))) or 0
  end
  return w.vv
end

-- Adds `amount` to bucket b (a charge), and keeps the key until that bucket rolls off.
local function add(w, b, amount)
  if amount <= 0 then
    return
  end
  w.vv = bucket_value(w, b) + amount
  w.total = w.total + amount
  if w.oldest == nil or b < w.oldest then
    w.oldest = b
  end
  if w.newest == nil or b > w.newest then
    w.newest = b
  end
  local exp = expiry(w)
  local extend = exp ~= w.exp
  w.exp = exp
  save_meta(w, b)
  if extend then
    redis.call('PEXPIRE', w.key, int(exp - w.now))
  end
end

-- Takes up to `amount` back from bucket b (a refund): never below zero, nothing if b is empty.
local function refund(w, b, amount)
  if amount <= 0 or w.oldest == nil then
    return
  end
  local v = bucket_value(w, b)
  if v == 0 then
    return
  end
  local take = math.min(v, amount)
  w.total = w.total - take
  if take >= v then
    redis.call('HDEL', w.key, int(b))
    w.vv = 0
    if b == w.oldest then
      w.oldest = next_bucket(w, b + 1)
    end
    if w.oldest == nil then
      w.total, w.newest = 0, nil
    end
    save_meta(w)
  else
    w.vv = v - take
    save_meta(w, b)
  end
end

-- The bucket `adjust(w, at, delta)` writes, or nil if it writes none: what `load` should read.
local function adjusted_bucket(w, at, delta)
  local b = math.floor(math.min(at, w.now) / w.bms)
  if delta > 0 then
    if b < w.first then
      return w.nb
    end
    return b
  elseif delta < 0 and b >= w.first then
    return b
  end
  return nil
end

-- Settles a reservation made at `at` by `delta` (window.rs `adjust`): a refund (delta < 0) lowers
-- its bucket, never below zero, and does nothing if that bucket is empty or rolled off; a
-- charge (delta > 0) raises it, or now's bucket if it rolled off. A reservation "later" than
-- now (the clock stepped back) counts as now.
local function adjust(w, at, delta)
  local b = adjusted_bucket(w, at, delta)
  if b == nil then
    return
  end
  if delta > 0 then
    add(w, b, delta)
  else
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

-- Keeps a lease ZSET until its last lease expires, plus one to two seconds, so idle tenants'
-- keys go: called with `last`, the expiry just given to one or more leases. Every writer keeps
-- the key's expiry at least LEASE_KEY_MARGIN_MS past every score it holds, so reading its TTL
-- is enough to know whether `last` needs it moved; when it does, it moves a margin further,
-- so a tenant's steady stream of requests moves it about once a second, not once a request.
local function keep_leases_key(key, last, now)
  local pttl = redis.call('PTTL', key)
  if pttl < 0 or now + pttl < last + LEASE_KEY_MARGIN_MS then
    redis.call('PEXPIREAT', key, int(last + 2 * LEASE_KEY_MARGIN_MS))
  end
end
