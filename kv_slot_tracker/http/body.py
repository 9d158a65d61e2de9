"""Reading and validating JSON request bodies with the reference service's status codes.

415 for a non-JSON content type, 413 above the body limit, 400 for malformed JSON, 422 for a
well-formed body of the wrong shape. Every error is ``{"error": "..."}`` with the reference's fixed
message prefixes.
"""

from __future__ import annotations

import json
import re
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


def _describe(err: dict[str, Any]) -> str:
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


class _Fields(dict):
    """A decoded JSON object that remembers the first key it was given twice."""

    __slots__ = ("repeated",)


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


def parse_json(raw: bytes, model: type[M]) -> M:
    """Validate JSON bytes; 400 for syntax errors, 422 for shape errors."""
    try:
        value = model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False)
        first = errors[0] if errors else {"type": ""}
        if first["type"] == "json_invalid":
            end = _first_value_end(raw, first.get("msg", ""))
            if end is not None:
                # like the reference, ignore what follows a complete JSON value
                return parse_json(raw[:end], model)
            raise HttpError(400, JSON_PARSE + _syntax_message(raw)) from None
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
        raise HttpError(422, JSON_SHAPE + f"duplicate field `{dup}`")
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


def _syntax_message(raw: bytes) -> str:
    """A serde_json-like description of why ``raw`` is not JSON."""
    if not raw.strip():
        return f"EOF while parsing a value at line 1 column {len(raw)}"
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        line = e.doc.count("\n", 0, e.pos) + 1 if isinstance(e.doc, str) else 1
        col = e.colno if e.colno else e.pos
        msg = e.msg
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
