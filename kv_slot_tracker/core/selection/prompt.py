"""A selection request's prompt, normalised: block hashes, sequence hashes and input length.

Why: every selection route accepts either ``token_ids`` (hashed here with the partition's block
size and the request's LoRA name) or the hash triple, with fixed validation order and texts
(SELECTION.md §3). The hashing itself is ``kv_slot_tracker.core.hashing`` (the same scheme as the slot
tracker, verified against the reference); this module only decides which input wins and checks
the triple. Hashes are in the service's signed form (``kv_slot_tracker.core.hashing``): hashes
given by the API pass through as they are, token prompts are hashed to that form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..hashing import compute_block_hash_for_seq, compute_seq_hash_for_block, signed_hashes
from .errors import (
    HashLengthMismatch,
    MissingBlockHashes,
    MissingIslTokens,
    MissingSequenceHashes,
    ZeroIslTokens,
)


@dataclass(frozen=True, slots=True)
class Prompt:
    block_hashes: tuple[int, ...] | None
    """Local block hashes (signed) that feed the approximate cache; ``None`` when not given."""
    sequence_hashes: tuple[int, ...]
    """Chained hashes (signed) that drive active-block accounting."""
    isl_tokens: int
    from_tokens: bool
    """Built from ``token_ids``: the sequence hashes are then the cache's chain keys."""

    @property
    def precomputed_chain(self) -> list[int] | None:
        """The approximate-cache keys when known for free (a token prompt's sequence hashes),
        else ``None`` (``approx_cache.cache_chain`` computes them for any prompt)."""
        return list(self.sequence_hashes) if self.from_tokens else None


def prompt_from_tokens(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> Prompt:
    """Hash a token prompt: full blocks only; ``isl`` is the token count (0 is accepted); a
    non-empty ``cache_salt`` shifts the hashes' seed as the engines' salted blocks are."""
    blocks = compute_block_hash_for_seq(list(token_ids), block_size, lora_name, cache_salt)
    return Prompt(
        block_hashes=tuple(signed_hashes(blocks)),
        sequence_hashes=tuple(signed_hashes(compute_seq_hash_for_block(blocks))),
        isl_tokens=len(token_ids),
        from_tokens=True,
    )


def prompt_from_hashes(
    *,
    block_hashes: Sequence[int] | None,
    sequence_hashes: Sequence[int] | None,
    isl_tokens: int | None,
    for_booking: bool = False,
) -> Prompt:
    """Check a hash triple (signed, as the API gives it) in the reference's order.

    ``for_booking`` is the explicit ``POST /reservations`` form: ``block_hashes`` may be absent
    (the approximate cache then records nothing) and ``isl_tokens`` may be 0.
    """
    if block_hashes is None and not for_booking:
        raise MissingBlockHashes()
    if sequence_hashes is None:
        raise MissingSequenceHashes()
    if isl_tokens is None:
        raise MissingIslTokens()
    if isl_tokens == 0 and not for_booking:
        raise ZeroIslTokens()
    if block_hashes is not None and len(block_hashes) != len(sequence_hashes):
        raise HashLengthMismatch(len(block_hashes), len(sequence_hashes))
    return Prompt(
        block_hashes=None if block_hashes is None else tuple(block_hashes),
        sequence_hashes=tuple(sequence_hashes),
        isl_tokens=isl_tokens,
        from_tokens=False,
    )


def normalize_prompt(
    *,
    block_size: int,
    token_ids: Sequence[int] | None = None,
    block_hashes: Sequence[int] | None = None,
    sequence_hashes: Sequence[int] | None = None,
    isl_tokens: int | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    for_booking: bool = False,
) -> Prompt:
    """``token_ids`` when present (the hash fields are then ignored), else the hash triple."""
    if token_ids is not None:
        return prompt_from_tokens(token_ids, block_size, lora_name, cache_salt)
    return prompt_from_hashes(
        block_hashes=block_hashes,
        sequence_hashes=sequence_hashes,
        isl_tokens=isl_tokens,
        for_booking=for_booking,
    )
