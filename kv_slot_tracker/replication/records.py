"""Replica records as they travel on the stream, and who has seen which of them.

Replication never reads a record: the service hands ``publish`` its record as bytes (opaque
here) with the producer's wall-clock time, and gets the same bytes back on every other instance
(``Delivered``). Around them replication puts an envelope of its own, the stream entry's
``d`` field (``RECORD_FIELD``), versioned:

* format 2 (``Entry``, this version): the msgpack array ``[2, origin, incarnation, seq, ts,
  record]``, the record as the service's bytes;
* format 1 (the versions before): one msgpack map holding the record's fields and the
  envelope's (``origin``, ``incarnation``, ``seq``, ``ts``). Read still, so an instance of this
  version converges with a stream its predecessors wrote (a rolling upgrade): the envelope's
  fields are taken from the map, and the whole entry is the record, of format 1, that the
  service decodes (``kv_slot_tracker.service.records``).

The envelope's fields:

* ``origin``: the publishing instance's id;
* ``incarnation``: a random id of the publishing process, so an instance restarted with a fixed
  ``instance_id`` starts a fresh numbering instead of colliding with its previous life;
* ``seq``: 1, 2, 3, ... per incarnation, without holes (a record dropped by a full outbox does
  not use up a number);
* ``ts``: the producer's wall-clock time (ns) the service gave with the record.

Because numbers are dense, a reader knows exactly what it has missed: per ``(origin,
incarnation)`` it keeps the highest ``seq`` applied; a record at or below it is a duplicate
(a retried append), the next number is new, and anything beyond means records were trimmed away
or lost (a gap).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

import msgspec

from kv_slot_tracker.core.bounds import I64, U64

RECORD_FIELD = b"d"
FORMAT = 2  # the envelope this version writes

OriginKey = tuple[int, int]  # (origin instance id, incarnation)

# bytes an entry holds besides its record (the envelope, the stream's own), for the outbox's
# byte bound (``outbox_max_bytes``)
ENTRY_OVERHEAD = 64


class Entry(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, tag=FORMAT):
    """A stream entry of format 2: ``[2, origin, incarnation, seq, ts, record]``."""

    origin: U64
    incarnation: U64
    seq: U64
    ts: I64
    record: bytes


class _Format1(msgspec.Struct, frozen=True):
    """The envelope's fields of a format-1 entry (a map; its other fields are the record's)."""

    origin: int
    incarnation: int
    seq: int
    ts: int


class Delivered(msgspec.Struct, frozen=True):
    """A record read from the stream, for the service: the envelope's fields, and the record
    as the producer's service encoded it in stream format ``format``. ``replayed``: one of
    this instance's own records that the service applies like a peer's (``as_replayed``)."""

    origin: int
    incarnation: int
    seq: int
    ts: int
    record: bytes
    format: int = FORMAT
    replayed: bool = False


class MalformedRecord(ValueError):
    """A stream entry that is not a replica record."""


def record_bytes(record: bytes) -> int:
    """A record's size as the outbox bounds it (``outbox_max_bytes``): its bytes and
    ``ENTRY_OVERHEAD``."""
    return len(record) + ENTRY_OVERHEAD


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Entry).decode
_decode_1 = msgspec.msgpack.Decoder(_Format1).decode


def _is_map(payload: bytes) -> bool:
    """Whether msgpack ``payload`` is a map (format 1) by its first byte."""
    return bool(payload) and (0x80 <= payload[0] <= 0x8F or payload[0] in (0xDE, 0xDF))


def encode_entry(origin: int, incarnation: int, seq: int, ts: int, record: bytes) -> bytes:
    return _encode(Entry(origin, incarnation, seq, ts, record))


_as_map = msgspec.msgpack.Decoder(dict[str, msgspec.Raw]).decode


def encode_entry_1(origin: int, incarnation: int, seq: int, ts: int, record: bytes) -> bytes:
    """The same entry in format 1, for instances of the versions before format 2 on the same
    stream (``replication_stream_format = 1``): the record's map without its kind tag (``k``,
    which format 1 does not have: its kind is the key it holds) and with the envelope's fields.
    The record's values are copied as they are, never decoded."""
    fields = _as_map(record)
    fields.pop("k", None)
    envelope = {"origin": origin, "incarnation": incarnation, "seq": seq, "ts": ts}
    return _encode(fields | {k: msgspec.Raw(_encode(v)) for k, v in envelope.items()})


