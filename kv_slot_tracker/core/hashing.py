"""Dynamo-compatible block and sequence hashes of token ids (SPEC §1, Appendix A).

Block hash: ``xxh3_64`` of the block's tokens as little-endian u32, seeded with 1337, or with
``1337 + xxh3_64(lora_name)`` (mod 2^64) for a non-empty LoRA name. Sequence hash: the first block's
hash, then ``xxh3_64(le_u64(previous) || le_u64(block), 1337)``. Only full blocks are hashed.
"""

from __future__ import annotations

import struct
from array import array
from sys import byteorder

import xxhash

XXH3_SEED = 1337
_MASK64 = (1 << 64) - 1
_PAIR = struct.Struct("<QQ")


def lora_seed(lora_name: str | None) -> int:
    if not lora_name:
        return XXH3_SEED
    return (XXH3_SEED + xxhash.xxh3_64_intdigest(lora_name.encode(), seed=0)) & _MASK64


def compute_block_hash_for_seq(
    tokens: list[int], block_size: int, lora_name: str | None = None
) -> list[int]:
    """One hash per full block of ``tokens`` (each token a u32)."""
    if block_size <= 0:
        raise ValueError("block_size must be greater than 0")
    seed = lora_seed(lora_name)
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


def compute_seq_hash_for_block(block_hashes: list[int]) -> list[int]:
    """Chain block hashes so that each sequence hash implies its whole prefix."""
    out: list[int] = []
    h = xxhash.xxh3_64_intdigest
    pack = _PAIR.pack
    prev = 0
    for i, b in enumerate(block_hashes):
        prev = b if i == 0 else h(pack(prev, b), seed=XXH3_SEED)
        out.append(prev)
    return out


def sequence_hashes_for_tokens(
    tokens: list[int], block_size: int, lora_name: str | None = None
) -> list[int]:
    return compute_seq_hash_for_block(compute_block_hash_for_seq(tokens, block_size, lora_name))
