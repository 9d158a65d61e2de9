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

import re
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET

from kv_slot_tracker.core.types import U64_MAX
from kv_slot_tracker.service import commands

# -- bodies --------------------------------------------------------------------------------
# ``/add``, ``/free``, ``/prefill_complete``, ``/potential_loads`` and ``/batch`` bodies decode straight into the
# service's commands (``kv_slot_tracker.service.commands``: the same strict types and ranges as the models).
# What a command does not accept (an unknown field, a prompt form given as null) sends the
# whole body to the validating path, as does a backslash escape. msgspec keeps the last of a key
# given twice, as the models' batch parser does; a single call's body with a key given twice
# must take the validating path (its answer is 422), which ``_single`` finds by counting quotes.


class _Batch(msgspec.Struct, forbid_unknown_fields=True):
    operations: list[commands.BatchOperation]


_decode_batch = msgspec.json.Decoder(_Batch).decode
_decode_add = msgspec.json.Decoder(commands.Add).decode
_decode_free = msgspec.json.Decoder(commands.Free).decode
_decode_prefill = msgspec.json.Decoder(commands.PrefillComplete).decode
_decode_potential = msgspec.json.Decoder(commands.PotentialLoads).decode


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
# given with its default object itself, so a field holding another object was given; when the
# body has exactly the quote pairs of the fields given, no other key was given and none twice.
# What each field adds (a key's pair, and a pair for a string value) is derived once, at
# import, from the command structs' fields (``_Weights``): a field added to a struct is counted
# without an edit here, and a field whose value could hold quotes of its own (a list of
# strings, a nested struct) fails the import instead of silently sending every body to the
# validating path. A prompt command's two forms count as one key in the base: exactly one is
# given, which ``_prompt_form`` (or the batch's loop) checks after the count, so a body with
# neither or both is refused there whatever its count. ``_Weights`` generates each struct's
# counting function from its fields, as
# ``dataclasses`` does: a generic walk over the fields cost about 1,000 instructions per call
# (``bench/RESULTS.md``).
#
# A decoded string is never a field's default object, so ``"routing_group": "default"`` counts
# as given. A field given its default as null, 0 or false (cached objects) cannot be told from
# one not given by its value: when the quotes exceed the count, each such field at its default
# is looked up in the body as ``"name":`` (only a key can be written so: a string value holds
# no quote and is never followed by a colon), per operation for a batch. The python client
# sends ``"new_isl_tokens": 0``; a key written with a space before its colon takes the
# validating path, correct, only slower. ``path_of`` says which path a body would take.


_PROMPT_FORMS = ("sequence_hashes", "token_ids")  # a prompt's two forms, one given (``Prompt``)


class _Weights:
    """The quote pairs of a struct's fields, derived from its declaration: ``base`` for the
    fields always given (and a tag), ``optional`` for the others, each with the default object
    msgspec fills it with, and ``ambiguous``, those a body may give as their default object."""

    __slots__ = ("kind", "base", "optional", "ambiguous", "count")

    def __init__(self, kind: type[msgspec.Struct], tagged: bool = False) -> None:
        """``tagged``: the body gives the struct's tag (``"op": "add"`` in a batch)."""
        self.kind = kind
        self.base = 0
        if tagged:
            if kind.__struct_config__.tag_field is None:
                raise TypeError(f"{kind.__name__} has no tag")
            self.base = 2  # the tag's key and its value, a string
        self.optional: list[tuple[str, Any, int]] = []
        ambiguous: list[tuple[bytes, str, Any, int]] = []
        fields = msgspec.structs.fields(kind)
        forms = [f for f in fields if f.name in _PROMPT_FORMS and f.default is UNSET]
        if len(forms) == len(_PROMPT_FORMS):
            # a prompt command's body gives exactly one form (``_prompt_form`` checks it after
            # the count, and refuses a body with neither or both): one key, no string
            self.base += 1
        else:
            forms = []
        for f in fields:
            pairs = 1 + _string_value(msgspec.inspect.type_info(f.type), f.name)
            if f in forms:
                assert pairs == 1, f.name
                continue
            if f.required:
                self.base += pairs
                continue
            if f.default is msgspec.NODEFAULT:
                raise TypeError(f"{kind.__name__}.{f.name}: a default factory is not counted")
            self.optional.append((f.name, f.default, pairs))
            if not (f.default is UNSET or type(f.default) is str):  # a decoded value may be it
                # given as its default (null, 0, false: no string), the key's pair alone
                ambiguous.append((f'"{f.encode_name}":'.encode(), f.name, f.default, 1))
        self.ambiguous = tuple(ambiguous)
        self.count: Any = _generated("count", "o", [self])

    def lines(self, indent: str, names: dict[str, Any], counted: int = 0) -> str:
        """The statements adding this struct's pairs for ``o`` to ``n``, less the ``counted``
        pairs its caller counted for every operation already. A field whose default is None
        is compared with the literal None (one jump opcode: three opcodes, no allocation);
        another default is compared with its object (five)."""
        out = [f"{indent}n += {self.base - counted}\n"] if self.base > counted else []
        for name, default, pairs in self.optional:
            if default is None:
                out.append(f"{indent}if o.{name} is not None:\n")
            else:
                names[f"d_{self.kind.__name__}_{name}"] = default
                out.append(f"{indent}if o.{name} is not d_{self.kind.__name__}_{name}:\n")
            out.append(f"{indent}    n += {pairs}\n")
        return "".join(out)

    def given(self, o: Any, raw: bytes) -> int:
        """The pairs of the ambiguous fields at their default that ``raw`` (one object) gives."""
        return sum(
            pairs
            for key, name, default, pairs in self.ambiguous
            if getattr(o, name) is default and key in raw
        )


