-- fleet_leave: a replica leaves its fleet at shutdown (see `RedisStore::fleet_leave` in
-- redis/fleet.rs). Not prefixed with common.lua. Removals keep each key's expiry.
--
-- KEYS[1]  members ZSET
-- KEYS[2]  reports HASH
-- KEYS[3]  handed HASH
-- KEYS[4]  leader STRING
-- ARGV[1]  member id
--
-- Reply: 1 if it was registered, else 0.
local member = ARGV[1]
local removed = redis.call('ZREM', KEYS[1], member)
redis.call('HDEL', KEYS[2], member)
redis.call('HDEL', KEYS[3], member)
-- Release the lease at once, so another member takes it at its next heartbeat.
if redis.call('GET', KEYS[4]) == member then
  redis.call('DEL', KEYS[4])
end
return removed
