-- renew: push one tenant's live leases to expire at now + TTL (see `LeaseRef` in budget.rs). A
-- lease that expired or was removed is not resurrected.
--
-- KEYS[1]   the tenant's lease ZSET
-- ARGV[1]   lease TTL, ms
-- ARGV[2..] lease ids
--
-- Reply: how many leases were renewed.
local now = now_ms()
local last = now + tonumber(ARGV[1])
local expiry = int(last)
local renewed = 0
for i = 2, #ARGV do
  local score = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[i]))
  if score ~= nil and score > now then
    redis.call('ZADD', KEYS[1], expiry, ARGV[i])
    renewed = renewed + 1
  end
end
if renewed > 0 then
  keep_leases_key(KEYS[1], last, now)
end
return renewed
