-- fleet_publish: the leader replaces the fleet's decision (see `RedisStore::fleet_publish` in
-- redis/fleet.rs). Not prefixed with common.lua.
--
-- KEYS[1]  leader STRING
-- KEYS[2]  fence counter
-- KEYS[3]  decision HASH
-- KEYS[4]  handed HASH
-- ARGV[1]  member id (the leader)
-- ARGV[2]  its fencing token
-- ARGV[3]  limit
-- ARGV[4]  window_epoch
-- ARGV[5]  member TTL, ms (keys are kept a few of them)
-- ARGV[6 + 3i .. 8 + 3i]  grant i: member id, grant, overrides (opaque)
--
-- Reply: 1, the new seq; or 0 (fenced: nothing written).
local leader_key, fence_key, decision, handed = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local member, fence = ARGV[1], ARGV[2]
local keep = math.max(5 * tonumber(ARGV[5]), 1000)

-- Only the holder of the lease under this very token may write: a leader that lost the lease,
-- even if it took it back since, holds a stale token.
if redis.call('GET', leader_key) ~= member or redis.call('GET', fence_key) ~= fence then
  return { 0 }
end

-- Rewrite the decision whole; seq carries on from the last one.
local seq = (tonumber(redis.call('HGET', decision, 'seq')) or 0) + 1
redis.call('DEL', decision)
redis.call('HSET', decision, 'seq', string.format('%d', seq), 'limit', ARGV[3],
  'window_epoch', ARGV[4], 'fence', fence)
for i = 6, #ARGV - 2, 3 do
  local id, grant = ARGV[i], ARGV[i + 1]
  redis.call('HSET', decision, 'g:' .. id, grant, 'o:' .. id, ARGV[i + 2])
  -- The leader hands itself its grant here: it reads no join reply for it.
  if id == member then
    redis.call('HSET', handed, member, grant)
  end
end
redis.call('PEXPIRE', decision, keep)
redis.call('PEXPIRE', handed, keep)
return { 1, seq }
