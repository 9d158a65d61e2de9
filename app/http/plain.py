"""Plain lifecycle bodies, checked on orjson's decoded values instead of through the models.

Almost every ``/add``, ``/free``, ``/prefill_complete`` and ``/batch`` body a router sends is
*plain*: valid JSON, no backslash escape, only the operation's own fields, each of exactly its
schema type and range. For those, building pydantic models and command objects costs more than
the tracker work. The functions here accept exactly the values the models accept (strict types:
no bool for an int, no float for an int, no null for a field with a default) and return the
operation's fields as a tuple in the order of the service's ``*_fields`` methods.

Lifecycle bodies (``/batch``, ``/add``, ``/free``, ``/prefill_complete``) are decoded by msgspec
straight into the typed structs below, which check the same types and ranges in C while
decoding (``batch_operations``, ``add_body``, ``request_body``); ``/potential_loads`` bodies are
decoded by orjson and checked here.

Anything else returns None and takes the validating path (``app.http.body`` and the models),
which alone writes error messages: this module never has to reproduce one.
``tests/api/test_batch_paths.py`` runs generated bodies through both paths and compares.
"""

from __future__ import annotations

from array import array
from typing import Annotated, Any

import msgspec
import orjson
from msgspec import UNSET, Meta, UnsetType

from app.core.limits import MAX_ID_LENGTH, MAX_NAME_LENGTH
from app.core.types import U32_MAX, U64_MAX

DEFAULT_GROUP = "default"
POTENTIAL_KEYS = frozenset(
    {"model_name", "routing_group", "sequence_hashes", "token_ids", "lora_name", "new_isl_tokens"}
)

_ABSENT: Any = object()
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_MAX_PREFILL_MS = 1e12
SPAN_WORTH = 1024  # bytes of numbers below which number_span gives no span

Fields = tuple[Any, ...]


def decode(raw: bytes) -> Any:
    """The decoded body when it may be plain, else None: escapes, and what orjson rejects
    (NaN and Infinity literals among it, which the models' parser takes), are left to the
    validating path."""
    if b"\\" in raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def plain_object(
    raw: bytes, keys: frozenset[str], span: tuple[int, int] = (0, 0)
) -> dict[str, Any] | None:
    """A single call's body: a JSON object with only ``keys``, none given twice (the models'
    path answers a duplicate field 422; orjson keeps the last one).

    Duplicates are found by counting quotes. Without escapes every ``"`` opens or closes a
    string, and the strings of an object are its keys and what its values hold: at least one
    per key given and one per string value kept. A key given twice adds a string that the
    decoded object does not have, so the count is exact only when no key repeats (and when no
    value holds a string nested in a list, which is not plain either). One C scan, where
    matching every ``"key":`` costs five times as much. ``span``: the body's ``number_span``,
    if the caller has it (it holds no quote)."""
    d = decode(raw)
    if type(d) is not dict or not d.keys() <= keys:
        return None
    lo, hi = span
    quotes = raw.count(b'"', 0, lo) + raw.count(b'"', hi) if hi else raw.count(b'"')
    if quotes != 2 * (len(d) + list(map(type, d.values())).count(str)):
        return None
    return d


def number_span(raw: bytes) -> tuple[int, int]:
    """``(lo, hi)``: from the first ``[`` to the last ``]`` when that text holds no quote, ``t``
    or ``f``, so only numbers and punctuation: no key, string or boolean. ``(0, 0)``
    otherwise. A long prompt's hashes are most of a body; the quote count and the search for
    booleans skip them (a word search costs ten times a single-byte one). Spans shorter than
    ``SPAN_WORTH`` bytes are not used: splitting a scan costs more than they save."""
    if len(raw) < SPAN_WORTH:
        return 0, 0
    lo = raw.find(b"[")
    if lo < 0:
        return 0, 0
    hi = raw.rfind(b"]")
    if hi - lo < SPAN_WORTH:
        return 0, 0
    if raw.find(b'"', lo, hi) >= 0 or raw.find(b"t", lo, hi) >= 0 or raw.find(b"f", lo, hi) >= 0:
        return 0, 0
    return lo, hi


