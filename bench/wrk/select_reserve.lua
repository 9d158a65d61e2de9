-- /select_and_reserve and DELETE /reservations/{id} alternating: 32-block prompts sharing a
-- 16-block prefix. Each reservation is deleted 64 calls later, so ~32 stay active.
-- WRK_PREFIX is the API base path ("" for Dynamo's selection service, "/selection" here).
local n = 0
local prefix_blocks, prefix_seq = {}, {}
for i = 1, 16 do
  prefix_blocks[i] = tostring(1000003 * i)
  prefix_seq[i] = tostring(2000003 * i)
end
local pb, ps = table.concat(prefix_blocks, ","), table.concat(prefix_seq, ",")
local headers = { ["Content-Type"] = "application/json" }
local tag = os.getenv("WRK_TAG") or "w"
local base = os.getenv("WRK_PREFIX") or ""

request = function()
  n = n + 1
  local k = math.floor(n / 2)
  if n % 2 == 0 then
    local tb, ts = {}, {}
    for i = 1, 16 do
      tb[i] = tostring(k * 64 + i)
      ts[i] = tostring(k * 64 + i + 500000000)
    end
    local body = '{"model_name":"bench","selection_id":"' .. tag .. k ..
      '","block_hashes":[' .. pb .. ',' .. table.concat(tb, ",") ..
      '],"sequence_hashes":[' .. ps .. ',' .. table.concat(ts, ",") .. '],"isl_tokens":512}'
    return wrk.format("POST", base .. "/select_and_reserve", headers, body)
  end
  return wrk.format("DELETE", base .. "/reservations/" .. tag .. (k - 32), {}, nil)
end

local errors = 0
response = function(status, headers, body)
  if status >= 300 then errors = errors + 1 end
end

done = function(summary, latency, requests)
  io.write(string.format("non2xx_in_script=%d\n", errors))
end
