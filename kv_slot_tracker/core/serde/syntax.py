"""serde_json's texts for a body that is not JSON: ``expected value at line 1 column 3``,
``EOF while parsing an object at line 1 column 12`` and, as serde_path_to_error words a body
cut short on the selection routes, with the path being read in front. A complete JSON value
followed by other bytes is read as the value alone, as the reference reads it."""

from __future__ import annotations

import json
from typing import Any

import orjson


def not_strict_json(raw: bytes) -> bool:
    """Whether a strict JSON parser refuses ``raw`` (serde_json reads no ``NaN`` or
    ``Infinity`` literal, which a lenient parser takes)."""
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        return True
    return False


def first_value_end(raw: bytes, msg: str) -> int | None:
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


def syntax_message(raw: bytes, paths: bool = False) -> str:
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
