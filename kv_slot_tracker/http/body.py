"""Reading and validating JSON request bodies with the reference service's status codes.

415 for a non-JSON content type, 413 above the body limit, 400 for malformed JSON, 422 for a
well-formed body of the wrong shape. Every error is ``{"error": "..."}`` with the reference's fixed
message prefixes.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope

from kv_slot_tracker.core.serde import unexpected
from kv_slot_tracker.http.errors import CONTENT_TYPE, JSON_PARSE, JSON_SHAPE, TOO_LARGE, HttpError

M = TypeVar("M", bound=BaseModel)


def is_json_content_type(value: str | None) -> bool:
    if not value:
        return False
    mime = value.split(";", 1)[0].strip().lower()
    if mime == "application/json":
        return True
    return mime.startswith("application/") and mime.endswith("+json")


def check_body_headers(headers: list[tuple[bytes, bytes]], limit: int) -> None:
    """The checks made before a body is read: a JSON content type (415) and a declared length
    within ``limit`` (413)."""
    content_type = declared = None
    for key, value in headers:
        if key == b"content-type" and content_type is None:
            content_type = value
        elif key == b"content-length" and declared is None:
            declared = value
    if content_type != b"application/json" and (
        content_type is None or not is_json_content_type(content_type.decode("latin-1"))
    ):
        raise HttpError(415, CONTENT_TYPE)
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(413, TOO_LARGE)


async def read_asgi_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request body, after the content-type (415) and size (413) checks.

    Works on the raw ASGI scope and receive channel, so the FastAPI routes and the lean path
    (``kv_slot_tracker.http.lean``) read bodies the same way.
    """
    check_body_headers(scope["headers"], limit)
    message = await receive()
    body = message.get("body", b"")
    while message.get("more_body"):
        message = await receive()
        body += message.get("body", b"")
        if len(body) > limit:
            raise HttpError(413, TOO_LARGE)
    if len(body) > limit:
        raise HttpError(413, TOO_LARGE)
    return body


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


