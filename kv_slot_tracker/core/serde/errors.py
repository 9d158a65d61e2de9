"""The two ways serde_json refuses a body, each carrying serde's own text (its path in front
and its position behind where serde gives them). The HTTP edge puts the reference's prefix
before the text and picks the status: 400 for a syntax error, 422 for a shape error."""

from __future__ import annotations


class SerdeError(Exception):
    """A body serde_json refuses, with the text it refuses it with."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class JsonSyntaxError(SerdeError):
    """Not JSON, or JSON that ends early (serde_json's syntax and EOF errors)."""


class JsonShapeError(SerdeError):
    """JSON of the wrong shape for the struct read from it (serde's data errors)."""