def decode_entry(payload: bytes) -> Delivered:
    """A stream entry's ``d`` field, of either format. Raises ``MalformedRecord``."""
    try:
        if not _is_map(payload):
            e = _decode(payload)
            return Delivered(e.origin, e.incarnation, e.seq, e.ts, e.record)
        e1 = _decode_1(payload)
    except msgspec.MsgspecError as err:
        raise MalformedRecord(f"undecodable record: {err}") from None
    return Delivered(e1.origin, e1.incarnation, e1.seq, e1.ts, payload, 1)


def as_replayed(record: Delivered) -> Delivered:
    """One of this instance's own records that the service will apply like a peer's (the
    service skips records of its own origin, and the core events carrying its own router id).

    Needed when the local state no longer holds what an own record did: after it was replaced
    by a snapshot that predates the record, or when a peer's earlier add of the same id replaced
    the local copy (``kv_slot_tracker.service.replica``).
    """
    return msgspec.structs.replace(record, replayed=True)


class SeqLedger:
    """Highest sequence number applied per ``(origin, incarnation)``, and when it was last seen."""

    __slots__ = ("highest", "seen_at")

    def __init__(self) -> None:
        self.highest: dict[OriginKey, int] = {}
        # wall ns, the longest silent first (``advance`` moves an origin to the end)
        self.seen_at: OrderedDict[OriginKey, int] = OrderedDict()

    def missing_before(self, key: OriginKey, seq: int) -> int:
        """How many records of ``key`` come between the last applied one and ``seq``.

        0: ``seq`` is the next one; negative: a duplicate; positive: a gap of that many.
        """
        return seq - self.highest.get(key, 0) - 1

    def advance(self, key: OriginKey, seq: int, wall_ns: int) -> None:
        self.highest[key] = seq
        seen_at = self.seen_at
        seen_at[key] = wall_ns
        seen_at.move_to_end(key)

    def get(self, key: OriginKey) -> int:
        return self.highest.get(key, 0)

    def prune(self, seen_before_wall_ns: int) -> int:
        """Forget origins not heard from since the given wall time; returns how many."""
        stale = [k for k, t in self.seen_at.items() if t < seen_before_wall_ns]
        for k in stale:
            del self.highest[k]
            del self.seen_at[k]
        return len(stale)

    def evict_silent(self, most: int, keep: OriginKey | None = None) -> int:
        """Forget the longest-silent origins until at most ``most`` are left (never ``keep``);
        returns how many were forgotten."""
        seen_at = self.seen_at
        evicted = 0
        while len(self.highest) > most and seen_at:
            key, _ = seen_at.popitem(last=False)
            if key == keep:
                seen_at[key] = _
                if len(seen_at) == 1:
                    break
                continue
            self.highest.pop(key, None)
            evicted += 1
        return evicted

    def export(self) -> list[list[int]]:
        return [[o, i, s, self.seen_at.get((o, i), 0)] for (o, i), s in self.highest.items()]

    @classmethod
    def load(cls, rows: list[list[int]]) -> SeqLedger:
        ledger = cls()
        for origin, incarnation, seq, seen in sorted(rows, key=lambda row: row[3]):
            ledger.highest[(origin, incarnation)] = seq
            ledger.seen_at[(origin, incarnation)] = seen
        return ledger

    def copy(self) -> SeqLedger:
        other = SeqLedger()
        other.highest = dict(self.highest)
        other.seen_at = OrderedDict(self.seen_at)
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
