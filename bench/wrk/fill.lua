-- Adds FILL_COUNT requests of 32 blocks (16 shared + 16 unique) without freeing them,
-- then only asks /health, so the run can end at any time after the fill. Request n (from
-- FILL_START, default 1) is "f<n>" on rank n % 64; a later run with a higher FILL_START adds
-- more requests without repeating ids or unique hashes.
local headers = { ["Content-Type"] = "application/json" }
local total = tonumber(os.getenv("FILL_COUNT") or "100000")
local first = tonumber(os.getenv("FILL_START") or "1")
local last = first + total - 1
local prefix = {}
for i = 1, 16 do prefix[i] = tostring(1000003 * i) end
local prefix_json = table.concat(prefix, ",")
local n = first - 1
request = function()
  n = n + 1
  if n > last then return wrk.format("GET", "/health") end
  local tail = {}
  for i = 1, 16 do tail[i] = tostring(n * 64 + i) end
  local rank = n % 64
  return wrk.format("POST", "/add", headers, '{"model_name":"bench","request_id":"f' .. n ..
    '","worker_id":' .. math.floor(rank / 4) .. ',"dp_rank":' .. (rank % 4) ..
    ',"sequence_hashes":[' .. prefix_json .. ',' .. table.concat(tail, ",") ..
    '],"new_isl_tokens":512}')
end
