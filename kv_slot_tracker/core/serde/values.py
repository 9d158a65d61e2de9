"""How the reference (Rust, serde) names a JSON value it did not expect, for error texts that
match it word for word: ``integer `5```, ``string "x"``, ``sequence``, ``map`` ..., and what it
says of a value where a type was expected (``invalid type`` or, for an integer out of the
type's range, ``invalid value``)."""

from __future__ import annotations

from typing import Any

# The largest value of each Rust integer type these texts name.
UNSIGNED = {"u32": 2**32 - 1, "u64": 2**64 - 1, "usize": 2**64 - 1}
INTEGERS = {**UNSIGNED, "i64": 2**63 - 1}


def unexpected(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value!r}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list):
        return "sequence"
    if isinstance(value, dict):
        return "map"
    return "value"


def mismatch(value: Any, rust: str) -> str:
    """serde's ``invalid type`` / ``invalid value`` for ``value`` where ``rust`` was expected."""
    if rust in INTEGERS and type(value) is int:
        if value >= 2**64 or value < -(2**63):  # serde_json reads it as a float
            return f"invalid type: floating point `{float(value)!r}`, expected {rust}"
        return f"invalid value: integer `{value}`, expected {rust}"
    return f"invalid type: {unexpected(value)}, expected {rust}"
