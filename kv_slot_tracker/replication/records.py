"""Replica records as they travel on the stream, and who has seen which of them.

A record is the service's envelope (``model_name``, ``routing_group``, ``block_size``,
``origin``, ``ts``, and ``event`` or ``topology``) plus two fields stamped when it is queued:

* ``incarnation``: a random id of the publishing process, so an instance restarted with a fixed
  ``instance_id`` starts a fresh numbering instead of colliding with its previous life;
* ``seq``: 1, 2, 3, ... per incarnation, without holes (a record dropped by a full outbox does
  not use up a number).

Because numbers are dense, a reader knows exactly what it has missed: per ``(origin,
incarnation)`` it keeps the highest ``seq`` applied; a record at or below it is a duplicate
(a retried append), the next number is new, and anything beyond means records were trimmed away
or lost (a gap).
"""

from __future__ import annotations

import secrets
from typing import Any

import msgpack

RECORD_FIELD = b"d"

OriginKey = tuple[int, int]  # (origin instance id, incarnation)

RECORD_OVERHEAD = 256  # bytes of a record besides its hash lists (keys, ids, names, numbers)


def record_bytes(record: dict[str, Any]) -> int:
    """A record's size as the outbox bounds it (``outbox_max_bytes``): 9 bytes per hash of its
    prompt or selection hash lists (a msgpack uint64), and ``RECORD_OVERHEAD``. The same record
    always gives the same figure, so the outbox adds and takes back equal amounts."""
    n = 0
    event = record.get("event")
    if event is not None:
        data = event.get("data")
        add = data.get("AddRequest") if type(data) is dict else None
        seq = add.get("token_sequence") if type(add) is dict else None
        n = len(seq) if type(seq) is list else 0
    else:
        change = record.get("selection")
        if type(change) is dict:
            entry = change.get("entry")
            lists = [change.get("bh"), change.get("ch")]
            if type(entry) is dict:
                lists += [entry.get("sh"), entry.get("bh")]
            n = sum(len(h) for h in lists if type(h) is list)
    return RECORD_OVERHEAD + 9 * n


class MalformedRecord(ValueError):
    """A stream entry that is not a replica record."""


def encode_record(record: dict[str, Any]) -> bytes:
    return msgpack.packb(record)


def decode_record(payload: bytes) -> dict[str, Any]:
    try:
        record = msgpack.unpackb(payload, raw=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise MalformedRecord(f"undecodable record: {e}") from None
    if not isinstance(record, dict):
        raise MalformedRecord("record is not a map")
    for name in ("origin", "incarnation", "seq", "ts"):
        if type(record.get(name)) is not int:
            raise MalformedRecord(f"record field {name!r} missing or not an integer")
    return record


def origin_key(record: dict[str, Any]) -> OriginKey:
    return record["origin"], record["incarnation"]


def as_replayed(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of one of this instance's own records that the service will apply like a peer's
    (its origin and its event's router id cleared: the service and the core skip records
    carrying their own id).

    Needed when the local state no longer holds what an own record did: after it was replaced
    by a snapshot that predates the record, or when a peer's earlier add of the same id replaced
    the local copy (``kv_slot_tracker.service.replica``).
    """
    copy = dict(record)
    copy["origin"] = 0
    event = copy.get("event")
    if isinstance(event, dict):
        copy["event"] = {**event, "router_id": 0}
    return copy


class SeqLedger:
    """Highest sequence number applied per ``(origin, incarnation)``, and when it was last seen."""

    __slots__ = ("highest", "seen_at")

    def __init__(self) -> None:
        self.highest: dict[OriginKey, int] = {}
        self.seen_at: dict[OriginKey, int] = {}  # wall ns

    def missing_before(self, key: OriginKey, seq: int) -> int:
        """How many records of ``key`` come between the last applied one and ``seq``.

        0: ``seq`` is the next one; negative: a duplicate; positive: a gap of that many.
        """
        return seq - self.highest.get(key, 0) - 1

    def advance(self, key: OriginKey, seq: int, wall_ns: int) -> None:
        self.highest[key] = seq
        self.seen_at[key] = wall_ns

    def get(self, key: OriginKey) -> int:
        return self.highest.get(key, 0)

    def prune(self, seen_before_wall_ns: int) -> int:
        """Forget origins not heard from since the given wall time; returns how many."""
        stale = [k for k, t in self.seen_at.items() if t < seen_before_wall_ns]
        for k in stale:
            del self.highest[k]
            del self.seen_at[k]
        return len(stale)

    def export(self) -> list[list[int]]:
        return [[o, i, s, self.seen_at.get((o, i), 0)] for (o, i), s in self.highest.items()]

    @classmethod
    def load(cls, rows: list[list[int]]) -> SeqLedger:
        ledger = cls()
        for origin, incarnation, seq, seen in rows:
            ledger.highest[(origin, incarnation)] = seq
            ledger.seen_at[(origin, incarnation)] = seen
        return ledger

    def copy(self) -> SeqLedger:
        other = SeqLedger()
        other.highest = dict(self.highest)
        other.seen_at = dict(self.seen_at)
        return other


def random_id() -> int:
    """A random non-zero unsigned 64-bit id."""
    while True:
        value = secrets.randbits(64)
        if value:
            return value


def resolve_instance_id(configured: int) -> int:
    """The configured instance id, or a random one when it is 0."""
    return configured or random_id()
