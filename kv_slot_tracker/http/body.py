"""Reading and validating JSON request bodies with the reference service's status codes.

415 for a non-JSON content type, 413 above the body limit, 400 for malformed JSON, 422 for a
well-formed body of the wrong shape. Every error is ``{"error": "..."}`` with the reference's fixed
message prefixes before serde's own text (``kv_slot_tracker.core.serde`` words it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope

from kv_slot_tracker.core.serde.errors import JsonShapeError, JsonSyntaxError, SerdeError
from kv_slot_tracker.core.serde.sequences import struct_from_sequence
from kv_slot_tracker.core.serde.shapes import (
    SerdeDialect,
    describe,
    repeated_key,
    sequence_for_map,
    shape_error,
)
from kv_slot_tracker.core.serde.syntax import first_value_end, not_strict_json, syntax_message
from kv_slot_tracker.core.serde.values import unexpected
from kv_slot_tracker.http.errors import CONTENT_TYPE, JSON_PARSE, JSON_SHAPE, TOO_LARGE, HttpError

M = TypeVar("M", bound=BaseModel)


def is_json_content_type(value: str | None) -> bool:
    if not value:
        return False
    mime = value.split(";", 1)[0].strip().lower()
    if mime == "application/json":
        return True
    return mime.startswith("application/") and mime.endswith("+json")


def check_declared_body(content_type: bytes | None, declared: bytes | None, limit: int) -> None:
    """The checks made before a body is read, on the request's first ``content-type`` and
    ``content-length`` values: a JSON content type (415) and a declared length within ``limit``
    (413)."""
    if content_type != b"application/json" and (
        content_type is None or not is_json_content_type(content_type.decode("latin-1"))
    ):
        raise HttpError(415, CONTENT_TYPE)
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(413, TOO_LARGE)


def check_body_headers(headers: list[tuple[bytes, bytes]], limit: int) -> None:
    """The checks made before a body is read: a JSON content type (415) and a declared length
    within ``limit`` (413)."""
    content_type = declared = None
    for key, value in headers:
        if key == b"content-type" and content_type is None:
            content_type = value
        elif key == b"content-length" and declared is None:
            declared = value
    check_declared_body(content_type, declared, limit)


def declares_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request carries a body (a non-zero ``content-length`` or a chunked one): a
    route whose body is optional reads (and checks) it only then."""
    for key, value in headers:
        if key == b"content-length":
            return value.strip() not in (b"", b"0")
        if key == b"transfer-encoding":
            return True
    return False


async def read_asgi_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The request body, after the content-type (415) and size (413) checks.

    Works on the raw ASGI scope and receive channel, so the FastAPI routes and the lean path
    (``kv_slot_tracker.http.dispatch``) read bodies the same way.
    """
    check_body_headers(scope["headers"], limit)
    message = await receive()
    body: bytes = message.get("body", b"")
    while message.get("more_body"):
        message = await receive()
        body += message.get("body", b"")
        if len(body) > limit:
            raise HttpError(413, TOO_LARGE)
    if len(body) > limit:
        raise HttpError(413, TOO_LARGE)
    return body


# The Rust name of the struct each model of the slot tracker's routes is read into.
_STRUCT_NAMES = {
    "RegisterBody": "RegisterRequest",
    "UnregisterBody": "UnregisterRequest",
    "AddBody": "AddRequest",
    "PotentialLoadsBody": "PotentialLoadsRequest",
    "RequestBody": "LifecycleRequest",
}

# serde's refusals as the reference answers them: status and prefix.
_REFUSALS: dict[type[SerdeError], tuple[int, str]] = {
    JsonSyntaxError: (400, JSON_PARSE),
    JsonShapeError: (422, JSON_SHAPE),
}


def _http_error(e: SerdeError) -> HttpError:
    status, prefix = _REFUSALS[type(e)]
    return HttpError(status, prefix + e.message)


def _shape_error(errors: Sequence[Mapping[str, Any]]) -> HttpError:
    return HttpError(422, JSON_SHAPE + describe(errors[0]))


def parse_json(
    raw: bytes, model: type[M], dialect: SerdeDialect | None = None, struct: str | None = None
) -> M:
    """Validate JSON bytes; 400 for syntax errors, 422 for shape errors (with ``dialect``:
    worded as serde words them, position included, ``core.serde.shapes.shape_error``;
    ``struct``: the Rust struct's name where one model serves routes whose structs differ)."""
    try:
        value = model.model_validate_json(raw)
    except ValidationError as exc:
        try:
            return _refused(raw, model, exc, dialect, struct)
        except SerdeError as e:
            raise _http_error(e) from None
    if (b"NaN" in raw or b"Infinity" in raw) and not_strict_json(raw):
        # pydantic's parser takes NaN/Infinity literals (even in ignored fields); JSON has none
        raise HttpError(400, JSON_PARSE + syntax_message(raw))
    dup = repeated_key(raw)
    if dup is not None and dup in model.model_fields:  # serde rejects a field given twice
        serde = None
        if dialect is not None:
            named = dialect.structs.get(model.__name__)
            serde = shape_error(raw, (), named, model.model_fields, dialect)
        raise (
            _http_error(serde) if serde else HttpError(422, JSON_SHAPE + f"duplicate field `{dup}`")
        )
    return value


def _refused(
    raw: bytes,
    model: type[M],
    exc: ValidationError,
    dialect: SerdeDialect | None,
    struct: str | None,
) -> M:
    """What ``parse_json`` answers for a body the model refuses: the model read from an array
    as serde reads it (the body may even be good), the value alone when only bytes after it are
    wrong, or serde's error (``SerdeError``; an ``HttpError`` for the positionless texts)."""
    errors = exc.errors(include_url=False, include_context=False)
    first = errors[0] if errors else {"type": ""}
    if dialect is not None and raw.lstrip()[:1] == b"[" and model.__name__ in dialect.sequences:
        # serde reads a struct from an array too, field by field: the body may even be good
        return model.model_validate(struct_from_sequence(raw, dialect.sequences[model.__name__]))
    if dialect is not None:
        struct = struct or dialect.structs.get(model.__name__)
    if first["type"] == "json_invalid":
        end = first_value_end(raw, first.get("msg", ""))
        if end is not None:
            # like the reference, ignore what follows a complete JSON value
            return parse_json(raw[:end], model, dialect, struct)
        if dialect is not None:
            early = sequence_for_map(raw, struct, model.model_fields, dialect)
            if early is not None:
                raise early
        raise JsonSyntaxError(syntax_message(raw, dialect is not None))
    if dialect is not None:
        serde = shape_error(raw, errors, struct, model.model_fields, dialect)
        if serde is not None:
            raise serde
    if first["type"] == "model_type":
        raise JsonShapeError(
            f"invalid type: {unexpected(first.get('input'))}, "
            f"expected struct {_STRUCT_NAMES.get(model.__name__, model.__name__)}"
        )
    raise _shape_error(errors)


def parse_object(obj: Any, model: type[M]) -> M:
    """Validate an already-decoded JSON value (used for batch operations)."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise _shape_error(exc.errors(include_url=False, include_context=False)) from None