# The Rust type each field has in the reference, for serde-like messages.
_RUST_TYPES = {
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


_STRUCT_NAMES = {
    "RegisterBody": "RegisterRequest",
    "UnregisterBody": "UnregisterRequest",
    "AddBody": "AddRequest",
    "PotentialLoadsBody": "PotentialLoadsRequest",
    "RequestBody": "LifecycleRequest",
}


def _describe(err: Mapping[str, Any]) -> str:
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
    rust = _RUST_TYPES.get(field)
    if rust is not None:
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{loc}: invalid value: integer `{value}`, expected {rust}"
        return f"{loc}: invalid type: {unexpected(value)}, expected {rust}"
    if typ == "string_too_long":  # the service's own limit (kv_slot_tracker.core.limits)
        return f"{loc}: {err['msg']}"
    if typ.startswith("string") or typ == "literal_error":
        return f"{loc}: invalid type: {unexpected(value)}, expected a string"
    return f"{loc}: {err['msg']}" if loc else err["msg"]


def shape_error(exc: ValidationError) -> HttpError:
    errors = exc.errors(include_url=False, include_context=False)
    return HttpError(422, JSON_SHAPE + _describe(errors[0]))


# Every quoted string followed by a colon: the keys of all objects in the body (one C scan).
KEYS = re.compile(rb'"([^"\\]*)"\s*:')


def _duplicate_key(raw: bytes, model: type[BaseModel]) -> str | None:
    """A field name given twice at the top level of the object (serde rejects that).

    One regex scan gates the (rare) full check: when no key string repeats anywhere in the body,
    no field can be duplicated, so ordinary bodies pay a few microseconds whatever their size.
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
    if isinstance(top, dict) and found and found[0] in model.model_fields:
        return found[0]
    return None


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
    the objects with one. Trailing bytes after the body's JSON value are ignored, as
    ``parse_json`` ignores them."""
    try:
        text = raw.decode("utf-8").lstrip()
        top, _ = json.JSONDecoder(object_pairs_hook=_fields).raw_decode(text)
    except ValueError:
        return {}
    listed = top.get(items) if isinstance(top, dict) else None
    if not isinstance(listed, list):
        return {}
    return {i: o.repeated for i, o in enumerate(listed) if type(o) is _Fields and o.repeated}


def parse_json(
    raw: bytes, model: type[M], dialect: SerdeDialect | None = None, struct: str | None = None
) -> M:
    """Validate JSON bytes; 400 for syntax errors, 422 for shape errors (with ``dialect``:
    worded as serde words them, position included, ``serde_shape_error``; ``struct``: the
    Rust struct's name where one model serves routes whose structs differ)."""
    try:
        value = model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False)
        first = errors[0] if errors else {"type": ""}
        if dialect is not None and raw.lstrip()[:1] == b"[" and model.__name__ in dialect.sequences:
            # serde reads a struct from an array too, field by field: the body may even be good
            return model.model_validate(
                _struct_from_sequence(raw, dialect.sequences[model.__name__])
            )
        if first["type"] == "json_invalid":
            end = _first_value_end(raw, first.get("msg", ""))
            if end is not None:
                # like the reference, ignore what follows a complete JSON value
                return parse_json(raw[:end], model, dialect, struct)
            if dialect is not None:
                early = _sequence_for_map(raw, model, dialect, struct)
                if early is not None:
                    raise early from None
            raise HttpError(400, JSON_PARSE + _syntax_message(raw, dialect is not None)) from None
        if dialect is not None:
            serde = serde_shape_error(raw, exc, model, dialect, struct)
            if serde is not None:
                raise serde from None
        if first["type"] == "model_type":
            raise HttpError(
                422,
                JSON_SHAPE + f"invalid type: {unexpected(first.get('input'))}, "
                f"expected struct {_STRUCT_NAMES.get(model.__name__, model.__name__)}",
            ) from None
        raise shape_error(exc) from None
    if (b"NaN" in raw or b"Infinity" in raw) and _not_strict_json(raw):
        # pydantic's parser takes NaN/Infinity literals (even in ignored fields); JSON has none
        raise HttpError(400, JSON_PARSE + _syntax_message(raw))
    dup = _duplicate_key(raw, model)
    if dup is not None:
        serde = serde_shape_error(raw, None, model, dialect) if dialect is not None else None
        raise serde or HttpError(422, JSON_SHAPE + f"duplicate field `{dup}`")
    return value


def _not_strict_json(raw: bytes) -> bool:
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        return True
    return False


def _first_value_end(raw: bytes, msg: str) -> int | None:
    """Offset just past the first complete JSON value when only trailing bytes are wrong."""
    if "trailing characters" not in msg:
        return None
    try:
        _, end = json.JSONDecoder().raw_decode(raw.decode("utf-8", "strict").lstrip())
    except ValueError:
        return None
    text = raw.decode("utf-8")
    skipped = len(text) - len(text.lstrip())
    return len(text[: skipped + end].encode())


