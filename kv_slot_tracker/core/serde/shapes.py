"""serde's texts for JSON of the wrong shape, from the validator's error details (``type``,
``loc``, ``msg``, ``input`` each).

The slot tracker's routes word the first error without a position (``describe``). The
reference's selection service answers with serde_json's own text and where it stopped:
``invalid type: string "4", expected usize at line 1 column 61`` (``shape_error``). serde reads
the body once, in order: a value of the wrong type ends the read at the end of that value (its
path in front, ``allowed_worker_ids[1]: ...``), a key given twice at the end of that key; the
fields of a flattened struct (the prompt) are only checked once the whole object is read, so
their errors and a missing field point at its end and carry no path."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from .errors import JsonShapeError
from .positions import Positions, at_offset
from .sequences import SeqStruct
from .values import mismatch, unexpected

# The Rust type of each field of the slot tracker's requests in the reference.
RUST_TYPES = {
    "worker_id": "u64",
    "dp_rank": "u32",
    "block_size": "u32",
    "dp_start": "u32",
    "dp_size": "u32",
    "new_isl_tokens": "usize",
    "sequence_hashes": "i64",
    "token_ids": "u32",
    "expected_output_tokens": "u32",
}


class SerdeDialect:
    """How one family of routes words a shape error: each field's Rust type (``u64``, ``a
    string``, ...), the element type of its lists, which fields are flattened, the Rust
    name of each model's struct, and the structs serde also reads from an array."""

    def __init__(
        self,
        types: dict[str, str],
        items: dict[str, str],
        flattened: frozenset[str],
        structs: dict[str, str],
        sequences: Mapping[str, SeqStruct] | None = None,
    ) -> None:
        self.types, self.items, self.flattened, self.structs = types, items, flattened, structs
        self.sequences = dict(sequences or {})


