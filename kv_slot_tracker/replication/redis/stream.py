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


def id_text(stream_id: str | bytes) -> str:
    return stream_id.decode() if isinstance(stream_id, bytes) else stream_id


# Append a batch of records, but only if the stream still holds the last entry this publisher
# appended (ARGV[1]; empty = no check). If it does not, Redis lost data (restart without
# persistence, failover to a replica that lagged) or trimmed it, and the publisher must re-send
# what it recently published *before* anything newer, so readers see its records in order.
# A pipeline cannot make the appends conditional; a script does it in the same round trip.
# Refusing also sets the reset marker (KEYS[2]): the stream may now begin with re-sent records
# that are not in their original order across instances, so starting instances must wait for a
# snapshot written after this (which deletes the marker) rather than replay the stream.
# ARGV[2] is the trim horizon (MINID, approximate), ARGV[3] the most entries kept (MAXLEN,
# approximate; 0 = no such bound), ARGV[4..] the encoded records.
APPEND_SCRIPT = """
local last = ARGV[1]
if last ~= '' and #redis.call('XRANGE', KEYS[1], last, last) == 0 then
  redis.call('SET', KEYS[2], '1')
  return false
end
local ids = {}
for i = 4, #ARGV do
  ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'd', ARGV[i])
end
redis.call('XTRIM', KEYS[1], 'MINID', '~', ARGV[2])
if ARGV[3] ~= '0' then
  redis.call('XTRIM', KEYS[1], 'MAXLEN', '~', ARGV[3])
end
return ids
"""

# Confirm appended records when nothing new is appended: 0 when the stream no longer holds
# this publisher's last entry (ARGV[1]; then they must be re-sent), else a small write (so that
# the WAIT sent after this script on the same connection waits for the replicas to reach an
# offset past every record this primary holds, ours included) and 1.
CONFIRM_SCRIPT = """
local last = ARGV[1]
if last ~= '' and #redis.call('XRANGE', KEYS[1], last, last) == 0 then
  return 0
end
redis.call('SET', KEYS[2], ARGV[2], 'PX', 60000)
return 1
"""

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