def parse_object(obj: Any, model: type[M]) -> M:
    """Validate an already-decoded JSON value (used for batch operations)."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise shape_error(exc) from None


def _syntax_message(raw: bytes, paths: bool = False) -> str:
    """A serde_json-like description of why ``raw`` is not JSON (``paths``: a body that ends
    early is described as serde_json and serde_path_to_error describe it, ``_eof_message``)."""
    if not raw.strip():
        return f"EOF while parsing a value at line 1 column {len(raw)}"
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        line = e.doc.count("\n", 0, e.pos) + 1 if isinstance(e.doc, str) else 1
        col = e.colno if e.colno else e.pos
        msg = e.msg
        if paths and ("unexpected end of data" in msg or "EOF" in msg):
            eof = _eof_message(raw)
            if eof is not None:
                return eof
        if "unexpected end of data" in msg or "EOF" in msg:
            stripped = raw.rstrip()
            what = "an object" if stripped.lstrip().startswith(b"{") else "a value"
            if stripped.lstrip().startswith(b"["):
                what = "a list"
            return f"EOF while parsing {what} at line {line} column {len(stripped)}"
        return f"{msg} at line {line} column {col}"
    except Exception as e:  # pragma: no cover - orjson raises JSONDecodeError only
        return str(e)
    return "invalid JSON"


def _eof_message(raw: bytes) -> str | None:
    """What serde_json was parsing when ``raw`` ended, with serde_path_to_error's path in front,
    as the selection routes answer a body cut short: ``sequence_hashes: EOF while parsing a
    list at line 1 column 40``. None when the text is not a cut-short JSON text.

    One pass with a stack of open containers. In an object, a key being read (or the ``,``
    before it) is at ``path.?``, the ``:`` after it at the object's own path, its value at
    ``path.key``; in a list, the list's path, and an element being read at ``path[i]``. At the
    top level the path is empty. The column counts every byte of the last line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    # frames: [is_object, path, state, key or index]; states: "open" (after { or [), "next"
    # (after ,), "key" (in a key), "colon" (key read), "value" (after :), "in" (in a scalar),
    # "after" (a value read)
    stack: list[list[Any]] = []
    top_state = "value"
    i, n = 0, len(text)
    scalar = ""  # "string" or "literal" while inside one
    literal_at = 0  # where the literal being read began
    while i < n:
        ch = text[i]
        if scalar == "string":
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                scalar = ""
                if stack and stack[-1][2] == "key":
                    stack[-1][2] = "colon"
                elif stack:
                    stack[-1][2] = "after"
                else:
                    top_state = "after"
            i += 1
            continue
        if scalar == "literal":
            if ch in " \t\r\n,]}:":
                scalar = ""
                if stack:
                    stack[-1][2] = "after"
                else:
                    top_state = "after"
                continue  # the delimiter is read below
            i += 1
            continue
        if ch in " \t\r\n":
            i += 1
            continue
        frame = stack[-1] if stack else None
        state = frame[2] if frame else top_state
        if ch == "," and frame and state == "after":
            frame[2] = "next"
            if not frame[0]:
                frame[3] += 1
        elif ch == ":" and frame and frame[0] and state == "colon":
            frame[2] = "value"
        elif ch in "}]" and frame and state in ("after", "open"):
            stack.pop()
            if stack:
                stack[-1][2] = "after"
            else:
                top_state = "after"
        elif ch == '"' and frame and frame[0] and state in ("open", "next"):
            end = text.find('"', i + 1)
            while end != -1 and text[end - 1] == "\\":
                end = text.find('"', end + 1)
            frame[3] = None if end == -1 else text[i + 1 : end]
            frame[2] = "key"
            scalar = "string"
        elif state in ("value", "open", "next") and not (frame and frame[0] and state != "value"):
            path = _child_path(frame)
            if frame:
                frame[2] = "in"
            else:
                top_state = "in"
            if ch in "{[":
                stack.append([ch == "{", path, "open", None if ch == "{" else 0])
            elif ch == '"':
                scalar = "string"
            else:
                scalar, literal_at = "literal", i
        else:
            return None  # not merely cut short
        i += 1
    frame = stack[-1] if stack else None
    state = frame[2] if frame else top_state
    if frame is None:
        what = {"in": "a string" if scalar == "string" else "a value"}.get(state)
        path = ""
        if what is None:
            return None
    elif frame[0]:
        own = frame[1]
        anywhere = f"{own}.?" if own else ""
        what, path = {
            "open": ("an object", anywhere),
            "next": ("a value", anywhere),
            "key": ("a string", anywhere),
            "colon": ("an object", own),
            "value": ("a value", _child_path(frame)),
            "after": ("an object", anywhere),
        }.get(state, ("", ""))
        if state == "in":
            what = "a string" if scalar == "string" else "a value"
            path = _child_path(frame)
        elif state == "after" and scalar == "literal":
            what = "an object"
    else:
        what, path = {
            "open": ("a list", frame[1]),
            "after": ("a list", frame[1]),
            "next": ("a value", frame[1]),
        }.get(state, ("", ""))
        if state == "in":
            what = "a string" if scalar == "string" else "a value"
            path = _child_path(frame)
    if scalar == "literal" and _whole_literal(text[literal_at:]):
        # a number cut by the end is whole: serde then wants what follows it
        if frame is None:
            return None
        what, path = (
            ("an object", f"{frame[1]}.?" if frame[1] else "") if frame[0] else ("a list", frame[1])
        )
    if not what:
        return None
    line = text.count("\n") + 1
    column = len(text[text.rfind("\n") + 1 :].encode())
    return f"{path + ': ' if path else ''}EOF while parsing {what} at line {line} column {column}"


