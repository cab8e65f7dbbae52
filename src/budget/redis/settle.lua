-- settle: end a granted request (see `Settlement` in budget.rs).
--
-- KEYS[1]      the tenant's lease ZSET
-- KEYS[1 + i]  window i's HASH
-- ARGV[1]      lease id
-- ARGV[2]      reserved_at_ms (this server's time, from reserve)
-- ARGV[3]      reserved tokens
-- ARGV[4]      actual tokens
-- ARGV[5]      '1' to give back the request's count too, else '0'
-- ARGV[3 * i + 3] .. ARGV[3 * i + 5]  window i: quantity ('t' tokens, 'r' requests), window_ms,
--                                     bucket_ms
--
-- Reply: 0.
local now = now_ms()
redis.call('ZREM', KEYS[1], ARGV[1])
local at = tonumber(ARGV[2])
local tokens_delta = tonumber(ARGV[4]) - tonumber(ARGV[3])
local refund_request = ARGV[5] == '1'

local by_key = {}
for i = 1, #KEYS - 1 do
  local a = 3 * i + 3
  local delta = 0
  if ARGV[a] == 't' then
    delta = tokens_delta
  elseif refund_request then
    delta = -1
  end
  if delta ~= 0 then
    local key = KEYS[i + 1]
    local w = by_key[key]
    if w == nil then
      w = window(key, tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), now)
      -- A refund, the usual settle, never moves the expiry.
      load(w, adjusted_bucket(w, at, delta), delta < 0)
      by_key[key] = w
    end
    adjust(w, at, delta)
  end
end
return 0