def no_bools(raw: bytes, span: tuple[int, int] | None = None) -> bool:
    """Whether the body has no JSON boolean (then ``array`` checks int lists in C)."""
    lo, hi = number_span(raw) if span is None else span
    if not hi:
        return b"true" not in raw and b"false" not in raw
    rest = raw[:lo] + raw[hi:]  # the span holds no 't' or 'f'
    return b"true" not in rest and b"false" not in rest


def prompt_object(raw: bytes, keys: frozenset[str]) -> tuple[dict[str, Any], bool, bool] | None:
    """``plain_object`` of a body that carries a prompt, ``no_bools`` of it (with the span of
    its numbers found once for both), and whether it has a minus sign (without one no hash is
    negative, and ``hashes_u64`` has nothing to do)."""
    span = number_span(raw)
    d = plain_object(raw, keys, span)
    return None if d is None else (d, no_bools(raw, span), b"-" in raw)


def hashes_u64(hashes: list[int] | None, look: bool = True) -> list[int] | None:
    """The API's signed 64-bit hashes reinterpreted bit for bit as unsigned. ``look``: first
    check whether any is negative (``min`` compares every hash; a caller that saw a minus sign
    in the body skips it, since then one almost always is)."""
    if not hashes or (look and min(hashes) >= 0):
        return hashes
    return [h & U64_MAX if h < 0 else h for h in hashes]


def _ints(values: Any, code: str, low: int, high: int, no_bool: bool) -> bool:
    """Whether ``values`` is a list of ints (no bools) in ``low..high`` (``code``: the array
    type of exactly that range)."""
    if type(values) is not list:
        return False
    if not values:
        return True
    if no_bool:
        try:
            array(code, values)
        except (TypeError, OverflowError):
            return False
        return True
    return set(map(type, values)) == {int} and min(values) >= low and max(values) <= high


def prompt_fields(d: dict[str, Any], no_bool: bool, signed: bool = True) -> tuple[Any, Any] | None:
    """``(sequence_hashes, token_ids)``, exactly one of them given (hashes made unsigned;
    ``signed``: whether any may be negative)."""
    hashes = d.get("sequence_hashes", _ABSENT)  # an explicit null is invalid here
    tokens = d.get("token_ids", _ABSENT)
    if hashes is not _ABSENT:
        if tokens is not _ABSENT or not _ints(hashes, "q", _I64_MIN, _I64_MAX, no_bool):
            return None  # both forms: the validating path answers with the reference's text
        return (hashes_u64(hashes, look=False) if signed else hashes), None
    if tokens is _ABSENT or not _ints(tokens, "I", 0, U32_MAX, no_bool):
        return None
    return None, tokens


def potential_fields(d: dict[str, Any], no_bool: bool, signed: bool = True) -> Fields | None:
    """``(model_name, routing_group, sequence_hashes, token_ids, lora_name, new_isl_tokens)``
    of a potential-loads body; the caller checked the key set."""
    model = d.get("model_name")
    group = d.get("routing_group", DEFAULT_GROUP)
    isl = d.get("new_isl_tokens", 0)
    lora = d.get("lora_name")
    if (
        type(model) is not str
        or type(group) is not str
        or type(isl) is not int
        or not 0 <= isl <= U64_MAX
        or (lora is not None and (type(lora) is not str or len(lora) > MAX_NAME_LENGTH))
        or len(model) > MAX_NAME_LENGTH
        or len(group) > MAX_NAME_LENGTH
    ):
        return None
    prompt = prompt_fields(d, no_bool, signed)
    if prompt is None:
        return None
    return model, group, prompt[0], prompt[1], lora, isl


