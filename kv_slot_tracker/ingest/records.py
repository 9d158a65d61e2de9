"""KV-event messages as the engines publish them, decoded and validated.

The wire format (vLLM ``vllm/distributed/kv_events.py``; SGLang
``sglang/srt/disaggregation/kv_events.py`` publishes the same): a ZMQ multipart message of three
frames on a PUB socket,

1. a topic (any bytes; subscribers subscribe to everything),
2. the batch's sequence number, 8 bytes big-endian (0, 1, 2, ... per publisher),
3. a msgpack ``EventBatch`` (msgspec ``array_like``): the array ``[ts, [event, ...],
   data_parallel_rank]`` (SGLang names the third ``attn_dp_rank``; it may be absent or nil: the
   socket's rank applies; a negative rank is read as the u32 of the same 32 bits).

An event is a msgspec tagged struct. Both engines (vLLM 0.33, SGLang 0.5.23) encode it as a map
with a ``type`` key and omit fields left at their default; the older positional form, an array
whose first element is the tag, is read too, in vLLM's field order:

* ``BlockStored``: ``block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, locality,
  ownership, session_id, lookahead_token_ids`` (SGLang's map adds ``cache_salt``);
* ``BlockRemoved``: ``block_hashes, medium, group_idx, locality, ownership`` (vLLM's order; the
  reader takes the four positions after ``medium`` as ``group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window, locality, ownership`` when their types fit that layout, else as
  loose metadata, as the reference does);
* ``AllBlocksCleared`` (``ownership``); ``Ignored``.

What the reference (Dynamo 1.6.1) does with each field, and so this module (the stateless part;
the per-listener part, KV cache groups and cache salts, is ``normalize.py``):

* ``ownership`` present (any string, ``""`` too): the event is not the framework's; skipped.
* ``locality`` other than ``"LOCAL"`` (``"REMOTE"``, any other string, case-sensitive):
  skipped.
* ``medium``: ``GPU``/``DEVICE`` (or absent, nil, ``""``) the device tier; ``CPU``/
  ``CPU_PINNED``/``CPU_TIER1`` host; ``CPU_TIER2``/``DISK``/``NVME``/``STORAGE`` disk;
  ``EXTERNAL``/``NETWORK``/``REMOTE``/``SHARED`` the external tier; any other value skipped.
* ``cache_salt`` (a map key), else a ``"dynamo-cache-salt:"`` item of the first block's
  ``extra_keys`` (after an item equal to ``lora_name``): the event's cache namespace; ``""`` is
  none.
* ``token_ids`` as bigram pairs (EAGLE): the first token of each pair, then the last pair's
  second token; each block is then hashed with the token after it (``eagle``).
* ``lora_id``, ``session_id``, ``lookahead_token_ids``, ``kv_cache_spec_sliding_window``: read,
  not used; unknown map keys and extra positions are ignored.

Block hashes must be integers (signed or unsigned 64-bit, the same block either way: they are
decoded in the service's signed form, ``kv_slot_tracker.core.hashing``); vLLM's bytes hashes
(``--prefix-caching-hash-algo sha256`` without an integer form) do not decode, as on the
reference.

The replay socket (vLLM's ROUTER at ``replay_endpoint``): a DEALER sends ``[b"", start_seq]``
(8 bytes big-endian) and receives ``[b"", seq, payload]`` per buffered batch from ``start_seq``
on, then ``[b"", -1 (8 bytes, signed), b""]``.

Everything the publisher controls is bounded: the message size by the socket (``MAXMSGSIZE``),
the events, hashes and tokens by that size. Any violation raises ``MalformedMessage`` and the
whole message is skipped (the reference drops a batch that fails to decode the same way; a field
of the wrong type in a map fails the batch there too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

import msgpack

from kv_slot_tracker.core.bounds import I64_MIN, U32_LIMIT, U64_LIMIT
from kv_slot_tracker.core.hashing import to_signed
from kv_slot_tracker.core.selection.kv_blocks import tier_of_medium

SEQ_BYTES = 8
END_OF_REPLAY = -1

CACHE_SALT_PREFIX = "dynamo-cache-salt:"
"""How Dynamo tags a cache salt it hands vLLM, which vLLM publishes in ``extra_keys``."""


class MalformedMessage(ValueError):
    """A message that does not decode; the text says why."""


@dataclass(frozen=True, slots=True)
class BlocksStored:
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: int
    """``kv_index`` tier of the medium."""
    lora_name: str | None
    cache_salt: str | None = None
    """The event's cache namespace (non-empty), or ``None``."""
    group_idx: int | None = None
    kind: str | None = None
    """``kv_cache_spec_kind`` as published."""
    eagle: bool = False
    """``token_ids`` came as bigrams: each block's hash covers the token after it."""


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    block_hashes: tuple[int, ...]
    tier: int
    group_idx: int | None = None
    kind: str | None = None


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
    decoded: list[KvEvent] = []
    for ev in events:
        if type(ev) is list:
            out = _array_event(ev)
        elif type(ev) is dict:
            out = _map_event(ev)
        else:
            raise MalformedMessage("event must be a tagged array or map")
        if out is not None:
            decoded.append(out)
    return KvBatch(seq, rank, tuple(decoded))


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _hash(v: Any, what: str) -> int:
    if not _is_int(v) or not I64_MIN <= v < U64_LIMIT:
        raise MalformedMessage(f"{what} must be a 64-bit integer")
    return to_signed(v)


