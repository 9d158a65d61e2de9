"""How the index of real cache contents names a block: its tier, and its keys.

An engine names its blocks with its own hashes (``block_hash``, vLLM's ``ExternalBlockHash``;
any 64-bit value, signed or not, given here in the service's signed form:
``kv_slot_tracker.core.hashing``) and links a stored run to its parent by that hash. Prompts
arrive as the router's *local* hashes (xxh3 of the block's tokens,
``compute_block_hash_for_seq`` with the partition's block size, LoRA name and cache salt), so a
stored block is re-hashed from the ``token_ids`` the event carries (``local_hashes``) and then
keyed by its *chain key*: the chained local hashes from block 0 (``chained_hashes``), which is
the prompt's own sequence hash at that depth. Every hash here is signed. The engine's hash only
serves to find a parent and to remove a block; the parent's chain key and the new block's local
hash give the new chain key. A host, disk or external block is keyed by its edge ``(parent
engine hash, local hash)`` (``edge_key``), as in the reference's ``LowerTierIndexer``.

Tiers: ``device`` (GPU), ``host_pinned`` (CPU), ``disk`` and ``external``, named by the engines'
media (``tier_of_medium``). A block is listed (``/dump``) as an ``IndexedBlock`` or, with those
stored together, a ``StoredChain``. Pure: no time, I/O or asyncio.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import xxhash

from ..hashing import (
    XXH3_SEED,
    compute_block_hash_for_seq,
    eagle_block_hashes,
    signed_hashes,
    to_signed,
)
from ..types import WorkerWithDpRank

DEVICE, HOST_PINNED, DISK, EXTERNAL = 0, 1, 2, 3
TIERS = (DEVICE, HOST_PINNED, DISK, EXTERNAL)
TIER_NAMES = ("device", "host_pinned", "disk", "external")
LOWER_TIERS = (HOST_PINNED, DISK, EXTERNAL)
"""Walked in this order after the device prefix (the reference's ``lower_tier_query_order``)."""

# The engines' medium names (vLLM's ``medium``; the reference's ``StorageTier::from_kv_medium``).
# A missing medium is the device tier; a medium not listed is no tier (the event is skipped).
_MEDIA = {
    "GPU": DEVICE,
    "DEVICE": DEVICE,
    "CPU": HOST_PINNED,
    "CPU_PINNED": HOST_PINNED,
    "CPU_TIER1": HOST_PINNED,
    "CPU_TIER2": DISK,
    "DISK": DISK,
    "NVME": DISK,
    "STORAGE": DISK,
    "EXTERNAL": EXTERNAL,
    "NETWORK": EXTERNAL,
    "REMOTE": EXTERNAL,
    "SHARED": EXTERNAL,
}

_h = xxhash.xxh3_64_intdigest
_pack = struct.Struct("<qq").pack


def tier_of_medium(medium: str | None) -> int | None:
    """The tier of an event's ``medium`` (case-sensitive); ``None`` for a medium the reference
    does not know (the event is skipped)."""
    if medium is None:
        return DEVICE
    return _MEDIA.get(medium)


def chain_key(parent_key: int | None, local_hash: int) -> int:
    """The chain key of a block: its local hash at depth 0, else xxh3 of (parent key, local)."""
    if parent_key is None:
        return local_hash
    return to_signed(_h(_pack(parent_key, local_hash), seed=XXH3_SEED))


def edge_key(parent_hash: int | None, local_hash: int) -> int:
    """The key of a host/disk/external block's edge: its parent's engine hash (``None`` at depth
    0) and its local hash, as one int (xxh3 of both; a depth-0 block's key is its local hash)."""
    if parent_hash is None:
        return local_hash
    return to_signed(_h(_pack(parent_hash, local_hash), seed=_EDGE_SEED))


_EDGE_SEED = 0x65_64_67_65  # any constant: it only separates these keys from the chain keys


def local_hashes(
    token_ids: Sequence[int],
    event_block_size: int,
    num_blocks: int,
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    eagle: bool = False,
) -> list[int]:
    """The router's local hash of each stored block, as the reference derives them: only when the
    event's block size is the partition's, and only for the blocks ``token_ids`` fully covers
    (at most ``num_blocks``; an EAGLE event's block needs the token after it too), signed,
    seeded by the LoRA name and the cache salt."""
    if event_block_size != block_size or block_size <= 0:
        return []
    if eagle:
        n = min(num_blocks, max(len(token_ids) - 1, 0) // block_size)
        return signed_hashes(
            eagle_block_hashes(
                token_ids[: n * block_size + 1] if n else (), block_size, lora_name, cache_salt
            )
        )
    n = min(num_blocks, len(token_ids) // block_size)
    return signed_hashes(
        compute_block_hash_for_seq(
            list(token_ids[: n * block_size]), block_size, lora_name, cache_salt
        )
    )


@dataclass(frozen=True, slots=True)
class StoredChain:
    """Consecutive blocks of one rank and tier under one parent, as one stored event of
    ``/dump``."""

    worker: WorkerWithDpRank
    tier: int
    parent_hash: int | None
    """The engine's hash of the block before the chain, ``None`` at depth 0."""
    blocks: tuple[tuple[int, int], ...]
    """``(engine hash, local hash)`` per block, signed."""


@dataclass(frozen=True, slots=True)
class IndexedBlock:
    """One block of one rank and tier, as ``/dump`` lists it."""

    worker: WorkerWithDpRank
    tier: int
    block_hash: int
    """The engine's hash (signed)."""
    parent_hash: int | None
    """The engine's hash of the parent block, ``None`` at depth 0."""
    tokens_hash: int
    """The router's local hash (signed)."""


# A per-rank map whose table holds four times the bytes its entries need (a right-sized dict
# takes at most 54 bytes an entry) is copied to a right-sized one after removals.
_SPARSE_BYTES_PER_ENTRY = 4 * 54
_SMALL_MAP_BYTES = 4096
_V = TypeVar("_V")


def compact(d: dict[int, _V]) -> dict[int, _V]:
    """``d``, or a right-sized copy of it once removals left its table four times too large.

    A Python dict never shrinks its table on deletions: a rank's map that grew during a burst
    of stores and then lost most of its blocks would keep the burst's memory until the rank
    is cleared. Copying costs one pass over what is left, and the next copy needs the map to
    shrink fourfold again, so removals stay O(1) amortized."""
    if sys.getsizeof(d) > _SPARSE_BYTES_PER_ENTRY * len(d) + _SMALL_MAP_BYTES:
        return dict(d)
    return d
