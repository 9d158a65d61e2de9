"""The serde emulator on its own (``kv_slot_tracker.core.serde``): bytes in, the reference's
texts out, with no HTTP in between. Every expected text is one the reference answered (the
tables of ``tests/api/selection``, there behind the HTTP prefixes)."""

from __future__ import annotations

import pytest

from kv_slot_tracker.core.serde.errors import JsonShapeError, JsonSyntaxError
from kv_slot_tracker.core.serde.sequences import SeqField, SeqStruct, struct_from_sequence
from kv_slot_tracker.core.serde.shapes import repeated_key
from kv_slot_tracker.core.serde.syntax import syntax_message

OUTPUT_BLOCK = SeqStruct("OutputBlockRequest", (SeqField("decay_fraction", "f64"),))


def test_a_struct_is_read_from_an_array_field_by_field() -> None:
    assert struct_from_sequence(b"[1]", OUTPUT_BLOCK) == {"decay_fraction": 1}
    assert struct_from_sequence(b"[null]", OUTPUT_BLOCK) == {}


@pytest.mark.parametrize(
    ("raw", "error", "text"),
    [
        (b"[]", JsonShapeError,
         "invalid length 0, expected struct OutputBlockRequest with 1 element at line 1 column 2"),
        (b'["a"]', JsonShapeError,
         '[0]: invalid type: string "a", expected f64 at line 1 column 4'),
        (b"[[1]]", JsonShapeError, "[0]: invalid type: sequence, expected f64 at line 1 column 1"),
        (b"[1,2]", JsonSyntaxError, "trailing characters at line 1 column 4"),
        (b"[1,]", JsonSyntaxError, "trailing comma at line 1 column 4"),
    ],
)  # fmt: skip
def test_an_array_of_the_wrong_shape_gets_serdes_text(
    raw: bytes, error: type[Exception], text: str
) -> None:
    with pytest.raises(error) as caught:
        struct_from_sequence(raw, OUTPUT_BLOCK)
    assert str(caught.value) == text


def test_a_body_cut_short_names_what_was_being_read() -> None:
    assert syntax_message(b'{"mo', paths=True) == "EOF while parsing a string at line 1 column 4"
    assert syntax_message(b"{", paths=True) == "EOF while parsing an object at line 1 column 1"


def test_the_first_key_given_twice_is_found() -> None:
    assert repeated_key(b'{"a": 1, "b": 2, "a": 3, "b": 4}') == "a"
    assert repeated_key(b'{"a": 1, "b": {"c": 1, "c": 2}, "a": 2}') == "c"  # read first
    assert repeated_key(b'{"a": {"c": 1}, "b": {"c": 2}}') is None
    assert repeated_key(b'[{"a": 1, "a": 2}]') is None
