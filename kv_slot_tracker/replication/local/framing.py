"""Frames on the hub's Unix socket: a 4-byte big-endian length, then a one-byte kind and its body.

The hub never decodes a record: it reads the kind and the fixed-size integers after it and
forwards the rest as bytes, so sequencing a frame costs a copy, not a msgpack round trip.

Kinds (``P``: process to hub, ``H``: hub to process)::

    P  HELLO    b"h"  instance_id u64, incarnation u64
    P  PUBLISH  b"p"  last_seq u64, applied u64, records (msgpack list)
    P  APPLIED  b"a"  applied u64                       (lets the hub trim what all have)
    P  HEAD?    b"q"  token u64                         (the read barrier)
    P  FLUSHED  b"g"  token u64                         (answer to FLUSH)
    P  STATE    b"s"  token u64, position u64, state (msgpack map)   (answer to EXPORT)
    P  STATE+   b"S"  token u64, a piece of the state   (before STATE, when the state is large)
    H  DATA     b"d"  position u64, records             (a sibling's frame)
    H  OWN      b"o"  position u64, last_seq u64        (the receiver's own frame, sequenced)
    H  HEAD     b"Q"  token u64, head u64
    H  FLUSH    b"F"  token u64                         (send what you accepted, then FLUSHED)
    H  EXPORT   b"x"  token u64                         (send your state)
    H  BEGIN    b"b"  position u64, state               (load this; frames after it follow)
    H  BEGIN+   b"B"  a piece of the state              (before BEGIN, when the state is large)
    H  RESYNC   b"r"  (you fell behind what the hub keeps: a state follows)
    H  STATS    b"t"  the hub's positions and counters (msgpack map), every second

``FrameReader`` cuts a byte stream into frames whatever the reads' boundaries; a frame longer
than its limit is refused (counted) and its bytes skipped, so one bad frame does not desync
the stream.
"""

from __future__ import annotations

import struct

HEADER = struct.Struct(">I")
U64 = struct.Struct(">Q")
U64_2 = struct.Struct(">QQ")

HELLO, PUBLISH, APPLIED, HEAD_ASK, STATE, FLUSHED = b"h", b"p", b"a", b"q", b"s", b"g"
DATA, OWN, HEAD, EXPORT, BEGIN, RESYNC, STATS = b"d", b"o", b"Q", b"x", b"b", b"r", b"t"
FLUSH, STATE_PART, BEGIN_PART = b"F", b"S", b"B"

MAX_FRAME_BYTES = 256 * 1024 * 1024
# A state travels in frames of at most this much of it (``state_frames``): the pieces, then the
# frame that completes it. Whatever its size, then, no frame is over ``MAX_FRAME_BYTES``.
STATE_PIECE_BYTES = 16 * 1024 * 1024
MAX_STATE_BYTES = 64 * MAX_FRAME_BYTES  # a state is refused beyond this (16 GiB)


def frame(kind: bytes, body: bytes = b"") -> bytes:
    """One frame: length, kind, body."""
    return HEADER.pack(len(body) + 1) + kind + body


def frame_u64(kind: bytes, *values: int, tail: bytes = b"") -> bytes:
    """A frame whose body is unsigned 64-bit integers, then ``tail``."""
    body = struct.pack(f">{len(values)}Q", *values) + tail
    return HEADER.pack(len(body) + 1) + kind + body


def state_frames(
    piece: bytes,
    last: bytes,
    state: bytes | memoryview,
    piece_values: tuple[int, ...] = (),
    last_values: tuple[int, ...] = (),
) -> list[bytes]:
    """``state`` cut into frames: ``piece`` frames (``piece_values``, then at most
    ``STATE_PIECE_BYTES`` of it) and one ``last`` frame (``last_values``, then the rest)."""
    view, n = memoryview(state), STATE_PIECE_BYTES
    cuts = list(range(0, len(view), n)) or [0]
    frames = [frame_u64(piece, *piece_values, tail=bytes(view[i : i + n])) for i in cuts[:-1]]
    frames.append(frame_u64(last, *last_values, tail=bytes(view[cuts[-1] :])))
    return frames


class FrameReader:
    """Frames out of a byte stream fed in pieces (``feed``), each as ``bytes`` (kind first).

    A frame announcing more than ``max_bytes`` (or an empty one) is not kept: its bytes are
    skipped as they arrive and ``oversized`` counts it.
    """

    __slots__ = ("max_bytes", "_buf", "_skip", "oversized")

    def __init__(self, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buf = bytearray()
        self._skip = 0  # bytes of a refused frame still to come
        self.oversized = 0

    def pending(self) -> int:
        """Bytes held of a frame not complete yet."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        if self._skip:
            if len(data) <= self._skip:
                self._skip -= len(data)
                return []
            data = data[self._skip :]
            self._skip = 0
        buf = self._buf
        buf += data
        frames = []
        start, end = 0, len(buf)
        while end - start >= 4:
            (size,) = HEADER.unpack_from(buf, start)
            if size == 0 or size > self.max_bytes:
                self.oversized += 1
                available = end - start - 4
                if available >= size:
                    start += 4 + size
                    continue
                self._skip = size - available
                start = end
                break
            if end - start - 4 < size:
                break
            frames.append(bytes(buf[start + 4 : start + 4 + size]))
            start += 4 + size
        if start:
            del buf[:start]
        return frames
