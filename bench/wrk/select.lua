-- /select alone (books nothing): 32-block prompts sharing a 16-block prefix, 8 variants.
local headers = { ["Content-Type"] = "application/json" }
local base = os.getenv("WRK_PREFIX") or ""
local bodies = {}
for v = 1, 8 do
  local b, s = {}, {}
  for i = 1, 16 do
    b[i] = tostring(1000003 * i)
    s[i] = tostring(2000003 * i)
  end
  for i = 17, 32 do
    b[i] = tostring(v * 100000 + i)
    s[i] = tostring(v * 100000 + i + 500000000)
  end
  bodies[v] = wrk.format("POST", base .. "/select", headers,
    '{"model_name":"bench","block_hashes":[' .. table.concat(b, ",") ..
    '],"sequence_hashes":[' .. table.concat(s, ",") .. '],"isl_tokens":512}')
end
local n = 0
request = function()
  n = n + 1
  return bodies[(n % 8) + 1]
end