def _generated(
    fname: str,
    arg: str,
    weights: list[_Weights],
    checks: dict[type, str] | None = None,
) -> Any:
    """A counting function generated from ``weights``' fields, as ``dataclasses`` generates
    its methods: the same instructions as one written out per struct. With one struct it
    counts ``o``; with several it dispatches on ``type(o)`` in a loop over ``ops``, which
    counts the smallest base of them once for all operations, and runs after a struct's count
    its ``checks`` (statements on ``o``, which may return -1)."""
    names: dict[str, Any] = {"UNSET": UNSET, "U64_MAX": U64_MAX}
    if len(weights) == 1:
        code = "    n = 0\n" + weights[0].lines("    ", names)
    else:
        counted = min(w.base for w in weights)
        branches = []
        for i, w in enumerate(weights):
            names[w.kind.__name__] = w.kind
            check = (checks or {}).get(w.kind, "")
            branches.append(
                f"        {'if' if i == 0 else 'elif'} k is {w.kind.__name__}:\n"
                + (w.lines("            ", names, counted) or "            pass\n")
                + "".join(f"            {line}\n" for line in check.splitlines())
            )
        branches.append("        else:\n            return -1\n")
        code = (
            f"    n = {counted} * len({arg})\n    for o in {arg}:\n        k = type(o)\n"
            + "".join(branches)
        )
    source = f"def {fname}({arg}):\n{code}    return n\n"
    exec(source, names)  # noqa: S102 - generated from the structs' own field names
    return names[fname]


def _string_value(t: Any, name: str) -> int:
    """1 when the field's value, given, is one JSON string; 0 when it holds no string."""
    i = msgspec.inspect
    if isinstance(t, i.StrType):
        return 1
    if isinstance(t, (i.IntType, i.FloatType, i.BoolType, i.NoneType)):
        return 0
    if isinstance(t, i.ListType) and _string_value(t.item_type, name) == 0:
        return 0
    if isinstance(t, i.UnionType):
        kinds = {_string_value(u, name) for u in t.types if not isinstance(u, i.NoneType)}
        if len(kinds) == 1:
            return kinds.pop()
    raise TypeError(f"field {name}: its quotes cannot be counted ({t!r})")


_ADD, _FREE, _PREFILL, _POTENTIAL = (
    _Weights(k)
    for k in (commands.Add, commands.Free, commands.PrefillComplete, commands.PotentialLoads)
)
_BATCH = {
    k: _Weights(k, tagged=True)
    for k in (commands.Add, commands.Free, commands.PrefillComplete, commands.OutputBlock)
}
# An add's checks in a batch, in the counting loop (a second loop over the operations cost
# 20 of an operation's 617 opcodes): its numbers within their schema range, and exactly one prompt
# form given, the other made None (``_prompt_form`` written out). An operation refused here
# makes the count -1; one changed before another is refused goes with the whole body to the
# validating path, which decodes the body afresh.
_ADD_CHECKS = """\
if o.worker_id > U64_MAX or o.new_isl_tokens > U64_MAX:
    return -1
if o.sequence_hashes is UNSET:
    if o.token_ids is UNSET:
        return -1
    o.sequence_hashes = None
elif o.token_ids is not UNSET:
    return -1
else:
    o.token_ids = None
"""
# the pairs of a batch's operations (an add first: the most frequent with free), -1 for an
# operation its checks refuse
_batch_count = _generated("batch_count", "ops", list(_BATCH.values()), {commands.Add: _ADD_CHECKS})
_OBJECT = re.compile(rb'\{(?:[^{}"]|"[^"]*")*\}')  # one operation's object (no escapes)


