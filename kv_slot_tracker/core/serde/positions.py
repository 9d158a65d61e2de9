"""Where serde_json stands in a JSON text: ``at line L column C`` (columns count bytes), and
where each value of an object ends, for texts that point where serde stopped reading."""

from __future__ import annotations

import contextlib
import json
from json.decoder import scanstring  # type: ignore[attr-defined]  # not in typeshed's __all__
from typing import Any


def at_offset(text: str, offset: int) -> str:
    """`` at line L column C`` once serde_json has read ``text[:offset]``."""
    text = text[:offset]
    line = text.count("\n") + 1
    column = len(text[text.rfind("\n") + 1 :].encode())
    return f" at line {line} column {column}"


class Positions:
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
                    key, i = scanstring(text, i + 1)
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
        return at_offset(self.text, offset)
