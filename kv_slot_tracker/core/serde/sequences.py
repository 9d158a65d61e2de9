"""A struct read from a JSON array, as serde's derived ``visit_seq`` reads it: element ``i`` is
field ``i``, read one at a time, so the first element of the wrong type is the error even when
the text after it is not JSON. Each struct says its fields in the order of its Rust fields."""

from __future__ import annotations

import json
from json.decoder import scanstring  # type: ignore[attr-defined]  # not in typeshed's __all__
from typing import Any

from .errors import JsonShapeError, JsonSyntaxError
from .positions import Positions, at_offset
from .syntax import syntax_message
from .values import INTEGERS, UNSIGNED, mismatch


class SeqField:
    """One field of a struct as serde reads it from an array: its name (None: a field this
    service ignores, checked and dropped), its Rust type as serde words it (``u64``, ``a
    string``, ``a sequence`` of ``items``, ``a map`` of strings, or ``enum`` of ``variants``), a
    map's keys (``u32``: quoted numbers), whether ``null`` is taken (an ``Option``) and whether it
    may be left out (``#[serde(default)]``)."""

    __slots__ = ("name", "rust", "nullable", "default", "items", "keys", "variants")

    def __init__(self, name: str | None, rust: str, *, nullable: bool = True,
                 default: bool = False, items: str = "a string", keys: str = "a string",
                 variants: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.name, self.rust, self.nullable, self.default = name, rust, nullable, default
        self.items, self.keys, self.variants = items, keys, variants


class SeqStruct:
    """A struct without a flattened part, in the order of its Rust fields: serde's derived
    ``visit_seq`` takes a JSON array for it, one element per field."""

    def __init__(self, name: str, fields: tuple[SeqField, ...]) -> None:
        self.name, self.fields = name, fields

    @property
    def expecting(self) -> str:
        n = len(self.fields)
        return f"struct {self.name} with {n} element{'' if n == 1 else 's'}"


def struct_from_sequence(raw: bytes, struct: SeqStruct) -> dict[str, Any]:
    """A JSON array read as serde's derived ``visit_seq`` reads it into ``struct``: element
    ``i`` is field ``i``; the first element of the wrong type is a shape error (``[i]: invalid
    type: ...``), running out before a field without a default is ``invalid length i`` at the
    closing bracket, an element past the last field is serde_json's syntax error (``trailing
    characters``). Elements are read one at a time, as serde does, so an error in one comes
    before a syntax error after it. Returns the named fields given (for the model)."""
    text = raw.decode("utf-8", "replace")
    at = at_offset
    n = len(text)

    def ws(i: int) -> int:
        while i < n and text[i] in " \t\n\r":
            i += 1
        return i

    def syntax(prefix: str = "") -> JsonSyntaxError:
        return JsonSyntaxError(prefix + syntax_message(raw, True))

    def no_constants(name: str) -> Any:
        raise ValueError(name)  # NaN and Infinity are not JSON

    decoder = json.JSONDecoder(parse_constant=no_constants)
    out: dict[str, Any] = {}
    i = ws(0) + 1  # past "["
    for k, f in enumerate(struct.fields):
        i = ws(i)
        if i >= n:
            raise syntax()
        if text[i] == "]" or (k and text[i] != ","):
            if text[i] != "]":
                raise JsonSyntaxError("expected `,` or `]`" + at(text, i + 1))
            if f.default and all(g.default for g in struct.fields[k:]):
                break
            first = next(j for j, g in enumerate(struct.fields) if j >= k and not g.default)
            raise JsonShapeError(
                f"invalid length {first}, expected {struct.expecting}" + at(text, i + 1)
            )
        if k:
            i = ws(i + 1)
            if i >= n:
                raise syntax()
            if text[i] == "]":
                raise JsonSyntaxError("trailing comma" + at(text, i + 1))
        start = i
        head = text[i]
        takes_seq, takes_map = f.rust == "a sequence", f.rust == "a map"
        if f.rust == "enum" and head not in '"n':  # serde_json wants a variant name here
            peek = ws(i + 1) if head == "{" else i
            raise JsonSyntaxError(f"[{k}]: expected value" + at(text, peek + 1))
        if f.rust == "a map" and head == "{" and f.keys != "a string":
            bad_key = _first_bad_number_key(text, start)
            if bad_key is not None:
                raise JsonSyntaxError(f"[{k}].?: invalid value: expected key to be a number "
                                      "in quotes" + at(text, bad_key))  # fmt: skip
        if (head == "[" and not takes_seq) or (head == "{" and not takes_map):
            what = "sequence" if head == "[" else "map"
            raise JsonShapeError(
                f"[{k}]: invalid type: {what}, expected {f.rust}" + at(text, start)
            )
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError as e:
            if getattr(e, "pos", start) == start:  # no JSON value starts here (NaN included)
                raise JsonSyntaxError(f"[{k}]: expected value" + at(text, start + 1)) from None
            raise syntax(f"[{k}]: ") from None
        message = _element_error(value, f, text, start, i, k)
        if message is not None:
            raise JsonShapeError(message)
        if f.name is not None and value is not None:
            out[f.name] = value
    else:
        i = ws(i)
        if i < n and text[i] == ",":
            j = ws(i + 1)
            if j < n and text[j] == "]":
                raise JsonSyntaxError("trailing comma" + at(text, j + 1))
            raise JsonSyntaxError("trailing characters" + at(text, j + 1))
        if i >= n:
            raise syntax()
        if text[i] != "]":
            raise JsonSyntaxError("trailing characters" + at(text, i + 1))
    return out


def _first_bad_number_key(text: str, start: int) -> int | None:
    """Where serde_json stops on the first key of the object at ``start`` that is not a
    number (it reads a map with integer keys from quoted numbers), or None."""
    decoder = json.JSONDecoder()
    i = start + 1
    try:
        while True:
            while text[i] in " \t\n\r,":
                i += 1
            if text[i] != '"':
                return None
            quote = i
            key, i = scanstring(text, i + 1)
            if not key.isdigit():
                return quote + 1  # serde_json stops at the key's opening quote
            while text[i] in " \t\n\r:":
                i += 1
            _, i = decoder.raw_decode(text, i)
    except (ValueError, IndexError):
        return None


def _element_error(value: Any, f: SeqField, text: str, start: int, end: int, k: int) -> str | None:
    """serde's text for element ``k`` (``text[start:end]``) of the wrong type for field ``f``,
    position included; None when it fits."""
    at = at_offset
    if value is None:
        return (
            None if f.nullable else f"[{k}]: invalid type: null, expected {f.rust}" + at(text, end)
        )
    rust = f.rust
    if rust == "enum":
        if value in f.variants:
            return None
        options = " or ".join(f"`{v}`" for v in f.variants)
        return f"[{k}]: unknown variant `{value}`, expected {options}" + at(text, end)
    if rust in INTEGERS:
        ok = type(value) is int and 0 <= value <= UNSIGNED.get(rust, 2**63 - 1)
    elif rust in ("f64", "f32"):
        ok = type(value) in (int, float)
    elif rust == "a string":
        ok = type(value) is str
    elif rust == "a boolean":
        ok = type(value) is bool
    elif rust == "a sequence":
        if type(value) is not list:
            return f"[{k}]: " + mismatch(value, rust) + at(text, end)
        for j, item in enumerate(value):
            if type(item) is not str:  # every sequence read from an array holds strings
                pos = Positions(text[start:])
                item_end = pos.ends.get((j,), pos.end) + start
                return f"[{k}][{j}]: " + mismatch(item, f.items) + at(text, item_end)
        return None
    else:  # a map of strings
        if type(value) is not dict:
            return f"[{k}]: " + mismatch(value, rust) + at(text, end)
        for key, item in value.items():
            if type(item) is not str:
                pos = Positions(text[start:])
                item_end = pos.ends.get((key,), pos.end) + start
                return f"[{k}].{key}: " + mismatch(item, "a string") + at(text, item_end)
        return None
    return None if ok else f"[{k}]: " + mismatch(value, rust) + at(text, end)
