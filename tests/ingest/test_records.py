"""Decoding the engines' KV-event messages: both event encodings, bounds, and what is skipped."""

from __future__ import annotations

import msgpack
import pytest

from kv_slot_tracker.core.selection.kv_blocks import DISK, HOST_PINNED
from kv_slot_tracker.ingest.normalize import EventNormalizer
from kv_slot_tracker.ingest.records import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    MalformedMessage,
    decode_batch,
    decode_message,
    seq_frame,
)

MAP = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1}


def batch(events: list, rank: object = 0) -> bytes:
    return msgpack.packb([1.5, events, rank])


def test_vllm_array_events() -> None:
    got = decode_message([b"kv", seq_frame(7), batch([
        ["BlockStored", [1, -2], None, [1, 2, 3, 4], 2, None, "CPU", "lora-a"],
        ["BlockRemoved", [2**64 - 1], "DISK"],
        ["AllBlocksCleared"],
    ], rank=3)])  # fmt: skip
    assert (got.seq, got.dp_rank) == (7, 3)
    assert got.events == (
        BlocksStored((1, -2), None, (1, 2, 3, 4), 2, HOST_PINNED, "lora-a"),
        BlocksRemoved((-1,), DISK),  # decoded in the service's signed form
        AllCleared(),
    )


def test_msgspec_map_events_and_trailing_fields() -> None:
    got = decode_batch(0, batch([
        {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": 4,
         "token_ids": [9, 9], "block_size": 2, "medium": None, "extra_keys": [None],
         "group_idx": 0, "kv_cache_spec_kind": "full_attention", "future": 1},
        ["BlockStored", [6], 5, [1, 1], 2, None, "GPU", None, None, 0, "full_attention", 7, 8],
    ], rank=None))  # fmt: skip
    assert got.dp_rank is None
    assert [e.block_hashes for e in got.events] == [(5,), (6,)]
    assert got.events[0].parent_hash == 4


def test_other_kv_cache_groups_are_ignored() -> None:
    got = decode_batch(0, batch([
        ["BlockStored", [1], None, [1, 2], 2, None, "GPU", None, None, 1],
        {"type": "BlockRemoved", "block_hashes": [1], "kv_cache_spec_kind": "sliding_window"},
        ["Ignored"],
    ]))  # fmt: skip
    assert len(got.events) == 2  # "Ignored" is dropped; the groups are the listener's to judge
    listener = EventNormalizer()
    assert [listener.normalize(e, 0) for e in got.events] == [None, None]


def test_eagle_bigrams_become_tokens() -> None:
    got = decode_batch(0, batch([["BlockStored", [1], None, [[10, 11], [11, 12]], 2, None]]))
    assert got.events[0].token_ids == (10, 11, 12) and got.events[0].eagle


def test_ignored_events_in_either_form() -> None:
    assert decode_batch(0, batch([["Ignored"], {"type": "Ignored", "x": 1}])).events == ()


def test_a_salt_tag_equal_to_the_lora_name_is_skipped_once() -> None:
    lora = "dynamo-cache-salt:x"
    once = decode_batch(0, batch([{**MAP, "lora_name": lora, "extra_keys": [[lora]]}]))
    twice = decode_batch(0, batch([{**MAP, "lora_name": lora, "extra_keys": [[lora, lora]]}]))
    assert (once.events[0].cache_salt, twice.events[0].cache_salt) == (None, "x")