# -- /batch --------------------------------------------------------------------------------
# The operations of a plain batch. Each struct accepts part of what its model accepts
# (``app.http.schemas``: the same strict types and ranges) and reads it the same way; what it
# does not accept (an unknown field, a prompt form given as null, a backslash escape) sends the
# whole body to the validating path. msgspec keeps the last of a key given twice, as the models'
# batch parser does. Ranges beyond int64 (u64 ids and token counts) are checked after decoding.

_Hash = Annotated[int, Meta(ge=_I64_MIN, le=_I64_MAX)]
_U32 = Annotated[int, Meta(ge=0, le=U32_MAX)]
_Unsigned = Annotated[int, Meta(ge=0)]  # and <= U64_MAX, checked after decoding
_Ms = (
    Annotated[int, Meta(ge=0, le=int(_MAX_PREFILL_MS))]
    | Annotated[float, Meta(ge=0, le=_MAX_PREFILL_MS)]
)
_Fraction = Annotated[int, Meta(ge=0, le=1)] | Annotated[float, Meta(ge=0, le=1)]
_Name = Annotated[str, Meta(max_length=MAX_NAME_LENGTH)]
_Id = Annotated[str, Meta(max_length=MAX_ID_LENGTH)]


class BatchAdd(msgspec.Struct, tag_field="op", tag="add", forbid_unknown_fields=True):
    model_name: _Name
    request_id: _Id
    worker_id: _Unsigned
    dp_rank: _U32
    routing_group: _Name = DEFAULT_GROUP
    # exactly one of the two; after ``batch_operations`` the other is None
    sequence_hashes: list[_Hash] | UnsetType = UNSET  # unsigned after batch_operations
    token_ids: list[_U32] | UnsetType = UNSET
    new_isl_tokens: _Unsigned = 0
    expected_prefill_ms: _Ms | None = None
    track_prefill_tokens: bool | None = None
    expected_output_tokens: _U32 | None = None
    lora_name: _Name | None = None


class BatchFree(msgspec.Struct, tag_field="op", tag="free", forbid_unknown_fields=True):
    model_name: _Name
    request_id: _Id
    routing_group: _Name = DEFAULT_GROUP


class BatchPrefillComplete(
    msgspec.Struct, tag_field="op", tag="prefill_complete", forbid_unknown_fields=True
):
    model_name: _Name
    request_id: _Id
    routing_group: _Name = DEFAULT_GROUP


class BatchOutputBlock(
    msgspec.Struct, tag_field="op", tag="output_block", forbid_unknown_fields=True
):
    model_name: _Name
    request_id: _Id
    routing_group: _Name = DEFAULT_GROUP
    decay_fraction: _Fraction | None = None


BatchOperation = BatchAdd | BatchFree | BatchPrefillComplete | BatchOutputBlock


class _Batch(msgspec.Struct, forbid_unknown_fields=True):
    operations: list[BatchOperation]


_decode_batch = msgspec.json.Decoder(_Batch).decode


def _prompt_form(hashes: Any, tokens: Any, signed: bool) -> tuple[Any, Any] | None:
    """A decoded add's ``(sequence_hashes, token_ids)``: exactly one given, the other None,
    hashes unsigned; None when both or neither is given (the validating path answers).
    ``signed``: the body has a minus sign (without one no hash is negative)."""
    if hashes is UNSET:
        return None if tokens is UNSET else (None, tokens)
    if tokens is not UNSET:
        return None
    return (hashes_u64(hashes, look=False) if signed else hashes), None


# -- single calls --------------------------------------------------------------------------
# ``/add``, ``/free`` and ``/prefill_complete`` bodies decoded the same way, except that a key
# given twice must take the validating path (its answer is 422), so every optional field
# defaults to UNSET: the fields given and their string values tell how many quotes the body
# has when no key repeats (``plain_object``).


