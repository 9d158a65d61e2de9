"""Is the stream still the one the reader's position came from? After a reconnect the entry at
the position must still be there with the content read; where it is not (a promoted replica
that lagged, a Redis restarted empty), the reader re-reads from the newest *checkpoint* the
stream still holds unchanged: ids of entries read, one per ``CHECKPOINT_SPACING_MS`` of stream
time, each with a digest of its content. A position the stream's own bound trimmed away is no
such case (``trimmed_past``)."""

from __future__ import annotations

from collections import deque
from typing import Any

from redis.asyncio import Redis

from kv_slot_tracker.replication.records import RECORD_FIELD
from kv_slot_tracker.replication.redis.stream import START_ID, parse_id

# At most one checkpoint per this much stream time (the newest is always the last entry read),
# as many as cover about ten minutes of a busy stream; checked this many per round trip.
CHECKPOINT_SPACING_MS = 100
CHECKPOINTS_KEPT = 6_000
CHECKPOINTS_PER_CALL = 64


class Checkpoints:
    """Entries read, oldest first: (parsed id, id, content digest or None when unknown)."""

    def __init__(self) -> None:
        self._cps: deque[tuple[tuple[int, int], str, int | None]] = deque(maxlen=CHECKPOINTS_KEPT)

    def clear(self) -> None:
        self._cps.clear()

    def note(self, stream_id: str, digest: int | None) -> None:
        """Remember an entry read (``digest``: of its content; None: unknown), thinning older
        ones to one per ``CHECKPOINT_SPACING_MS``."""
        cps = self._cps
        parsed = parse_id(stream_id)
        if len(cps) >= 2 and parsed[0] - cps[-2][0][0] < CHECKPOINT_SPACING_MS:
            cps[-1] = (parsed, stream_id, digest)
        else:
            cps.append((parsed, stream_id, digest))

    def newest(self, position: str) -> tuple[str, int | None]:
        cps = self._cps
        if cps and cps[-1][1] == position:
            return position, cps[-1][2]
        return position, None  # content unknown (a snapshot's position, say): presence only

    def drop_after(self, restart: str) -> None:
        """Forget the checkpoints past ``restart`` (the stream no longer holds them)."""
        cps = self._cps
        while cps and cps[-1][0] > parse_id(restart):
            cps.pop()

    async def holds(self, client: Redis, key: str, checkpoint: tuple[str, int | None]) -> bool:
        """Whether the stream ``key`` holds the entry ``checkpoint`` names, with that content."""
        stream_id, digest_ = checkpoint
        found: Any = await client.xrange(key, stream_id, stream_id)
        return bool(found) and (digest_ is None or digest(found[0][1]) == digest_)

    async def common_point(self, client: Redis, key: str, position: str) -> str:
        """The newest checkpoint the stream holds unchanged (START_ID if none): everything up
        to it is the stream we read, so reading on from it misses nothing."""
        older = [cp for cp in reversed(self._cps) if cp[1] != position]
        for i in range(0, len(older), CHECKPOINTS_PER_CALL):
            chunk = older[i : i + CHECKPOINTS_PER_CALL]
            pipe = client.pipeline(transaction=False)
            for _, stream_id, _ in chunk:
                pipe.xrange(key, stream_id, stream_id)
            for (_, stream_id, digest_), found in zip(chunk, await pipe.execute(), strict=True):
                if found and (digest_ is None or digest(found[0][1]) == digest_):
                    return stream_id
        return START_ID


def digest(fields: dict[bytes, bytes]) -> int:
    """What tells one entry's content from another's at the same id (a record re-sent to a
    promoted replica gets a new id; an id reused for other content is told by this)."""
    return hash(fields.get(RECORD_FIELD))


def trimmed_past(info: dict[Any, Any], position: str) -> bool:
    """Whether the stream (``XINFO STREAM``) dropped entries from its head (Redis 7 counts the
    entries ever added: more than it holds) and keeps none at or before ``position``: trimmed
    by its bound, not lost (``stream.py`` says why not ``max-deleted-entry-id``)."""
    first = info.get("first-entry")
    if first and parse_id(first[0]) <= parse_id(position):
        return False
    added = info.get("entries-added")
    return added is not None and int(added) > int(info.get("length", 0))