def _child_path(frame: list[Any] | None) -> str:
    """The path of the value being read in ``frame`` (a key's value, or a list's element)."""
    if frame is None:
        return ""
    if frame[0]:
        key = "?" if frame[3] is None else frame[3]
        return f"{frame[1]}.{key}" if frame[1] else key
    return f"{frame[1]}[{frame[3]}]"


def _whole_literal(tail: str) -> bool:
    """Whether ``tail`` is a whole JSON literal (``true``, ``12``, ``-3.5e2``; not ``tr``,
    ``-`` or ``1.``): cut by the end, it still counts as read."""
    if tail in ("true", "false", "null"):
        return True
    try:
        float(tail)
    except ValueError:
        return False
    return tail[-1].isdigit() and not tail.startswith("+")


# -- serde's texts with positions (the selection routes) ---------------------------------------
# The reference's selection service answers a body of the wrong shape with serde_json's own
# text and where it stopped: ``invalid type: string "4", expected usize at line 1 column 61``.
# serde reads the body once, in order: a value of the wrong type ends the read at the end of that
# value (its path in front, ``allowed_worker_ids[1]: ...``), a key given twice at the end of that
# key; the fields of a flattened struct (the prompt) are only checked once the whole object is
# read, so their errors and a missing field point at its end and carry no path.


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


def _struct_from_sequence(raw: bytes, struct: SeqStruct) -> dict[str, Any]:
    """A JSON array read as serde's derived ``visit_seq`` reads it into ``struct``: element
    ``i`` is field ``i``; the first element of the wrong type is a 422 (``[i]: invalid type:
    ...``), running out before a field without a default is ``invalid length i`` at the
    closing bracket, an element past the last field is serde_json's 400 (``trailing
    characters``). Elements are read one at a time, as serde does, so an error in one comes
    before a syntax error after it. Returns the named fields given (for the model)."""
    text = raw.decode("utf-8", "replace")
    at = _Positions.at_offset
    n = len(text)

    def ws(i: int) -> int:
        while i < n and text[i] in " \t\n\r":
            i += 1
        return i

    def syntax(prefix: str = "") -> HttpError:
        msg = _syntax_message(raw, True)
        return HttpError(400, JSON_PARSE + prefix + msg)

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
                raise HttpError(400, JSON_PARSE + "expected `,` or `]`" + at(text, i + 1))
            if f.default and all(g.default for g in struct.fields[k:]):
                break
            first = next(j for j, g in enumerate(struct.fields) if j >= k and not g.default)
            raise HttpError(422, JSON_SHAPE + f"invalid length {first}, expected "
                            f"{struct.expecting}" + at(text, i + 1))  # fmt: skip
        if k:
            i = ws(i + 1)
            if i >= n:
                raise syntax()
            if text[i] == "]":
                raise HttpError(400, JSON_PARSE + "trailing comma" + at(text, i + 1))
        start = i
        head = text[i]
        takes_seq, takes_map = f.rust == "a sequence", f.rust == "a map"
        if f.rust == "enum" and head not in '"n':  # serde_json wants a variant name here
            peek = ws(i + 1) if head == "{" else i
            raise HttpError(400, JSON_PARSE + f"[{k}]: expected value" + at(text, peek + 1))
        if f.rust == "a map" and head == "{" and f.keys != "a string":
            bad_key = _first_bad_number_key(text, start)
            if bad_key is not None:
                raise HttpError(400, JSON_PARSE + f"[{k}].?: invalid value: expected key to be "
                                "a number in quotes" + at(text, bad_key))  # fmt: skip
        if (head == "[" and not takes_seq) or (head == "{" and not takes_map):
            what = "sequence" if head == "[" else "map"
            raise HttpError(422, JSON_SHAPE + f"[{k}]: invalid type: {what}, expected "
                            f"{f.rust}" + at(text, start))  # fmt: skip
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError as e:
            if getattr(e, "pos", start) == start:  # no JSON value starts here (NaN included)
                raise HttpError(
                    400, JSON_PARSE + f"[{k}]: expected value" + at(text, start + 1)
                ) from None
            raise syntax(f"[{k}]: ") from None
        message = _seq_element_error(value, f, text, start, i, k)
        if message is not None:
            raise HttpError(422, JSON_SHAPE + message)
        if f.name is not None and value is not None:
            out[f.name] = value
    else:
        i = ws(i)
        if i < n and text[i] == ",":
            j = ws(i + 1)
            if j < n and text[j] == "]":
                raise HttpError(400, JSON_PARSE + "trailing comma" + at(text, j + 1))
            raise HttpError(400, JSON_PARSE + "trailing characters" + at(text, j + 1))
        if i >= n:
            raise syntax()
        if text[i] != "]":
            raise HttpError(400, JSON_PARSE + "trailing characters" + at(text, i + 1))
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
            key, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
            if not key.isdigit():
                return quote + 1  # serde_json stops at the key's opening quote
            while text[i] in " \t\n\r:":
                i += 1
            _, i = decoder.raw_decode(text, i)
    except (ValueError, IndexError):
        return None