class PlainAdd(msgspec.Struct, forbid_unknown_fields=True):
    model_name: _Name
    request_id: _Id
    worker_id: _Unsigned
    dp_rank: _U32
    routing_group: _Name | UnsetType = UNSET
    sequence_hashes: list[_Hash] | UnsetType = UNSET
    token_ids: list[_U32] | UnsetType = UNSET
    new_isl_tokens: _Unsigned | UnsetType = UNSET
    expected_prefill_ms: _Ms | None | UnsetType = UNSET
    track_prefill_tokens: bool | None | UnsetType = UNSET
    expected_output_tokens: _U32 | None | UnsetType = UNSET
    lora_name: _Name | None | UnsetType = UNSET


class PlainRequest(msgspec.Struct, forbid_unknown_fields=True):
    model_name: _Name
    request_id: _Id
    routing_group: _Name | UnsetType = UNSET


_decode_add = msgspec.json.Decoder(PlainAdd).decode
_decode_request = msgspec.json.Decoder(PlainRequest).decode
_astuple = msgspec.structs.astuple


def _single(raw: bytes, decode: Any) -> Any:
    """The body decoded by ``decode`` when it is plain and no key repeats, else None."""
    if b"\\" in raw:
        return None
    try:
        o = decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    values = _astuple(o)
    given = len(values) - values.count(UNSET)
    if raw.count(b'"') != 2 * (given + list(map(type, values)).count(str)):
        return None  # a key given twice
    return o


def add_body(raw: bytes) -> Fields | None:
    """A plain ``/add`` body's fields in ``SlotTrackerService.add_fields`` order, hashes
    already unsigned; None for any other body."""
    o = _single(raw, _decode_add)
    if o is None:
        return None
    prompt = _prompt_form(o.sequence_hashes, o.token_ids, b"-" in raw)
    if prompt is None:
        return None
    hashes, tokens = prompt
    isl = o.new_isl_tokens
    if isl is UNSET:
        isl = 0
    elif isl > U64_MAX:
        return None
    if o.worker_id > U64_MAX:
        return None
    group = o.routing_group
    ms, track, eot, lora = (
        o.expected_prefill_ms,
        o.track_prefill_tokens,
        o.expected_output_tokens,
        o.lora_name,
    )
    return (
        o.model_name,
        DEFAULT_GROUP if group is UNSET else group,
        hashes,
        tokens,
        None if lora is UNSET else lora,
        o.request_id,
        o.worker_id,
        o.dp_rank,
        isl,
        None if ms is UNSET else ms,
        None if track is UNSET else track,
        None if eot is UNSET else eot,
    )


def request_body(raw: bytes) -> Fields | None:
    """A plain ``/free`` or ``/prefill_complete`` body's ``(model_name, routing_group,
    request_id)``; None for any other body."""
    o = _single(raw, _decode_request)
    if o is None:
        return None
    group = o.routing_group
    return o.model_name, DEFAULT_GROUP if group is UNSET else group, o.request_id


def batch_operations(raw: bytes) -> list[BatchOperation] | None:
    """A plain batch's operations, each checked as its model checks it; None for any other
    body. An add's prompt form it was not given becomes None, its hashes unsigned."""
    if b"\\" in raw:
        return None
    try:
        ops = _decode_batch(raw).operations
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    signed = b"-" in raw
    for o in ops:
        if type(o) is BatchAdd:
            if o.worker_id > U64_MAX or o.new_isl_tokens > U64_MAX:
                return None
            # ``_prompt_form`` written out: calling it cost about 2 % more instructions per batch operation
            hashes, tokens = o.sequence_hashes, o.token_ids
            if hashes is UNSET:
                if tokens is UNSET:
                    return None
                o.sequence_hashes = None
            elif tokens is not UNSET:
                return None
            else:
                o.token_ids = None
                if signed:
                    o.sequence_hashes = hashes_u64(hashes, look=False)  # type: ignore[arg-type]
    return ops
