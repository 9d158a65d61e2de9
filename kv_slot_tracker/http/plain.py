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
from msgspec import UNSET

from kv_slot_tracker.core.types import U64_MAX
from kv_slot_tracker.service import commands as c

# -- bodies --------------------------------------------------------------------------------
# ``/add``, ``/free``, ``/prefill_complete``, ``/potential_loads`` and ``/batch`` bodies decode straight into the
# service's commands (``kv_slot_tracker.service.commands``: the same strict types and ranges as the models).
# What a command does not accept (an unknown field, a prompt form given as null) sends the
# whole body to the validating path, as does a backslash escape. msgspec keeps the last of a key
# given twice, as the models' batch parser does; a single call's body with a key given twice
# must take the validating path (its answer is 422), which ``_single`` finds by counting quotes.


class _Batch(msgspec.Struct, forbid_unknown_fields=True):
    operations: list[c.BatchOperation]


_decode_batch = msgspec.json.Decoder(_Batch).decode
_decode_add = msgspec.json.Decoder(c.Add).decode
_decode_free = msgspec.json.Decoder(c.Free).decode
_decode_prefill = msgspec.json.Decoder(c.PrefillComplete).decode
_decode_potential = msgspec.json.Decoder(c.PotentialLoads).decode


_DEFAULT_GROUP = c.DEFAULT_ROUTING_GROUP
_ZERO = 0  # ``new_isl_tokens``' default object (msgspec fills a field not given with it)


def _decoded(raw: bytes, decode: Any) -> Any:
    """The command ``decode`` makes of a body without escapes, else None."""
    if b"\\" in raw:
        return None
    try:
        return decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


# A single call's key given twice is found by counting quotes: without escapes every ``"``
# opens or closes a string, one pair per key and per string value. msgspec fills a field not
# given with its default object itself, so a field holding it was not given and every other
# field was; when the body has exactly the quote pairs of the fields given, no other key was
# given and none twice. A string decoded from the body is never the default object, so
# ``"routing_group": "default"`` counts as given; a field given its default as null or 0
# (cached objects) does not, and the body takes the validating path: correct, only slower.
# Each command's count is written out: a generic walk over the fields cost about 1,000
# instructions per call (``bench/RESULTS.md``).


def _quotes(raw: bytes) -> int:
    """How many ``"`` the body holds. A count runs a few instructions per byte, a search at
    memchr speed: when the span from the first ``[`` to the last ``]`` (a prompt's numbers,
    most of a body) holds no quote, only the rest is counted."""
    lo = raw.find(b"[")
    if lo >= 0:
        hi = raw.rfind(b"]")
        if raw.find(b'"', lo, hi) < 0:
            return raw.count(b'"', 0, lo) + raw.count(b'"', hi)
    return raw.count(b'"')


def _keyed(raw: bytes, decode: Any) -> Any:
    """A ``/free`` or ``/prefill_complete`` body's command: every field a string, so four
    quotes per field given (``model_name`` and ``request_id`` always)."""
    o = _decoded(raw, decode)
    if o is None or _quotes(raw) != (8 if o.routing_group is _DEFAULT_GROUP else 12):
        return None
    return o


def _prompt_form(o: Any) -> Any:
    """A decoded prompt command with its form checked: exactly one given, the other made None
    (hashes stay as given: ``kv_slot_tracker.core.hashing``); None when both or neither is
    given (the validating path answers)."""
    hashes, tokens = o.sequence_hashes, o.token_ids
    if hashes is UNSET:
        if tokens is UNSET:
            return None
        o.sequence_hashes = None
    elif tokens is not UNSET:
        return None
    else:
        o.token_ids = None
    return o


def add_body(raw: bytes) -> c.Add | None:
    """A plain ``/add`` body's command (prompt form checked); None for any other body."""
    o = _decoded(raw, _decode_add)
    if o is None or o.worker_id > U64_MAX or o.new_isl_tokens > U64_MAX:
        return None
    # model_name, request_id (two pairs each), worker_id, dp_rank, the prompt (one pair)
    pairs = 7 if o.routing_group is _DEFAULT_GROUP else 9
    if o.lora_name is not None:
        pairs += 2
    if o.new_isl_tokens is not _ZERO:
        pairs += 1
    pairs += 3 - (o.expected_prefill_ms, o.track_prefill_tokens, o.expected_output_tokens).count(
        None
    )
    if _quotes(raw) != 2 * pairs:
        return None
    return _prompt_form(o)  # None unless exactly one prompt form was given


def potential_loads_body(raw: bytes) -> c.PotentialLoads | None:
    """A plain ``/potential_loads`` body's command (prompt form checked); None for any other
    body."""
    o = _decoded(raw, _decode_potential)
    if o is None or o.new_isl_tokens > U64_MAX:
        return None
    pairs = 3 if o.routing_group is _DEFAULT_GROUP else 5  # model_name, the prompt
    if o.lora_name is not None:
        pairs += 2
    if o.new_isl_tokens is not _ZERO:
        pairs += 1
    if _quotes(raw) != 2 * pairs:
        return None
    return _prompt_form(o)


def free_body(raw: bytes) -> c.Free | None:
    """A plain ``/free`` body's command; None for any other body."""
    return _keyed(raw, _decode_free)


def prefill_complete_body(raw: bytes) -> c.PrefillComplete | None:
    """A plain ``/prefill_complete`` body's command; None for any other body."""
    return _keyed(raw, _decode_prefill)


def batch_operations(raw: bytes) -> list[c.BatchOperation] | None:
    """A plain batch's commands, each checked as its model checks it; None for any other
    body (a key given twice in an operation included: counted as a single call's are). An
    add's prompt form it was not given becomes None."""
    if b"\\" in raw:
        return None
    try:
        ops = _decode_batch(raw).operations
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    add, output, group, zero = c.Add, c.OutputBlock, _DEFAULT_GROUP, _ZERO
    # quote pairs: "operations", and per operation "op", its value, model_name, request_id
    pairs = 1 + 6 * len(ops)
    o: Any  # narrowed by ``type(o) is``, which mypy does not follow here
    for o in ops:
        if o.routing_group is not group:
            pairs += 2
        kind = type(o)
        if kind is add:
            if o.worker_id > U64_MAX or o.new_isl_tokens > U64_MAX:
                return None
            # ``_prompt_form`` written out: a call cost about 2 % more instructions per batch operation
            if o.sequence_hashes is UNSET:
                if o.token_ids is UNSET:
                    return None
                o.sequence_hashes = None
            elif o.token_ids is not UNSET:
                return None
            else:
                o.token_ids = None
            # worker_id, dp_rank, the prompt, and the optional fields given (as ``add_body``;
            # three tests here cost about 250 instructions per operation less than a tuple's
            # ``count``)
            pairs += 3
            if o.expected_prefill_ms is not None:
                pairs += 1
            if o.track_prefill_tokens is not None:
                pairs += 1
            if o.expected_output_tokens is not None:
                pairs += 1
            if o.lora_name is not None:
                pairs += 2
            if o.new_isl_tokens is not zero:
                pairs += 1
        elif kind is output and o.decay_fraction is not None:
            pairs += 1
    if raw.count(b'"') != 2 * pairs:
        return None  # a key given twice in an operation, or a field given its default
    return ops