def _seq_element_error(
    value: Any, f: SeqField, text: str, start: int, end: int, k: int
) -> str | None:
    """serde's text for element ``k`` (``text[start:end]``) of the wrong type for field ``f``,
    position included; None when it fits."""
    at = _Positions.at_offset
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
    if rust in _INTEGERS:
        ok = type(value) is int and 0 <= value <= _UNSIGNED.get(rust, 2**63 - 1)
    elif rust in ("f64", "f32"):
        ok = type(value) in (int, float)
    elif rust == "a string":
        ok = type(value) is str
    elif rust == "a boolean":
        ok = type(value) is bool
    elif rust == "a sequence":
        if type(value) is not list:
            return f"[{k}]: " + _serde_value(value, rust) + at(text, end)
        for j, item in enumerate(value):
            if type(item) is not str:  # every sequence read from an array holds strings
                pos = _Positions(text[start:])
                item_end = pos.ends.get((j,), pos.end) + start
                return f"[{k}][{j}]: " + _serde_value(item, f.items) + at(text, item_end)
        return None
    else:  # a map of strings
        if type(value) is not dict:
            return f"[{k}]: " + _serde_value(value, rust) + at(text, end)
        for key, item in value.items():
            if type(item) is not str:
                pos = _Positions(text[start:])
                item_end = pos.ends.get((key,), pos.end) + start
                return f"[{k}].{key}: " + _serde_value(item, "a string") + at(text, item_end)
        return None
    return None if ok else f"[{k}]: " + _serde_value(value, rust) + at(text, end)


_UNSIGNED = {"u32": 2**32 - 1, "u64": 2**64 - 1, "usize": 2**64 - 1}
_INTEGERS = {**_UNSIGNED, "i64": 2**63 - 1}


def _serde_value(value: Any, rust: str) -> str:
    """serde's ``invalid type`` / ``invalid value`` for ``value`` where ``rust`` was expected."""
    if rust in _INTEGERS and type(value) is int:
        if value >= 2**64 or value < -(2**63):  # serde_json reads it as a float
            return f"invalid type: floating point `{float(value)!r}`, expected {rust}"
        return f"invalid value: integer `{value}`, expected {rust}"
    return f"invalid type: {unexpected(value)}, expected {rust}"