def _hashes(v: Any) -> tuple[int, ...]:
    if type(v) is not list:
        raise MalformedMessage("block_hashes must be an array")
    return tuple(_hash(h, "block hash") for h in v)


def _tokens(v: Any) -> tuple[tuple[int, ...], bool]:
    """The token ids and whether they came as EAGLE bigrams."""
    if type(v) is not list:
        raise MalformedMessage("token_ids must be an array")
    eagle = bool(v) and type(v[0]) is list
    if eagle:
        out = []
        for pair in v:
            if type(pair) is not list or len(pair) != 2:
                raise MalformedMessage("token_ids bigrams must be pairs")
            out.append(pair[0])
        out.append(v[-1][1])
        v = out
    for t in v:
        if not _is_int(t) or not 0 <= t < U32_LIMIT:
            raise MalformedMessage("token ids must be u32")
    return tuple(v), eagle


def _opt_str(v: Any, what: str) -> str | None:
    if v is not None and type(v) is not str:
        raise MalformedMessage(f"{what} must be a string or nil")
    return v


def _opt_u32(v: Any, what: str) -> int | None:
    if v is None:
        return None
    if not _is_int(v) or not 0 <= v < U32_LIMIT:
        raise MalformedMessage(f"{what} must be a u32 or nil")
    return v


def _tier(medium: Any) -> int | None:
    """The tier of ``medium`` (nil and ``""`` are the device); ``None``: a medium the reference
    does not know (the event is skipped)."""
    return tier_of_medium(_opt_str(medium, "medium") or None)


def _salt(cache_salt: Any, extra_keys: Any, lora_name: str | None) -> str | None:
    """The event's cache namespace: ``cache_salt``, else the tagged item of ``extra_keys``."""
    if cache_salt is None and extra_keys is None:
        return None
    salt = _opt_str(cache_salt, "cache_salt")
    keys = _extra_keys(extra_keys)
    if salt:
        return salt
    if salt is None and keys and keys[0]:
        unmatched = lora_name or None
        for item in keys[0]:
            if type(item) is not str:
                continue
            if unmatched is not None and item == unmatched:
                unmatched = None
                continue
            if item.startswith(CACHE_SALT_PREFIX) and len(item) > len(CACHE_SALT_PREFIX):
                return item[len(CACHE_SALT_PREFIX) :]
    return None


_EXTRA_ITEM = (str, int, float, bool, bytes)


