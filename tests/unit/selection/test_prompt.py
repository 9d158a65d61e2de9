"""Prompt input (SELECTION.md §3): token hashing vectors, LoRA, precedence and the triple's checks."""

from __future__ import annotations

import pytest

from kv_slot_tracker.core.hashing import compute_block_hash_for_seq, signed_hashes, to_unsigned
from kv_slot_tracker.core.selection import (
    normalize_prompt,
    prompt_from_hashes,
    prompt_from_tokens,
)
from kv_slot_tracker.core.selection.errors import (
    HashLengthMismatch,
    MissingBlockHashes,
    MissingIslTokens,
    MissingSequenceHashes,
    PromptError,
    ZeroIslTokens,
)


def test_token_prompt_matches_the_reference_vectors() -> None:
    p = prompt_from_tokens(list(range(10)), 4)
    # kept signed (the API's form); as u64 the reference's vectors
    assert [to_unsigned(h) for h in p.block_hashes] == [9143094415614847814, 12124091508212882195]
    assert [to_unsigned(h) for h in p.sequence_hashes] == [9143094415614847814, 9510318385840434533]
    assert p.sequence_hashes == (9143094415614847814, -8936425687869117083)
    assert p.isl_tokens == 10
    assert p.from_tokens
    assert p.precomputed_chain == list(p.sequence_hashes)


def test_lora_changes_the_token_hashes() -> None:
    plain = prompt_from_tokens(list(range(8)), 4)
    lora = prompt_from_tokens(list(range(8)), 4, "adapter-a")
    assert lora.block_hashes != plain.block_hashes
    assert list(lora.block_hashes) == signed_hashes(
        compute_block_hash_for_seq(list(range(8)), 4, "adapter-a")
    )
    assert prompt_from_tokens(list(range(8)), 4, "") == plain  # empty name = no LoRA


def test_empty_token_prompt_is_accepted() -> None:
    p = prompt_from_tokens([], 4)
    assert (p.block_hashes, p.sequence_hashes, p.isl_tokens) == ((), (), 0)


def test_token_ids_win_over_hash_fields() -> None:
    p = normalize_prompt(block_size=4, token_ids=[1, 2, 3, 4, 5], block_hashes=[7], isl_tokens=0)
    assert p == prompt_from_tokens([1, 2, 3, 4, 5], 4)
    assert p.isl_tokens == 5
    assert len(p.block_hashes) == 1


def test_hash_triple_passes_through_signed() -> None:
    p = normalize_prompt(block_size=4, block_hashes=[-1, 5], sequence_hashes=[-2, 6], isl_tokens=3)
    assert p.block_hashes == (-1, 5)
    assert p.sequence_hashes == (-2, 6)
    assert p.isl_tokens == 3  # may be smaller than len * bs
    assert not p.from_tokens
    assert p.precomputed_chain is None
    empty = prompt_from_hashes(block_hashes=[], sequence_hashes=[], isl_tokens=4)
    assert (empty.block_hashes, empty.sequence_hashes) == ((), ())


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({}, MissingBlockHashes, "block_hashes is required without token_ids"),
        (
            {"sequence_hashes": [1], "isl_tokens": 0},
            MissingBlockHashes,
            "block_hashes is required without token_ids",
        ),
        (
            {"block_hashes": [1], "isl_tokens": 0},
            MissingSequenceHashes,
            "sequence_hashes is required without token_ids",
        ),
        (
            {"block_hashes": [1], "sequence_hashes": [1, 2]},
            MissingIslTokens,
            "isl_tokens is required without token_ids",
        ),
        (
            {"block_hashes": [1], "sequence_hashes": [1, 2], "isl_tokens": 0},
            ZeroIslTokens,
            "isl_tokens must be greater than 0",
        ),
        (
            {"block_hashes": [1], "sequence_hashes": [1, 2], "isl_tokens": 8},
            HashLengthMismatch,
            "block_hashes length 1 must match sequence_hashes length 2",
        ),
    ],
)
def test_triple_errors_in_reference_order(fields: dict, error: type, message: str) -> None:
    with pytest.raises(error) as e:
        normalize_prompt(block_size=4, **fields)
    assert str(e.value) == message
    assert isinstance(e.value, PromptError)


def test_explicit_booking_form_relaxes_block_hashes_and_isl() -> None:
    p = prompt_from_hashes(block_hashes=None, sequence_hashes=[], isl_tokens=0, for_booking=True)
    assert (p.block_hashes, p.sequence_hashes, p.isl_tokens) == (None, (), 0)
    with pytest.raises(MissingSequenceHashes):
        prompt_from_hashes(block_hashes=None, sequence_hashes=None, isl_tokens=4, for_booking=True)
    with pytest.raises(MissingIslTokens):
        prompt_from_hashes(
            block_hashes=None, sequence_hashes=[1], isl_tokens=None, for_booking=True
        )
    with pytest.raises(HashLengthMismatch):
        prompt_from_hashes(block_hashes=[1, 2], sequence_hashes=[1], isl_tokens=4, for_booking=True)
