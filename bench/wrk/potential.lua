-- /potential_loads with a 256-block prompt that shares a 128-block prefix with active requests.
local headers = { ["Content-Type"] = "application/json" }
local bodies = {}
for v = 1, 8 do
  local h = {}
  for i = 1, 128 do h[i] = tostring(7000001 * i) end
  for i = 129, 256 do h[i] = tostring(v * 100000 + i) end
  bodies[v] = wrk.format("POST", "/potential_loads", headers,
    '{"model_name":"bench","sequence_hashes":[' .. table.concat(h, ",") .. '],"new_isl_tokens":100}')
end
local n = 0
request = function()
  n = n + 1
  return bodies[(n % 8) + 1]
end