def _extra_keys(v: Any) -> list[Any] | None:
    """``extra_keys``: nil, or per block nil or a list of strings, ``[string, int]`` pairs,
    bytes, numbers or booleans."""
    if v is None:
        return None
    if type(v) is not list:
        raise MalformedMessage("extra_keys must be an array or nil")
    for block in v:
        if block is None:
            continue
        if type(block) is not list:
            raise MalformedMessage("extra_keys entries must be arrays or nil")
        for item in block:
            if isinstance(item, _EXTRA_ITEM):
                continue
            if type(item) is list and len(item) == 2 and type(item[0]) is str and _is_int(item[1]):
                continue
            raise MalformedMessage("extra_keys items must be strings, numbers or pairs")
    return v


def _not_local(locality: Any) -> bool:
    """``locality`` present and not ``"LOCAL"``: the blocks are not the worker's own."""
    return _opt_str(locality, "locality") not in (None, "LOCAL")


def _stored(
    hashes: Any, parent: Any, tokens: Any, bs: Any, medium: Any, lora: Any,
    salt: str | None, group: int | None, kind: str | None,
) -> BlocksStored | None:  # fmt: skip
    block_hashes = _hashes(hashes)
    parent_hash = None if parent is None else _hash(parent, "parent_block_hash")
    token_ids, eagle = _tokens(tokens)
    if not _is_int(bs) or not 0 <= bs < U64_LIMIT:
        raise MalformedMessage("block_size must be an unsigned integer")
    tier = _tier(medium)
    if tier is None:
        return None
    return BlocksStored(
        block_hashes, parent_hash, token_ids, bs, tier, lora, salt, group, kind, eagle
    )