_PromptCommand = TypeVar("_PromptCommand", commands.Add, commands.PotentialLoads)


def _counted(raw: bytes, o: Any, weights: _Weights) -> bool:
    """Whether the single call's body ``raw`` holds exactly the quotes of the fields ``o``
    was given (module notes)."""
    quotes = _quotes(raw)
    pairs: int = weights.count(o)
    if quotes == 2 * pairs:
        return True
    return quotes > 2 * pairs and quotes == 2 * (pairs + weights.given(o, raw))


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


def _keyed(raw: bytes, decode: Any, weights: _Weights) -> Any:
    """A ``/free`` or ``/prefill_complete`` body's command."""
    o = _decoded(raw, decode)
    if o is None or not _counted(raw, o, weights):
        return None
    return o


def _prompt_form(o: _PromptCommand) -> _PromptCommand | None:
    """A decoded prompt command with its form checked: exactly one given, the other made None
    (hashes stay as given: ``kv_slot_tracker.core.hashing``); None when both or neither is
    given (the validating path answers). The form not given becomes None, which its declared
    type (what a body may carry) leaves out: hence the untyped view."""
    cmd: Any = o
    hashes, tokens = cmd.sequence_hashes, cmd.token_ids
    if hashes is UNSET:
        if tokens is UNSET:
            return None
        cmd.sequence_hashes = None
    elif tokens is not UNSET:
        return None
    else:
        cmd.token_ids = None
    return o


def add_body(raw: bytes) -> commands.Add | None:
    """A plain ``/add`` body's command (prompt form checked); None for any other body."""
    o: commands.Add | None = _decoded(raw, _decode_add)
    if o is None or o.worker_id > U64_MAX or o.new_isl_tokens > U64_MAX:
        return None
    if not _counted(raw, o, _ADD):
        return None
    return _prompt_form(o)  # None unless exactly one prompt form was given


def potential_loads_body(raw: bytes) -> commands.PotentialLoads | None:
    """A plain ``/potential_loads`` body's command (prompt form checked); None for any other
    body."""
    o: commands.PotentialLoads | None = _decoded(raw, _decode_potential)
    if o is None or o.new_isl_tokens > U64_MAX:
        return None
    if not _counted(raw, o, _POTENTIAL):
        return None
    return _prompt_form(o)


def free_body(raw: bytes) -> commands.Free | None:
    """A plain ``/free`` body's command; None for any other body."""
    cmd: commands.Free | None = _keyed(raw, _decode_free, _FREE)
    return cmd


def prefill_complete_body(raw: bytes) -> commands.PrefillComplete | None:
    """A plain ``/prefill_complete`` body's command; None for any other body."""
    cmd: commands.PrefillComplete | None = _keyed(raw, _decode_prefill, _PREFILL)
    return cmd


def batch_operations(raw: bytes) -> list[commands.BatchOperation] | None:
    """A plain batch's commands, each checked as its model checks it; None for any other
    body (a key given twice in an operation included: counted as a single call's are). An
    add's prompt form it was not given becomes None."""
    if b"\\" in raw:
        return None
    try:
        ops = _decode_batch(raw).operations
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    # quote pairs: "operations", then each operation's, as given (module notes), with each
    # add checked as its model checks it (``_ADD_CHECKS``)
    pairs = _batch_count(ops)
    if pairs < 0:
        return None
    pairs += 1
    quotes = raw.count(b'"')
    if quotes != 2 * pairs:
        if quotes < 2 * pairs:
            return None
        # fields given their default (``"new_isl_tokens": 0``): looked up per operation
        objects = _OBJECT.findall(raw)
        if len(objects) != len(ops):
            return None
        weights = _BATCH
        pairs += sum(weights[type(o)].given(o, text) for o, text in zip(ops, objects, strict=True))
        if quotes != 2 * pairs:
            return None  # a key given twice in an operation, or written with a space
    return ops


# the routes with a plain path, each with its decoder (``kv_slot_tracker.http.operations``)
DECODERS: dict[str, Any] = {
    "/add": add_body,
    "/free": free_body,
    "/prefill_complete": prefill_complete_body,
    "/potential_loads": potential_loads_body,
    "/batch": batch_operations,
}


def path_of(route: str, raw: bytes) -> str:
    """Which path the body ``raw`` of ``route`` (a key of ``DECODERS``) takes: ``"plain"`` or
    ``"validating"``."""
    return "plain" if DECODERS[route](raw) is not None else "validating"
