"""Reading and validating JSON request bodies with the reference service's status codes.

415 for a non-JSON content type, 413 above the body limit, 400 for malformed JSON, 422 for a
well-formed body of the wrong shape. Every error is ``{"error": "..."}`` with the reference's fixed
message prefixes.
"""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from app.service import ServiceError

M = TypeVar("M", bound=BaseModel)

JSON_PARSE = "Failed to parse the request body as JSON: "
JSON_SHAPE = "Failed to deserialize the JSON body into the target type: "
CONTENT_TYPE = "Expected request with `Content-Type: application/json`"
TOO_LARGE = "Failed to buffer the request body: length limit exceeded"


def is_json_content_type(value: str | None) -> bool:
    if not value:
        return False
    mime = value.split(";", 1)[0].strip().lower()
    if mime == "application/json":
        return True
    return mime.startswith("application/") and mime.endswith("+json")


async def read_body(request: Request, limit: int) -> bytes:
    if not is_json_content_type(request.headers.get("content-type")):
        raise ServiceError(415, CONTENT_TYPE)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ServiceError(413, TOO_LARGE)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ServiceError(413, TOO_LARGE)
        chunks.append(chunk)
    return b"".join(chunks)


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _describe(err: dict[str, Any]) -> str:
    loc = _loc(err["loc"])
    typ = err["type"]
    field = str(err["loc"][-1]) if err["loc"] else ""
    if typ == "missing":
        return f"missing field `{field}`"
    if loc.startswith(("sequence_hashes", "token_ids")):
        top = loc.split("[", 1)[0]
        kind = "signed 64-bit sequence hashes" if top == "sequence_hashes" else "u32 token ids"
        if "[" in loc:
            expected = "i64" if top == "sequence_hashes" else "u32"
            return f"{loc}: invalid value: {err['msg']}, expected {expected}"
        return f"{loc}: invalid type: expected an array of {kind}"
    return f"{loc}: {err['msg']}" if loc else err["msg"]


def shape_error(exc: ValidationError) -> ServiceError:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    return ServiceError(422, JSON_SHAPE + _describe(errors[0]))


def parse_json(raw: bytes, model: type[M]) -> M:
    """Validate JSON bytes; 400 for syntax errors, 422 for shape errors."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        if errors and errors[0]["type"] == "json_invalid":
            raise ServiceError(400, JSON_PARSE + _syntax_message(raw)) from None
        if errors and errors[0]["type"] == "model_type":
            raise ServiceError(422, JSON_SHAPE + "invalid type: expected a JSON object") from None
        raise shape_error(exc) from None


def parse_object(obj: Any, model: type[M]) -> M:
    """Validate an already-decoded JSON value (used for batch operations)."""
    try:
        return model.model_validate(obj, strict=None)
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
