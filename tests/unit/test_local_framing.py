"""Frames on the supervisor's hub's socket (``kv_slot_tracker.replication.local.framing``): cut out of
a byte stream whatever the reads' boundaries; a frame over the limit refused, counted and
skipped without losing the frames around it."""

from __future__ import annotations

import pytest

from kv_slot_tracker.replication.local import framing as f


def stream() -> tuple[bytes, list[bytes]]:
    frames = [f.frame_u64(f.PUBLISH, 7, 3, tail=b"records"), f.frame(f.RESYNC),
              f.frame_u64(f.HEAD, 1, 2), f.frame(f.DATA, b"x" * 300)]  # fmt: skip
    return b"".join(frames), [fr[4:] for fr in frames]


def test_one_byte_at_a_time() -> None:
    data, want = stream()
    reader = f.FrameReader()
    got = []
    for i in range(len(data)):
        got += reader.feed(data[i : i + 1])
    assert got == want and reader.pending() == 0 and reader.oversized == 0


@pytest.mark.parametrize("cut", [1, 3, 4, 5, 20, 27, 28, 29])
def test_cut_anywhere(cut: int) -> None:
    data, want = stream()
    reader = f.FrameReader()
    first = reader.feed(data[:cut])
    assert first == want[: len(first)]
    assert first + reader.feed(data[cut:]) == want


def test_a_partial_frame_is_held_not_returned() -> None:
    reader = f.FrameReader()
    whole = f.frame_u64(f.PUBLISH, 1, 0, tail=b"abc")
    assert reader.feed(whole[:-1]) == []
    assert reader.pending() == len(whole) - 1
    assert reader.feed(whole[-1:]) == [whole[4:]]


def test_integers_after_the_kind() -> None:
    body = f.frame_u64(f.STATE, 2**64 - 1, 5, tail=b"s")[4:]
    assert body[:1] == f.STATE
    assert f.U64_2.unpack_from(body, 1) == (2**64 - 1, 5) and body[17:] == b"s"


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_oversized_frames_are_skipped_and_counted(chunk: int) -> None:
    """A 100-byte limit: a 101-byte frame between two good ones, fed in pieces of any size."""
    good = f.frame(f.DATA, b"a" * 10)
    big = f.frame(f.DATA, b"b" * 100)  # 101 bytes with the kind
    edge = f.frame(f.DATA, b"c" * 99)  # exactly 100: kept
    data = good + big + edge + big + good
    reader = f.FrameReader(max_bytes=100)
    got = []
    for i in range(0, len(data), chunk):
        got += reader.feed(data[i : i + chunk])
    assert got == [good[4:], edge[4:], good[4:]]
    assert reader.oversized == 2 and reader.pending() == 0


def test_an_empty_frame_is_refused() -> None:
    reader = f.FrameReader()
    assert reader.feed(b"\0\0\0\0" + f.frame(f.RESYNC)) == [f.RESYNC]
    assert reader.oversized == 1
