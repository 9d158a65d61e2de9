"""Plain bodies: decoded straight into the service's commands, without the models.

Almost every body a router sends is *plain*: valid JSON, no backslash escape, only the
operation's own fields, each of exactly its schema type and range. For those, building pydantic
models costs more than the tracker work. Lifecycle bodies (``/add``, ``/free``,
``/prefill_complete``, ``/batch``) and ``/potential_loads`` bodies are decoded by msgspec
straight into the service's commands (``kv_slot_tracker.service.commands``), which check the same strict
types and ranges in C while decoding (``add_body``, ``free_body``, ``prefill_complete_body``,
``potential_loads_body``, ``batch_operations``).

Anything else returns None and takes the validating path (``kv_slot_tracker.http.body`` and the models),
which alone writes error messages: this module never has to reproduce one.
``tests/api/test_batch_paths.py`` runs generated bodies through both paths and compares.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import NODEFAULT, UNSET

from kv_slot_tracker.core.types import U64_MAX
from kv_slot_tracker.service import commands as c


def hashes_u64(hashes: list[int] | None, look: bool = True) -> list[int] | None:
    """The API's signed 64-bit hashes reinterpreted bit for bit as unsigned. ``look``: first
    check whether any is negative (``min`` compares every hash; a caller that saw a minus sign
    in the body skips it, since then one almost always is)."""
    if not hashes or (look and min(hashes) >= 0):
        return hashes
    return [h & U64_MAX if h < 0 else h for h in hashes]


# -- bodies --------------------------------------------------------------------------------
# ``/add``, ``/free``, ``/prefill_complete``, ``/potential_loads`` and ``/batch`` bodies decode straight into the
# service's commands (``kv_slot_tracker.service.commands``: the same strict types and ranges as the models).
# What a command does not accept (an unknown field, a prompt form given as null) sends the
# whole body to the validating path, as does a backslash escape. msgspec keeps the last of a key
# given twice, as the models' batch parser does; a single call's body with a key given twice
# must take the validating path (its answer is 422), which ``_decode_plain`` finds by counting quotes.


class _Batch(msgspec.Struct, forbid_unknown_fields=True):
    operations: list[c.BatchOperation]


_decode_batch = msgspec.json.Decoder(_Batch).decode
_decode_add = msgspec.json.Decoder(c.Add).decode
_decode_free = msgspec.json.Decoder(c.Free).decode
_decode_prefill = msgspec.json.Decoder(c.PrefillComplete).decode
_decode_potential = msgspec.json.Decoder(c.PotentialLoads).decode
_astuple = msgspec.structs.astuple


def _others(cls: type[msgspec.Struct]) -> tuple[tuple[int, Any, bool], ...]:
    """``(index, default, whether it is a string)`` of each field whose default is neither
    None nor UNSET (``_decode_plain`` counts those two with ``tuple.count``)."""
    fields, defaults = cls.__struct_fields__, cls.__struct_defaults__
    first = len(fields) - len(defaults)
    return tuple(
        (first + i, d, type(d) is str)
        for i, d in enumerate(defaults)
        if d is not None and d is not UNSET and d is not NODEFAULT
    )


_STRUCTS: tuple[type[msgspec.Struct], ...] = (c.Add, c.Free, c.PrefillComplete, c.PotentialLoads)
_ADD, _FREE, _PREFILL, _POTENTIAL = map(_others, _STRUCTS)


def _decode_plain(raw: bytes, decode: Any, others: tuple[tuple[int, Any, bool], ...]) -> Any:
    """The command ``decode`` makes of the body when it is plain and no key repeats, else None.

    Without escapes every ``"`` opens or closes a string: one pair per key and per string
    value. msgspec fills a field not given with its default object itself, so a field holding
    None, UNSET or (``others``) its default object was not given, and every other field was;
    when the body has exactly the quotes of those, no other field was given (each adds a key)
    and none twice. A string decoded from the body is never the default object, so
    ``"routing_group": "default"`` counts as given; a field given its default as null or 0
    (cached objects) takes the validating path: correct, only slower."""
    if b"\\" in raw:
        return None
    try:
        o = decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    values = _astuple(o)
    given = len(values) - values.count(UNSET) - values.count(None)
    strings = list(map(type, values)).count(str)
    for i, default, string in others:
        if values[i] is default:
            given -= 1
            strings -= string
    if raw.count(b'"') != 2 * (given + strings):
        return None  # a key given twice, or a field given its default
    return o


def _prompt_form(o: Any, raw: bytes) -> Any:
    """A decoded prompt command with its form checked: exactly one given, the other made None,
    hashes unsigned (when the body has a minus sign: without one no hash is negative); None
    when both or neither is given (the validating path answers)."""
    hashes, tokens = o.sequence_hashes, o.token_ids
    if hashes is UNSET:
        if tokens is UNSET:
            return None
        o.sequence_hashes = None
    elif tokens is not UNSET:
        return None
    else:
        o.token_ids = None
        if b"-" in raw:
            o.sequence_hashes = hashes_u64(hashes, look=False)
    return o


def add_body(raw: bytes) -> c.Add | None:
    """A plain ``/add`` body's command (prompt form checked, hashes unsigned); None for any
    other body."""
    o = _decode_plain(raw, _decode_add, _ADD)
    if o is None or o.worker_id > U64_MAX or o.new_isl_tokens > U64_MAX:
        return None
    return _prompt_form(o, raw)


def potential_loads_body(raw: bytes) -> c.PotentialLoads | None:
    """A plain ``/potential_loads`` body's command (prompt form checked, hashes unsigned);
    None for any other body."""
    o = _decode_plain(raw, _decode_potential, _POTENTIAL)
    if o is None or o.new_isl_tokens > U64_MAX:
        return None
    return _prompt_form(o, raw)


def free_body(raw: bytes) -> c.Free | None:
    """A plain ``/free`` body's command; None for any other body."""
    return _decode_plain(raw, _decode_free, _FREE)


def prefill_complete_body(raw: bytes) -> c.PrefillComplete | None:
    """A plain ``/prefill_complete`` body's command; None for any other body."""
    return _decode_plain(raw, _decode_prefill, _PREFILL)


def batch_operations(raw: bytes) -> list[c.BatchOperation] | None:
    """A plain batch's commands, each checked as its model checks it; None for any other
    body. An add's prompt form it was not given becomes None, its hashes unsigned."""
    if b"\\" in raw:
        return None
    try:
        ops = _decode_batch(raw).operations
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    has_minus = b"-" in raw
    add = c.Add
    for o in ops:
        if type(o) is add:
            if o.worker_id > U64_MAX or o.new_isl_tokens > U64_MAX:
                return None
            # ``_prompt_form`` written out: a call cost about 2 % more instructions per batch operation
            hashes, tokens = o.sequence_hashes, o.token_ids
            if hashes is UNSET:
                if tokens is UNSET:
                    return None
                # a prompt form not given is None past decoding (the command accepts no null)
                o.sequence_hashes = None  # type: ignore[assignment]
            elif tokens is not UNSET:
                return None
            else:
                o.token_ids = None  # type: ignore[assignment]
                if has_minus:
                    o.sequence_hashes = hashes_u64(hashes, look=False)  # type: ignore[assignment]
    return ops
