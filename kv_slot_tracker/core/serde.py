"""How the reference (Rust, serde) names a JSON value it did not expect, for error texts that
match it word for word: ``integer `5```, ``string "x"``, ``sequence``, ``map`` ..."""

from __future__ import annotations


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
