-- /batch with 100 lifecycle operations: 50 adds and the 50 frees of the previous batch's adds.
local headers = { ["Content-Type"] = "application/json" }
local prefix = {}
-- WRK_SIGNED=1: every hash negative (on the wire hashes are signed 64-bit numbers, and a real
-- prompt has about half of them negative)
local sign = (os.getenv("WRK_SIGNED") == "1") and "-" or ""
for i = 1, 16 do prefix[i] = sign .. tostring(1000003 * i) end
local prefix_json = table.concat(prefix, ",")
local n = 0
local tag = os.getenv("WRK_TAG") or "b"
request = function()
  n = n + 1
  local ops = {}
  for j = 1, 50 do
    local k = n * 50 + j
    local tail = {}
    for i = 1, 16 do tail[i] = sign .. tostring(k * 64 + i) end
    local rank = k % 64
    ops[#ops + 1] = '{"op":"add","model_name":"bench","request_id":"' .. tag .. k ..
      '","worker_id":' .. math.floor(rank / 4) .. ',"dp_rank":' .. (rank % 4) ..
      ',"sequence_hashes":[' .. prefix_json .. ',' .. table.concat(tail, ",") ..
      '],"new_isl_tokens":512}'
  end
  for j = 1, 50 do
    local k = (n - 32) * 50 + j
    ops[#ops + 1] = '{"op":"free","model_name":"bench","request_id":"' .. tag .. k .. '"}'
  end
  return wrk.format("POST", "/batch", headers, '{"operations":[' .. table.concat(ops, ",") .. ']}')
end
