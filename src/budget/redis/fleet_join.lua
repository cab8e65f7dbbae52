-- fleet_join: one replica's heartbeat (see `RedisStore::fleet_join` in redis/fleet.rs, whose
-- module docs describe the keys). Not prefixed with common.lua.
--
-- KEYS[1]  members ZSET (member id -> heartbeat expiry, ms)
-- KEYS[2]  reports HASH
-- KEYS[3]  handed HASH
-- KEYS[4]  policy STRING
-- KEYS[5]  leader STRING (PX the leader lease)
-- KEYS[6]  fence counter
-- KEYS[7]  decision HASH
-- ARGV[1]  member id
-- ARGV[2]  its policy hash
-- ARGV[3]  member TTL, ms
-- ARGV[4]  leader lease, ms
-- ARGV[5]  its report (opaque)
--
-- Reply, a flat array (nil where a value is absent):
--   refused:    0, the fleet's policy hash
--   registered: 1, live members, leader, fence (nil unless the caller leads), decision seq,
--               limit, window_epoch, fence (those four nil without a decision), the caller's
--               grant, its overrides, then, only for the leader, per live member: id, report,
--               the larger of its handed grant and its grant in the standing decision
local members, reports, handed = KEYS[1], KEYS[2], KEYS[3]
local policy_key, leader_key, fence_key, decision = KEYS[4], KEYS[5], KEYS[6], KEYS[7]
-- Redis 3.2 to 4 need this to allow writes after TIME; later versions replicate effects anyway.
if redis.replicate_commands then
  redis.replicate_commands()
end

local member, policy_hash, report = ARGV[1], ARGV[2], ARGV[5]
local member_ttl = tonumber(ARGV[3])
-- SET PX refuses 0.
local leader_ttl = math.max(tonumber(ARGV[4]), 1)
-- Every key outlives the last write by a few member TTLs, so an abandoned fleet deletes itself
-- (and never at once: PEXPIRE 0 would delete).
local keep = math.max(5 * member_ttl, 1000)

-- An integer as a Redis argument: '%d' keeps every digit where tostring would not.
local function int(x)
  return string.format('%d', x)
end

-- The server's clock, so every replica agrees on the time (writes after TIME are fine: scripts
-- replicate their effects).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Refuse a policy the other live members do not run, before writing anything. A fleet with no
-- other live member (or that lost its policy key) takes the caller's.
local own = tonumber(redis.call('ZSCORE', members, member))
local others = redis.call('ZCOUNT', members, '(' .. int(now), '+inf')
if own ~= nil and own > now then
  others = others - 1
end
local policy = redis.call('GET', policy_key)
if others > 0 and policy and policy ~= policy_hash then
  return { 0, policy }
end

-- Drop members whose heartbeat expired, with their report and handed grant. A leader that is no
-- longer a member loses the lease (unless it is the caller, renewing both now).
local leader = redis.call('GET', leader_key)
for _, id in ipairs(redis.call('ZRANGEBYSCORE', members, '-inf', int(now))) do
  redis.call('HDEL', reports, id)
  redis.call('HDEL', handed, id)
  if id == leader and id ~= member then
    redis.call('DEL', leader_key)
    leader = false
  end
end
redis.call('ZREMRANGEBYSCORE', members, '-inf', int(now))

-- Register or renew the caller.
redis.call('ZADD', members, int(now + member_ttl), member)
redis.call('HSET', reports, member, report)
redis.call('SET', policy_key, policy_hash, 'PX', keep)

-- Renew the lease if the caller holds it, take it if nobody does; a new leadership gets the next
-- fencing token.
local fence = false
if leader == member then
  redis.call('PEXPIRE', leader_key, leader_ttl)
  fence = redis.call('GET', fence_key)
  if not fence then
    fence = redis.call('INCR', fence_key)
  end
elseif not leader then
  redis.call('SET', leader_key, member, 'PX', leader_ttl)
  fence = redis.call('INCR', fence_key)
  leader = member
end

-- The last decision, and the caller's share of it, recorded as handed to it.
local d = redis.call('HMGET', decision, 'seq', 'limit', 'window_epoch', 'fence',
  'g:' .. member, 'o:' .. member)
if d[5] then
  redis.call('HSET', handed, member, d[5])
end

-- Every key but the lease lives while any member heartbeats: the fence never goes backwards and
-- the decision stays readable between publishes.
for _, key in ipairs({ members, reports, handed, fence_key, decision }) do
  redis.call('PEXPIRE', key, keep)
end

local reply = { 1, redis.call('ZCARD', members), leader, fence, d[1], d[2], d[3], d[4], d[5], d[6] }
if leader == member then
  -- All remaining members are live: the expired ones were just removed.
  for _, id in ipairs(redis.call('ZRANGE', members, 0, -1)) do
    reply[#reply + 1] = id
    reply[#reply + 1] = redis.call('HGET', reports, id)
    -- The most it may have been handed: the grant it last read, or its grant in the decision
    -- standing now, which it may read at any moment until the leader publishes again (the
    -- leader must count it whether or not that member has synced since).
    local got = tonumber(redis.call('HGET', handed, id))
    local standing = tonumber(redis.call('HGET', decision, 'g:' .. id))
    local most = got
    if standing and (not most or standing > most) then
      most = standing
    end
    reply[#reply + 1] = most and int(most) or false
  end
end
return reply
