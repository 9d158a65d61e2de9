"""The integer ranges of the wire formats, named once.

Every record, HTTP body and engine event that carries a number carries one of these ranges: a
u64 (worker ids, router ids, hashes as records carry them, token counts), a u32 (ranks, block
sizes, token ids) or an i64 (the API's signed sequence hashes, instants). The limits, the
msgspec types that declare them in a struct (checked in C while decoding) and the one check for
a value already decoded live here; the modules that read numbers import them.

msgspec takes integer bounds only within int64, so ``U64`` states its lower bound alone: a
msgpack integer is at most 2^64 - 1 by its encoding, so a u64 field decoded from msgpack is
exact. Values decoded from JSON, or given as Python objects, check the upper bound with
``is_u64``.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeGuard

from msgspec import Meta

U32_MAX = 0xFFFF_FFFF
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
I64_MIN = -(1 << 63)
I64_MAX = (1 << 63) - 1
U32_LIMIT = 1 << 32  # the first value past a u32
U64_LIMIT = 1 << 64  # the first value past a u64

# as struct fields declare them
U32 = Annotated[int, Meta(ge=0, le=U32_MAX)]
U64 = Annotated[int, Meta(ge=0)]  # <= U64_MAX: msgpack cannot carry more (see above)
I64 = Annotated[int, Meta(ge=I64_MIN, le=I64_MAX)]


def is_u64(v: Any) -> TypeGuard[int]:
    """An int (not a bool) in 0 .. 2^64 - 1."""
    return type(v) is int and 0 <= v <= U64_MAX


def is_u32(v: Any) -> TypeGuard[int]:
    """An int (not a bool) in 0 .. 2^32 - 1."""
    return type(v) is int and 0 <= v <= U32_MAX