def test_fields_the_listener_judges_are_kept() -> None:
    got = decode_batch(0, batch([
        {**MAP, "group_idx": 2, "kv_cache_spec_kind": "mamba", "cache_salt": "s",
         "kv_cache_spec_sliding_window": 8, "session_id": "x"},
        {"type": "BlockRemoved", "block_hashes": [1], "group_idx": 3, "kv_cache_spec_kind": "k"},
        ["BlockStored", [1], None, [1], 1, 5, "GPU", "l", [["dynamo-cache-salt:t"]], 4, "k"],
    ]))  # fmt: skip
    a, b, c = got.events
    assert (a.group_idx, a.kind, a.cache_salt, a.eagle) == (2, "mamba", "s", False)
    assert (b.group_idx, b.kind) == (3, "k")
    assert (c.group_idx, c.kind, c.cache_salt, c.lora_name) == (4, "k", "t", "l")


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([b"", b"\x00"], "expected 3 frames"),
        ([b"", b"\x00" * 7, batch([])], "sequence number must be 8 bytes"),
        ([b"", seq_frame(0), b"\xc1"], "not msgpack"),
        ([b"", seq_frame(0), msgpack.packb({"a": 1})], "batch must be an array"),
        ([b"", seq_frame(0), batch([["Nope"]])], "unknown event type"),
        ([b"", seq_frame(0), batch([["BlockStored", [b"\x01" * 32], None, [1], 1]])], "64-bit"),
        ([b"", seq_frame(0), batch([["BlockStored", [1.5], None, [1], 1]])], "64-bit"),
        ([b"", seq_frame(0), batch([["BlockStored", [1], None, [-1], 1]])], "u32"),
        ([b"", seq_frame(0), batch([["BlockStored", [1], None]])], "missing token_ids"),
        ([b"", seq_frame(0), batch([["BlockRemoved"]])], "missing block_hashes"),
        ([b"", seq_frame(0), batch([], rank="0")], "data_parallel_rank"),
        ([b"", seq_frame(0), batch([42])], "tagged array or map"),
        ([b"", seq_frame(0), msgpack.packb(["x", []])], "ts must be a number"),
        ([b"", seq_frame(0), msgpack.packb([1.0, {}])], "events must be an array"),
        ([b"", seq_frame(0), batch([{"block_hashes": [1]}])], "without a type"),
        ([b"", seq_frame(0), batch([{**MAP, "block_size": -1}])], "unsigned integer"),
        ([b"", seq_frame(0), batch([{**MAP, "token_ids": [[1, 2, 3]]}])], "pairs"),
        ([b"", seq_frame(0), batch([{**MAP, "parent_block_hash": "p"}])], "64-bit"),
        ([b"", seq_frame(0), batch([{**MAP, "medium": 1}])], "medium must be a string"),
        ([b"", seq_frame(0), batch([{**MAP, "lora_name": 1}])], "lora_name must be"),
        ([b"", seq_frame(0), batch([{**MAP, "cache_salt": 1}])], "cache_salt must be"),
        ([b"", seq_frame(0), batch([{**MAP, "group_idx": "1"}])], "group_idx must be a u32"),
        ([b"", seq_frame(0), batch([{**MAP, "group_idx": -1}])], "group_idx must be a u32"),
        ([b"", seq_frame(0), batch([{**MAP, "kv_cache_spec_kind": 1}])], "kind must be"),
        ([b"", seq_frame(0), batch([{**MAP, "kv_cache_spec_sliding_window": "w"}])], "window"),
        ([b"", seq_frame(0), batch([{**MAP, "locality": 1}])], "locality must be"),
        ([b"", seq_frame(0), batch([{**MAP, "ownership": 1}])], "ownership must be"),
        ([b"", seq_frame(0), batch([{**MAP, "extra_keys": {"a": 1}}])], "extra_keys must be"),
        ([b"", seq_frame(0), batch([{**MAP, "extra_keys": [1]}])], "entries must be"),
        ([b"", seq_frame(0), batch([{**MAP, "extra_keys": [[{}]]}])], "items must be"),
        ([b"", seq_frame(0), batch([{"type": "BlockStored", "block_hashes": [1]}])], "missing"),
        ([b"", seq_frame(0), batch([{"type": "BlockRemoved"}])], "missing block_hashes"),
        ([b"", seq_frame(0), batch([{"type": "AllBlocksCleared", "ownership": 1}])], "ownership"),
        ([b"", seq_frame(0), batch([["BlockStored", [1], None, [1], 1, "x"]])], "lora_id"),
        ([b"", seq_frame(0), batch([["AllBlocksCleared", 1]])], "ownership"),
    ],
)
def test_malformed_messages_say_why(frames: list[bytes], why: str) -> None:
    with pytest.raises(MalformedMessage, match=why):
        decode_message(frames)
