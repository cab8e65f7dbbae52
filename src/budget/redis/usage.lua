-- usage: a tenant's live leases and window usage. Changes nothing.
--
-- KEYS[1]      the tenant's lease ZSET
-- KEYS[1 + i]  window i's HASH
-- ARGV[2 * i - 1], ARGV[2 * i]  window i: window_ms, bucket_ms
--
-- Reply, integers: live leases, then per window: used, reset_ms.
local now = now_ms()
local out = { redis.call('ZCOUNT', KEYS[1], '(' .. int(now), '+inf') }
for i = 1, #KEYS - 1 do
  local w = window(KEYS[i + 1], tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i]), now)
  peek(w)
  out[#out + 1] = w.total
  out[#out + 1] = reset_ms(w)
end
return out