def _map_event(ev: dict[str, Any]) -> KvEvent | None:
    tag = ev.get("type")
    if tag == "BlockStored":
        for name in ("block_hashes", "token_ids", "block_size"):
            if name not in ev:
                raise MalformedMessage(f"BlockStored: missing {name}")
        lora = _opt_str(ev.get("lora_name"), "lora_name")
        salt = _salt(ev.get("cache_salt"), ev.get("extra_keys"), lora)
        group = _opt_u32(ev.get("group_idx"), "group_idx")
        kind = _opt_str(ev.get("kv_cache_spec_kind"), "kv_cache_spec_kind")
        _opt_u32(ev.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window")
        _opt_str(ev.get("session_id"), "session_id")
        if _opt_str(ev.get("ownership"), "ownership") is not None or _not_local(ev.get("locality")):
            _stored(ev["block_hashes"], ev.get("parent_block_hash"), ev["token_ids"],
                    ev["block_size"], ev.get("medium"), lora, None, None, None)  # fmt: skip
            return None
        return _stored(
            ev["block_hashes"], ev.get("parent_block_hash"), ev["token_ids"], ev["block_size"],
            ev.get("medium"), lora, salt, group, kind,
        )  # fmt: skip
    if tag == "BlockRemoved":
        if "block_hashes" not in ev:
            raise MalformedMessage("BlockRemoved: missing block_hashes")
        hashes = _hashes(ev["block_hashes"])
        tier = _tier(ev.get("medium"))
        group = _opt_u32(ev.get("group_idx"), "group_idx")
        kind = _opt_str(ev.get("kv_cache_spec_kind"), "kv_cache_spec_kind")
        _opt_u32(ev.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window")
        skip = _opt_str(ev.get("ownership"), "ownership") is not None
        if _not_local(ev.get("locality")) or skip or tier is None:
            return None
        return BlocksRemoved(hashes, tier, group, kind)
    if tag == "AllBlocksCleared":
        return AllCleared() if _opt_str(ev.get("ownership"), "ownership") is None else None
    if tag == "Ignored":
        return None
    if tag is None:
        raise MalformedMessage("event map without a type")
    raise MalformedMessage(f"unknown event type {str(tag)[:64]!r}")


def _at(ev: list[Any], i: int) -> Any:
    return ev[i] if len(ev) > i else None


# A trailing positional field, as the reference classifies it: a u32, a text, a list (block
# multimodal infos, BlockStored only) or anything else (ignored).
_U, _T, _L, _X = 0, 1, 2, 3


def _trailing_kind(v: Any) -> int:
    if _is_int(v) and 0 <= v < U32_LIMIT:
        return _U
    if type(v) is str:
        return _T
    if type(v) is list:
        return _L
    return _X


def _trailing(
    fields: list[Any], stored: bool
) -> tuple[int | None, str | None, bool]:  # (group_idx, kind, skipped: not local / not framework)
    """The metadata after ``extra_keys`` (stored) or ``medium`` (removed): at most five fields,
    read as the fixed layout ``group_idx, kind, sliding_window, locality, ownership`` when there
    are four or more and their types fit it, else each u32 as the group (then the sliding
    window) and each text as the kind."""
    fields = fields[:5]
    kinds = [None if v is None else _trailing_kind(v) for v in fields]
    if not stored:
        kinds = [_X if k == _L else k for k in kinds]
    layout = (_U, _T, _U, _T, _T)
    if len(fields) >= 4 and all(
        k is None or k == want for k, want in zip(kinds, layout, strict=False)
    ):
        group = fields[0]
        kind = fields[1] if len(fields) > 1 else None
        locality = fields[3] if len(fields) > 3 else None
        ownership = fields[4] if len(fields) > 4 else None
        skipped = ownership is not None or locality not in (None, "LOCAL")
        return group, kind, skipped
    group = kind = None
    window = None
    for v, k in zip(fields, kinds, strict=True):
        if k == _U:
            if group is None:
                group = v
            elif window is None:
                window = v
        elif k == _T:
            kind = v
    return group, kind, False


_NO_TRAILING: tuple[int | None, str | None, bool] = (None, None, False)


def _array_event(ev: list[Any]) -> KvEvent | None:
    if not ev or type(ev[0]) is not str:
        raise MalformedMessage("event must be a tagged array or map")
    tag = ev[0]
    if tag == "BlockStored":
        if len(ev) < 4 or ev[3] is None:
            raise MalformedMessage("BlockStored: missing token_ids")
        if len(ev) < 5 or ev[4] is None:
            raise MalformedMessage("BlockStored: missing block_size")
        if ev[1] is None:
            raise MalformedMessage("BlockStored: missing block_hashes")
        lora_id = _at(ev, 5)
        if lora_id is not None and (not _is_int(lora_id) or not 0 <= lora_id < U64_LIMIT):
            raise MalformedMessage("lora_id must be a u64 or nil")
        lora = _opt_str(_at(ev, 7), "lora_name")
        salt = _salt(None, _at(ev, 8), lora)
        group, kind, skipped = _trailing(ev[9:], True) if len(ev) > 9 else _NO_TRAILING
        event = _stored(ev[1], ev[2], ev[3], ev[4], _at(ev, 6), lora, salt, group, kind)
        return None if skipped else event
    if tag == "BlockRemoved":
        if len(ev) < 2 or ev[1] is None:
            raise MalformedMessage("BlockRemoved: missing block_hashes")
        hashes = _hashes(ev[1])
        tier = _tier(_at(ev, 2))
        group, kind, skipped = _trailing(ev[3:], False) if len(ev) > 3 else _NO_TRAILING
        if skipped or tier is None:
            return None
        return BlocksRemoved(hashes, tier, group, kind)
    if tag == "AllBlocksCleared":
        return AllCleared() if _opt_str(_at(ev, 1), "ownership") is None else None
    if tag == "Ignored":
        return None
    raise MalformedMessage(f"unknown event type {tag[:64]!r}")


def encode_batch(ts: float, events: list[Any], dp_rank: int | None = 0) -> bytes:
    """A payload in the engines' format (tests, benchmarks and the example publisher)."""
    payload: bytes = msgpack.packb([ts, events, dp_rank])
    return payload


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=seq < 0)
