-- /add and /free alternating: 16 workers x 4 ranks, 32-block prompts sharing a 16-block prefix.
-- Each add is freed 64 calls later, so ~32 requests stay active and every free finds its add.
local n = 0
local prefix = {}
-- WRK_SIGNED=1: every hash negative (on the wire hashes are signed 64-bit numbers, and a real
-- prompt has about half of them negative)
local sign = (os.getenv("WRK_SIGNED") == "1") and "-" or ""
for i = 1, 16 do prefix[i] = sign .. tostring(1000003 * i) end
local prefix_json = table.concat(prefix, ",")
local headers = { ["Content-Type"] = "application/json" }
local tag = os.getenv("WRK_TAG") or "w"

request = function()
  n = n + 1
  local k = math.floor(n / 2)
  if n % 2 == 0 then
    local tail = {}
    for i = 1, 16 do tail[i] = sign .. tostring(k * 64 + i) end
    local rank = k % 64
    local body = '{"model_name":"bench","request_id":"' .. tag .. k ..
      '","worker_id":' .. math.floor(rank / 4) .. ',"dp_rank":' .. (rank % 4) ..
      ',"sequence_hashes":[' .. prefix_json .. ',' .. table.concat(tail, ",") ..
      '],"new_isl_tokens":512}'
    return wrk.format("POST", "/add", headers, body)
  end
  local body = '{"model_name":"bench","request_id":"' .. tag .. (k - 32) .. '"}'
  return wrk.format("POST", "/free", headers, body)
end

local errors = 0
response = function(status, headers, body)
  if status >= 300 then errors = errors + 1 end
end

done = function(summary, latency, requests)
  io.write(string.format("non2xx_in_script=%d\n", errors))
end
