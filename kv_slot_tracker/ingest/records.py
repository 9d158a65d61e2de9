"""KV-event messages as the engines publish them, decoded and validated.

The wire format (vLLM ``vllm/distributed/kv_events.py``; SGLang publishes the same): a ZMQ
multipart message of three frames on a PUB socket,

1. a topic (any bytes; subscribers subscribe to everything),
2. the batch's sequence number, 8 bytes big-endian (0, 1, 2, ... per publisher),
3. a msgpack ``EventBatch``: the array ``[ts, [event, ...], data_parallel_rank]`` (the rank may
   be absent or nil: the socket's rank applies).

An event is a msgspec tagged struct, sent either as an array whose first element is the tag or as
a map with a ``type`` key:

* ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]``
* ``["BlockRemoved", block_hashes, medium, group_idx, kv_cache_spec_kind, ...]``
* ``["AllBlocksCleared"]``

Block hashes must be integers (signed or unsigned 64-bit, the same block either way: they are
decoded in the service's signed form, ``kv_slot_tracker.core.hashing``); vLLM's bytes hashes
(``--prefix-caching-hash-algo sha256`` without an integer form) do not decode, as on the
reference. Trailing elements and unknown map keys are ignored. A store or removal of a KV
cache group other than the main attention group (``group_idx`` not 0, or a ``kv_cache_spec_kind``
other than full/MLA/sink-full attention) is ignored. Token ids may be bigram pairs (EAGLE): the
first token of each pair, then the last pair's second token.

The replay socket (vLLM's ROUTER at ``replay_endpoint``): a DEALER sends ``[b"", start_seq]``
(8 bytes big-endian) and receives ``[b"", seq, payload]`` per buffered batch from ``start_seq``
on, then ``[b"", -1 (8 bytes, signed), b""]``.

Everything the publisher controls is bounded: the message size by the socket (``MAXMSGSIZE``),
the events, hashes and tokens by that size. Any violation raises ``MalformedMessage`` and the
whole message is skipped (the reference drops a batch that fails to decode the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from kv_slot_tracker.core.hashing import to_signed
from kv_slot_tracker.core.selection.kv_index import tier_of_medium

SEQ_BYTES = 8
END_OF_REPLAY = -1
I64_MIN = -(1 << 63)
U64_LIMIT = 1 << 64
U32_LIMIT = 1 << 32

_MAIN_ATTENTION = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


class MalformedMessage(ValueError):
    """A message that does not decode; the text says why."""


@dataclass(frozen=True, slots=True)
class BlocksStored:
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: int | None
    """``kv_index`` tier of the medium; ``None`` for storage outside the worker (ignored)."""
    lora_name: str | None


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    block_hashes: tuple[int, ...]
    tier: int | None


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


KvEvent = BlocksStored | BlocksRemoved | AllCleared


@dataclass(frozen=True, slots=True)
class KvBatch:
    seq: int
    dp_rank: int | None
    events: tuple[KvEvent, ...]


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise MalformedMessage(f"sequence number must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_message(frames: list[bytes]) -> KvBatch:
    """A PUB message (topic, seq, payload) as a batch."""
    if len(frames) != 3:
        raise MalformedMessage(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    return decode_batch(decode_seq(frames[1]), frames[2])


def decode_batch(seq: int, payload: bytes) -> KvBatch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise MalformedMessage(f"payload is not msgpack: {e}") from None
    except Exception as e:  # msgpack raises assorted errors on hostile input
        raise MalformedMessage(f"payload is not msgpack: {type(e).__name__}") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise MalformedMessage("batch must be an array [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise MalformedMessage("batch ts must be a number")
    if not isinstance(events, list):
        raise MalformedMessage("batch events must be an array")
    rank = raw[2] if len(raw) > 2 else None
    if rank is not None and (not _is_int(rank) or not -(1 << 31) <= rank < (1 << 31)):
        raise MalformedMessage("data_parallel_rank must be an i32 or nil")
    if rank is not None and rank < 0:
        rank &= U32_LIMIT - 1  # the reference casts the i32 to u32
    decoded = [e for e in (_event(ev) for ev in events) if e is not None]
    return KvBatch(seq, rank, tuple(decoded))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _hash(v: Any, what: str) -> int:
    if not _is_int(v) or not I64_MIN <= v < U64_LIMIT:
        raise MalformedMessage(f"{what} must be a 64-bit integer")
    return to_signed(v)


def _hashes(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise MalformedMessage("block_hashes must be an array")
    return tuple(_hash(h, "block hash") for h in v)


def _tokens(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise MalformedMessage("token_ids must be an array")
    if v and isinstance(v[0], list):  # EAGLE bigrams
        out = []
        for pair in v:
            if not isinstance(pair, list) or len(pair) != 2:
                raise MalformedMessage("token_ids bigrams must be pairs")
            out.append(pair[0])
        out.append(v[-1][1])
        v = out
    for t in v:
        if not _is_int(t) or not 0 <= t < U32_LIMIT:
            raise MalformedMessage("token ids must be u32")
    return tuple(v)


def _opt_str(v: Any, what: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise MalformedMessage(f"{what} must be a string or nil")
    return v


def _ignored_group(group_idx: Any, kind: Any) -> bool:
    if isinstance(kind, str):
        return kind not in _MAIN_ATTENTION
    return _is_int(group_idx) and group_idx != 0


def _event(ev: Any) -> KvEvent | None:
    if isinstance(ev, dict):
        tag = ev.get("type")
        fields = ev
    elif isinstance(ev, list) and ev and isinstance(ev[0], str):
        tag = ev[0]
        names = _POSITIONS.get(tag, ())
        fields = dict(zip(names, ev[1:], strict=False))
    else:
        raise MalformedMessage("event must be a tagged array or map")
    if tag == "BlockStored":
        for name in ("block_hashes", "token_ids", "block_size"):
            if fields.get(name) is None:
                raise MalformedMessage(f"BlockStored: missing {name}")
        hashes = _hashes(fields["block_hashes"])
        parent = fields.get("parent_block_hash")
        parent = None if parent is None else _hash(parent, "parent_block_hash")
        tokens = _tokens(fields["token_ids"])
        bs = fields["block_size"]
        if not _is_int(bs) or not 0 <= bs < U64_LIMIT:
            raise MalformedMessage("block_size must be an unsigned integer")
        medium = _opt_str(fields.get("medium"), "medium")
        lora = _opt_str(fields.get("lora_name"), "lora_name")
        if _ignored_group(fields.get("group_idx"), fields.get("kv_cache_spec_kind")):
            return None
        return BlocksStored(hashes, parent, tokens, bs, tier_of_medium(medium), lora)
    if tag == "BlockRemoved":
        if fields.get("block_hashes") is None:
            raise MalformedMessage("BlockRemoved: missing block_hashes")
        hashes = _hashes(fields["block_hashes"])
        medium = _opt_str(fields.get("medium"), "medium")
        if _ignored_group(fields.get("group_idx"), fields.get("kv_cache_spec_kind")):
            return None
        return BlocksRemoved(hashes, tier_of_medium(medium))
    if tag == "AllBlocksCleared":
        return AllCleared()
    if tag == "Ignored":
        return None
    raise MalformedMessage(f"unknown event type {str(tag)[:64]!r}")


_POSITIONS = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "kv_cache_spec_kind"),
    "AllBlocksCleared": (),
    "Ignored": (),
}  # fmt: skip


def encode_batch(ts: float, events: list[Any], dp_rank: int | None = 0) -> bytes:
    """A payload in the engines' format (tests, benchmarks and the example publisher)."""
    return msgpack.packb([ts, events, dp_rank])


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=seq < 0)