def _loc(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def describe(err: Mapping[str, Any]) -> str:
    """The slot tracker's text for one error of the validator, without a position."""
    loc = _loc(err["loc"])
    typ = err["type"]
    names = [p for p in err["loc"] if isinstance(p, str)]
    field = names[-1] if names else ""
    if typ == "missing":
        return f"missing field `{field}`"
    top = loc.split("[", 1)[0]
    value = err.get("input")
    if top in ("sequence_hashes", "token_ids") and "[" not in loc:
        kind = "signed 64-bit sequence hashes" if top == "sequence_hashes" else "u32 token ids"
        return f"{loc}: invalid type: {unexpected(value)}, expected an array of {kind}"
    rust = RUST_TYPES.get(field)
    if rust is not None:
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{loc}: invalid value: integer `{value}`, expected {rust}"
        return f"{loc}: invalid type: {unexpected(value)}, expected {rust}"
    if typ == "string_too_long":  # the service's own limit (kv_slot_tracker.core.limits)
        return f"{loc}: {err['msg']}"
    if typ.startswith("string") or typ == "literal_error":
        return f"{loc}: invalid type: {unexpected(value)}, expected a string"
    return f"{loc}: {err['msg']}" if loc else str(err["msg"])


# Every quoted string followed by a colon: the keys of all objects in the body (one C scan).
KEYS = re.compile(rb'"([^"\\]*)"\s*:')


def repeated_key(raw: bytes) -> str | None:
    """The first key found given twice in an object of the body, an object's keys checked
    once it is read (so an inner object's before the outer's); None when the body is not an
    object. The edge refuses it when it names a field of the struct, as serde does.

    One regex scan gates the (rare) full check: when no key string repeats anywhere in the body,
    no key can be repeated, so ordinary bodies pay a few microseconds whatever their size.
    """
    keys = KEYS.findall(raw)
    if len(keys) == len(set(keys)):
        return None
    found: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for k, _ in items:
            if k in seen and not found:
                found.append(k)
            seen.add(k)
        return dict(items)

    try:
        top = json.loads(raw, object_pairs_hook=pairs)
    except ValueError:
        return None
    return found[0] if isinstance(top, dict) and found else None


class _Fields(dict[str, Any]):
    """A decoded JSON object that remembers the first key it was given twice."""

    __slots__ = ("repeated",)
    repeated: str | None


def _fields(items: list[tuple[str, Any]]) -> _Fields:
    obj = _Fields(items)
    obj.repeated = None
    if len(obj) != len(items):
        seen: set[str] = set()
        for k, _ in items:
            if k in seen:
                obj.repeated = k
                break
            seen.add(k)
    return obj


def repeated_fields(raw: bytes, items: str) -> dict[int, str]:
    """Per index of the list ``items`` of the body's top-level object, the first key that
    object gives twice (serde rejects it, as it rejects a top-level key given twice): only
    the objects with one. Trailing bytes after the body's JSON value are ignored, as the
    reference ignores them."""
    try:
        text = raw.decode("utf-8").lstrip()
        top, _ = json.JSONDecoder(object_pairs_hook=_fields).raw_decode(text)
    except ValueError:
        return {}
    listed = top.get(items) if isinstance(top, dict) else None
    if not isinstance(listed, list):
        return {}
    return {i: o.repeated for i, o in enumerate(listed) if type(o) is _Fields and o.repeated}


def _json_path(loc: Sequence[Any], value: Any) -> tuple[tuple[Any, ...], Any]:
    """The part of a validator's ``loc`` that names JSON values (union tags such as ``float``
    dropped), and the value there."""
    path: list[Any] = []
    for part in loc:
        in_map = type(value) is dict and type(part) is str and part in value
        if not in_map and not (
            type(value) is list and type(part) is int and 0 <= part < len(value)
        ):
            break
        value = value[part]
        path.append(part)
    return tuple(path), value


def _serde_text(path: tuple[Any, ...], value: Any, typ: str, d: SerdeDialect) -> str | None:
    """serde's text for a value of the wrong shape at ``path`` (None: not a case it words)."""
    if not path:
        return None
    field = path[0]
    rust = d.items.get(field) if len(path) == 2 and type(path[1]) is int else None
    if len(path) == 1:
        rust = d.types.get(field)
    elif len(path) == 2 and type(path[1]) is str:  # a nested struct's field
        rust = d.types.get(path[1])
    if rust is None or typ == "string_too_long":
        return None
    prefix = "" if field in d.flattened else _loc(path) + ": "
    return prefix + mismatch(value, rust)


def sequence_for_map(
    raw: bytes, struct: str | None, fields: Collection[str], d: SerdeDialect
) -> JsonShapeError | None:
    """A struct with a flattened part (one of ``fields``) is read as a map: serde refuses a
    list at its first byte, before reading any of it (``... expected struct SelectRequest at
    line 1 column 0``; the column counts the whitespace before it)."""
    stripped = raw.lstrip()
    if struct is None or not stripped.startswith(b"["):
        return None
    if not any(name in fields for name in d.flattened):
        return None
    text = raw.decode("utf-8", "replace")
    at = at_offset(text, len(text) - len(text.lstrip()))
    return JsonShapeError(f"invalid type: sequence, expected struct {struct}{at}")


def shape_error(
    raw: bytes,
    errors: Sequence[Mapping[str, Any]],
    struct: str | None,
    fields: Collection[str],
    d: SerdeDialect,
) -> JsonShapeError | None:
    """serde's text for a body of the wrong shape for ``struct`` (its Rust name; ``fields``: its
    fields), position included: the error serde meets first (of ``errors``, and a top-level
    key given twice); None when it cannot say (the caller keeps its own text)."""
    try:
        text = raw.decode("utf-8")
        body = json.loads(text)
    except ValueError:
        return None
    early = sequence_for_map(raw, struct, fields, d)
    if early is not None:
        return early
    if type(body) is not dict:
        if struct is None:
            return None
        return JsonShapeError(f"invalid type: {unexpected(body)}, expected struct {struct}"
                              + Positions(text).at(len(text.rstrip())))  # fmt: skip
    pos = Positions(text)
    found: list[tuple[int, int, str]] = []  # (offset, order, text)
    if pos.repeated is not None:
        key, end = pos.repeated
        late = key in d.flattened  # found when the flattened struct is read, at the end
        found.append((pos.end if late else end, 1 if late else 0, f"duplicate field `{key}`"))
    for err in errors:
        if err["type"] == "missing":
            found.append((pos.end, 1, f"missing field `{err['loc'][-1]}`"))
            continue
        path, value = _json_path(err["loc"], body)
        message = _serde_text(path, value, err["type"], d)
        if message is None:
            return None
        late = path[0] in d.flattened
        found.append((pos.end if late else pos.ends.get(path, pos.end), 2 if late else 0, message))
    if not found:
        return None
    offset, _, message = min(found)
    return JsonShapeError(message + pos.at(offset))