class _Positions:
    """Where each value and each repeated key of a JSON object ends (offsets past them), and
    where the object itself ends: a small scanner over the text, run only for an error."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.decoder = json.JSONDecoder()
        self.ends: dict[tuple[Any, ...], int] = {}  # each path's last occurrence (the one kept)
        self.repeated: tuple[str, int] | None = None  # first top-level key given twice
        self.end = len(text)
        with contextlib.suppress(ValueError, IndexError):
            self.end = self._value(self._ws(0), ())

    def _ws(self, i: int) -> int:
        text = self.text
        while i < len(text) and text[i] in " \t\n\r":
            i += 1
        return i

    def _value(self, i: int, path: tuple[Any, ...]) -> int:
        text = self.text
        if text[i] == "{":
            i = self._ws(i + 1)
            seen: set[str] = set()
            if text[i] == "}":
                end = i + 1
            else:
                while True:
                    key, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
                    if key in seen and not path and self.repeated is None:
                        self.repeated = (key, i)
                    seen.add(key)
                    i = self._ws(self._ws(i) + 1)  # past the colon
                    i = self._ws(self._value(i, (*path, key)))
                    if text[i] == "}":
                        end = i + 1
                        break
                    i = self._ws(i + 1)  # past the comma
        elif text[i] == "[":
            i = self._ws(i + 1)
            n = 0
            if text[i] == "]":
                end = i + 1
            else:
                while True:
                    i = self._ws(self._value(i, (*path, n)))
                    n += 1
                    if text[i] == "]":
                        end = i + 1
                        break
                    i = self._ws(i + 1)
        else:
            _, end = self.decoder.raw_decode(text, i)
        self.ends[path] = end
        return end

    def at(self, offset: int) -> str:
        """`` at line L column C``: serde's position of ``offset`` (columns count bytes)."""
        return self.at_offset(self.text, offset)

    @staticmethod
    def at_offset(text: str, offset: int) -> str:
        """`` at line L column C`` once serde_json has read ``text[:offset]``."""
        text = text[:offset]
        line = text.count("\n") + 1
        column = len(text[text.rfind("\n") + 1 :].encode())
        return f" at line {line} column {column}"


def _json_path(loc: tuple[Any, ...], value: Any) -> tuple[tuple[Any, ...], Any]:
    """The part of a pydantic ``loc`` that names JSON values (union tags such as ``float``
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
    return prefix + _serde_value(value, rust)


def _sequence_for_map(
    raw: bytes, model: type[BaseModel], d: SerdeDialect, struct: str | None = None
) -> HttpError | None:
    """A struct with a flattened part is read as a map: serde refuses a list at its first
    byte, before reading any of it (``... expected struct SelectRequest at line 1 column 0``;
    the column counts the whitespace before it)."""
    struct = struct or d.structs.get(model.__name__)
    stripped = raw.lstrip()
    if struct is None or not stripped.startswith(b"["):
        return None
    if not any(name in model.model_fields for name in d.flattened):
        return None
    text = raw.decode("utf-8", "replace")
    at = _Positions.at_offset(text, len(text) - len(text.lstrip()))
    return HttpError(422, JSON_SHAPE + f"invalid type: sequence, expected struct {struct}{at}")


def serde_shape_error(raw: bytes, exc: ValidationError | None, model: type[BaseModel],
                      d: SerdeDialect, struct: str | None = None) -> HttpError | None:  # fmt: skip
    """The reference's 422 for a body of the wrong shape, position included: the error serde
    meets first (``exc``'s errors, and a top-level key given twice); None when it cannot say
    (the caller keeps its own text)."""
    try:
        text = raw.decode("utf-8")
        body = json.loads(text)
    except ValueError:
        return None
    early = _sequence_for_map(raw, model, d, struct)
    if early is not None:
        return early
    if type(body) is not dict:
        struct = struct or d.structs.get(model.__name__)
        if struct is None:
            return None
        return HttpError(422, JSON_SHAPE + f"invalid type: {unexpected(body)}, expected struct "
                         f"{struct}" + _Positions(text).at(len(text.rstrip())))  # fmt: skip
    pos = _Positions(text)
    found: list[tuple[int, int, str]] = []  # (offset, order, text)
    if pos.repeated is not None:
        key, end = pos.repeated
        late = key in d.flattened  # found when the flattened struct is read, at the end
        found.append((pos.end if late else end, 1 if late else 0, f"duplicate field `{key}`"))
    for err in exc.errors(include_url=False, include_context=False) if exc else ():
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
    return HttpError(422, JSON_SHAPE + message + pos.at(offset))
