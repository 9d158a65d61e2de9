"""Redis key names and stream ids of one replication namespace.

Every key carries the namespace as a hash tag (``{ns}:...``), so a namespace lives on one cluster
slot and a script may touch all of its keys.
"""

from __future__ import annotations

from dataclasses import dataclass

START_ID = "0-0"


@dataclass(frozen=True, slots=True)
class NamespaceKeys:
    events: str
    snapshot: str
    snapshot_lease: str
    reset: str  # exists while Redis lost data and no snapshot has been written since
    ack_probe: str  # written by CONFIRM_SCRIPT so that a WAIT after it means something

    @classmethod
    def of(cls, namespace: str) -> NamespaceKeys:
        tag = "{" + namespace + "}"
        return cls(f"{tag}:events", f"{tag}:snapshot", f"{tag}:snapshot-lease", f"{tag}:reset",
                   f"{tag}:ack-probe")  # fmt: skip


def parse_id(stream_id: str | bytes) -> tuple[int, int]:
    """``"<ms>-<seq>"`` as a comparable pair."""
    if isinstance(stream_id, bytes):
        stream_id = stream_id.decode()
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


_ID_PART_MAX = 2**64 - 1


def is_stream_id(text: str) -> bool:
    """Whether ``text`` is a full stream id: ``<ms>-<seq>``, two decimal numbers below 2**64."""
    ms, dash, seq = text.partition("-")
    return (
        dash == "-"
        and ms.isascii()
        and ms.isdigit()
        and seq.isascii()
        and seq.isdigit()
        and int(ms) <= _ID_PART_MAX
        and int(seq) <= _ID_PART_MAX
    )


def id_text(stream_id: str | bytes) -> str:
    return stream_id.decode() if isinstance(stream_id, bytes) else stream_id


# Shared by the scripts below: stream ids compared, and whether the entry ``id`` is missing
# because the stream's own bound trimmed it rather than lost (a restart without persistence, a
# failover to a replica that lagged): trimming removes entries from the head, so the stream
# removed some (Redis 7 counts ``entries-added``, more than its ``length`` then) and keeps none
# at or before ``id``. (``max-deleted-entry-id`` would say it better, but Redis 7.0 moves it on
# XDEL only, not when trimming.) A stream recreated by re-sent records removed none: lost.
_STREAM_FUNCTIONS = """
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function older(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  return am < bm or (am == bm and as < bs)
end
local function trimmed(key, id)
  local info = redis.pcall('XINFO', 'STREAM', key)
  if type(info) ~= 'table' or info.err then return false end
  local added, length, first = nil, nil, nil
  for i = 1, #info, 2 do
    if info[i] == 'entries-added' then added = info[i + 1] end
    if info[i] == 'length' then length = info[i + 1] end
    if info[i] == 'first-entry' and type(info[i + 1]) == 'table' then first = info[i + 1][1] end
  end
  if added == nil or added <= length then return false end
  return first == nil or older(id, first)
end
local function gone(key, id, digest)
  if id == '' then return false end
  local entry = redis.call('XRANGE', key, id, id)[1]
  if entry == nil then return not trimmed(key, id) end
  -- an entry with our id, but not ours: after a failover another instance's entry can take it
  return digest ~= '' and redis.sha1hex(entry[2][2]) ~= digest
end
"""

# Append a batch of records, but only if the stream still holds the last entry this publisher
# appended (ARGV[1], its id, empty = no check; ARGV[4], the SHA-1 of its payload: after a
# failover another instance's entry may hold the same id), or lost it only to its own
# trimming. If it does not,
# Redis lost data (restart without persistence, failover to a replica that lagged), and the
# publisher must re-send what it recently published *before* anything newer, so readers see its
# records in order. A pipeline cannot make the appends conditional; a script does it in the
# same round trip. Refusing also sets the reset marker (KEYS[2]): the stream may now begin with
# re-sent records that are not in their original order across instances, so starting instances
# must wait for a snapshot written after this (which deletes the marker) rather than replay it.
#
# Trimming never removes what the newest snapshot (KEYS[3], its ``id``) does not cover: a
# starting instance loads that snapshot and reads the stream after its id. Entries older than
# the retention horizon (ARGV[2], a MINID) go once the snapshot covers them too; past the
# count bound (ARGV[3], most entries kept; 0 = none) every entry the snapshot covers goes.
# Returns {want, ids...}: want 1 when the stream holds three quarters of its bound or more after
# that (a newer snapshot is needed to trim further: the publisher asks for one, so it comes
# before the bound), 2 when it still held more than its bound and was cut to it regardless
# (snapshots did not keep up: readers that need the entries cut find a gap and wait for one);
# else 0. The bound protects Redis's memory, so it holds either way.
APPEND_SCRIPT = (
    _STREAM_FUNCTIONS
    + """
if gone(KEYS[1], ARGV[1], ARGV[4]) then
  redis.call('SET', KEYS[2], '1')
  return false
end
local reply = {0}
for i = 5, #ARGV do
  reply[#reply + 1] = redis.call('XADD', KEYS[1], '*', 'd', ARGV[i])
end
local cap = tonumber(ARGV[3])
local len = redis.call('XLEN', KEYS[1])
local snap = redis.call('HGET', KEYS[3], 'id')
if snap and parse(snap) == nil then snap = false end  -- not an id: as if there were none
if snap then
  local floor = ARGV[2] .. '-0'
  if (cap > 0 and len > cap) or older(snap, floor) then floor = snap end
  len = len - redis.call('XTRIM', KEYS[1], 'MINID', '~', floor)
end
if cap > 0 then
  if len * 4 >= cap * 3 then reply[1] = 1 end
  if len > cap then
    redis.call('XTRIM', KEYS[1], 'MAXLEN', '~', cap)
    reply[1] = 2
  end
end
return reply
"""
)

# Confirm appended records when nothing new is appended: 0 when the stream no longer holds
# this publisher's last entry (ARGV[1], with ARGV[3] the SHA-1 of its payload, as above; then
# they must be re-sent; trimmed by the stream's own
# bound is not lost), else a small write (so that the WAIT sent after this script on the same
# connection waits for the replicas to reach an offset past every record this primary holds,
# ours included) and 1.
CONFIRM_SCRIPT = (
    _STREAM_FUNCTIONS
    + """
if gone(KEYS[1], ARGV[1], ARGV[3]) then
  return 0
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', 60000)
return 1
"""
)

# Write a snapshot only while holding the lease (KEYS[2] == ARGV[1]; empty ARGV[1] = unfenced).
# A snapshot written now is one written after any reset so far: it clears the marker (KEYS[3]).
WRITE_SNAPSHOT_SCRIPT = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'id', ARGV[2], 'at', ARGV[3], 'origin', ARGV[4], 'data', ARGV[5])
redis.call('DEL', KEYS[3])
return 1
"""
