"""Block hashes: their one representation inside the service, its conversions, and the
Dynamo-compatible hashing of token ids (SPEC §1, Appendix A).

**The rule.** Inside the service a block (sequence) hash is a Python int in ``[-2^63, 2^63)``:
the API's wire form, a signed 64-bit integer, as the reference's JSON carries it. The HTTP edge
hands hashes through as they were decoded, and everything computed here (hashes of token ids,
random output blocks) is given in that form, so a prompt given as hashes and the same prompt
given as tokens hold the same values. The unsigned u64 form of the same 64 bits lives only at
the boundaries that need it:

* replica records and stored snapshots carry prompts as unsigned u64 (msgpack uint64), as
  they always did: an instance of an earlier version on the same stream, and snapshots stored
  before, read and write the same records (``kv_slot_tracker.core.events``,
  ``kv_slot_tracker.core.snapshot``);
* engines' KV events may carry a block hash in either form, the same block either way
  (``to_signed``);
* the xxh3 scheme itself is defined on u64 (``compute_block_hash_for_seq`` and
  ``compute_seq_hash_for_block`` keep the reference's unsigned values, tested against its
  vectors); ``sequence_hashes_for_tokens`` converts once;
* the selection service keeps them signed too (``kv_slot_tracker.core.selection``: its index
  of cache contents, its approximate cache, its prompts). Its selection records
  (``kv_slot_tracker.service.selection.wire``), its snapshots (the approximate cache's
  ``export``/``restore`` rows), its peers' index lines (``GET /selection/kv_index``,
  ``kv_slot_tracker.ingest.peers``) and ``/dump`` carry the u64 form as they always did; engines'
  KV events convert once as they are decoded (``kv_slot_tracker.ingest.records``). Its chain
  keys are ``chained_hashes`` of signed block hashes (the reference's u64 chain, signed).

Why signed inside: routers send real hashes, about half of them negative; converting each at
the edge cost about a fifth of a ``/batch`` operation, while records are written once per add
and snapshots rarely. Lists convert in C (``array``), a single value with one comparison.

Block hash: ``xxh3_64`` of the block's tokens as little-endian u32, seeded with 1337, plus
``xxh3_64(lora_name, seed 0)`` for a non-empty LoRA name, plus ``xxh3_64(cache_salt, seed 1)`` for a
non-empty cache salt (the selection service's ``cache_salt``, an engine event's cache namespace),
mod 2^64. Sequence hash: the first block's hash, then ``xxh3_64(le_u64(previous) || le_u64(block),
1337)``. Only full blocks are hashed. An EAGLE engine's event hashes each block's window of
``block_size + 1`` tokens (the block and the next token), ``eagle_block_hashes``.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from random import Random
from sys import byteorder

import xxhash

from .bounds import I64_MIN, U64_LIMIT

XXH3_SEED = 1337
_SIGN = 1 << 63
_SPAN = U64_LIMIT
_MASK64 = _SPAN - 1
_PAIR = struct.Struct("<QQ")
_PAIR_SIGNED = struct.Struct("<Qq")  # a chained hash (as xxh3 gives it) and a signed block hash


def to_signed(h: int) -> int:
    """A 64-bit hash given in either form (signed i64 or unsigned u64) as the service keeps it:
    the u64 values from 2^63 up become negative, the rest stay."""
    return h - _SPAN if h >= _SIGN else h


def to_unsigned(h: int) -> int:
    """A hash as the service keeps it (signed) as the unsigned u64 of the same 64 bits."""
    return h + _SPAN if h < 0 else h


def signed_hashes(hashes: Sequence[int]) -> list[int]:
    """Unsigned u64 hashes (as records and snapshots carry them) in the service's form, converted
    in C; values below 2^63 stay as they are. Raises OverflowError for a value outside u64 (below
    0 or from 2^64), TypeError for a value that is not an integer; a bool passes as 0 or 1, so
    input that may hold one checks the types first (``kv_slot_tracker.core.events``)."""
    return array("q", array("Q", hashes).tobytes()).tolist()


def unsigned_hashes(hashes: Sequence[int]) -> list[int]:
    """The service's (signed) hashes as unsigned u64, for records and snapshots; a list with
    no negative value is the same list."""
    if not hashes or min(hashes) >= 0:
        return list(hashes)
    return array("Q", array("q", hashes).tobytes()).tolist()


def random_hash(rng: Random) -> int:
    """A uniformly random hash in the service's form (an output block's)."""
    return rng.getrandbits(64) + I64_MIN


def lora_seed(lora_name: str | None, cache_salt: str | None = None) -> int:
    """The xxh3 seed of block hashes: 1337, shifted by a non-empty LoRA name and cache salt."""
    seed = XXH3_SEED
    if lora_name:
        seed += xxhash.xxh3_64_intdigest(lora_name.encode(), seed=0)
    if cache_salt:
        seed += xxhash.xxh3_64_intdigest(cache_salt.encode(), seed=1)
    return seed & _MASK64


def compute_block_hash_for_seq(
    tokens: list[int],
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """One hash per full block of ``tokens`` (each token a u32), unsigned as the reference
    computes it."""
    if block_size <= 0:
        raise ValueError("block_size must be greater than 0")
    seed = lora_seed(lora_name, cache_salt)
    n_blocks = len(tokens) // block_size
    if n_blocks == 0:
        return []
    buf = array("I", tokens[: n_blocks * block_size])  # raises OverflowError outside u32
    if byteorder != "little":
        buf.byteswap()
    raw = buf.tobytes()
    step = block_size * 4
    h = xxhash.xxh3_64_intdigest
    return [h(raw[i : i + step], seed=seed) for i in range(0, len(raw), step)]


def eagle_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """One hash per block of an EAGLE engine's tokens: block ``i`` hashes the window
    ``tokens[i * block_size : (i + 1) * block_size + 1]`` (the block and the next token), for
    every window ``tokens`` covers whole; unsigned."""
    if block_size <= 0:
        raise ValueError("block_size must be greater than 0")
    seed = lora_seed(lora_name, cache_salt)
    n_blocks = (len(tokens) - 1) // block_size if tokens else 0
    if n_blocks <= 0:
        return []
    buf = array("I", tokens[: n_blocks * block_size + 1])
    if byteorder != "little":
        buf.byteswap()
    raw = buf.tobytes()
    step = block_size * 4
    h = xxhash.xxh3_64_intdigest
    return [h(raw[i : i + step + 4], seed=seed) for i in range(0, n_blocks * step, step)]


def compute_seq_hash_for_block(block_hashes: list[int]) -> list[int]:
    """Chain block hashes so that each sequence hash implies its whole prefix (u64 in, u64
    out, as the reference computes them)."""
    out: list[int] = []
    h = xxhash.xxh3_64_intdigest
    pack = _PAIR.pack
    prev = 0
    for i, b in enumerate(block_hashes):
        prev = b if i == 0 else h(pack(prev, b), seed=XXH3_SEED)
        out.append(prev)
    return out


def chained_hashes(block_hashes: Sequence[int], parent: int | None = None) -> list[int]:
    """``compute_seq_hash_for_block`` in the service's form: the chained hashes of signed block
    hashes, signed (the bytes hashed are the same; the result converts once, in C). With
    ``parent`` (a signed chained hash) the chain continues from it instead of starting."""
    if not block_hashes:
        return []
    h = xxhash.xxh3_64_intdigest
    pack = _PAIR_SIGNED.pack
    out: list[int] = []
    if parent is None:
        prev = block_hashes[0] & _MASK64
        out.append(prev)
        rest = block_hashes[1:]
    else:
        prev, rest = parent & _MASK64, block_hashes
    for b in rest:
        prev = h(pack(prev, b), seed=XXH3_SEED)
        out.append(prev)
    return signed_hashes(out)


def sequence_hashes_for_tokens(
    tokens: list[int], block_size: int, lora_name: str | None = None
) -> list[int]:
    """The sequence hashes of ``tokens``' full blocks in the service's (signed) form: what a
    client that hashed the same tokens sends as ``sequence_hashes``."""
    return signed_hashes(
        compute_seq_hash_for_block(compute_block_hash_for_seq(tokens, block_size, lora_name))
    )
