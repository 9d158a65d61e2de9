"""Dynamo-compatible block and sequence hashes: SPEC Appendix A vectors and edge cases."""

from __future__ import annotations

import pytest

from kv_slot_tracker.core.hashing import (
    XXH3_SEED,
    chained_hashes,
    compute_block_hash_for_seq,
    compute_seq_hash_for_block,
    lora_seed,
    sequence_hashes_for_tokens,
    signed_hashes,
)

TOKENS_1_TO_8 = [1, 2, 3, 4, 5, 6, 7, 8]

# Appendix A
NO_LORA_BLOCKS = [14643705804678351452, 16777012769546811212]
NO_LORA_SEQ = [14643705804678351452, 4945711292740353085]
ADAPTER_A_BLOCKS = [11381080598872079209, 5698110331184095209]
ADAPTER_A_SEQ = [11381080598872079209, 17518568667535815909]
SEVEN = 11011797887259449313
EIGHT = 3506949431103013350


def test_vector_tokens_1_to_8_no_lora() -> None:
    assert compute_block_hash_for_seq(TOKENS_1_TO_8, 4) == NO_LORA_BLOCKS
    assert compute_block_hash_for_seq(TOKENS_1_TO_8, 4, None) == NO_LORA_BLOCKS
    assert compute_seq_hash_for_block(NO_LORA_BLOCKS) == NO_LORA_SEQ
    assert sequence_hashes_for_tokens(TOKENS_1_TO_8, 4) == signed_hashes(NO_LORA_SEQ)


def test_vector_tokens_1_to_8_lora_adapter_a() -> None:
    assert compute_block_hash_for_seq(TOKENS_1_TO_8, 4, "adapter-a") == ADAPTER_A_BLOCKS
    assert compute_seq_hash_for_block(ADAPTER_A_BLOCKS) == ADAPTER_A_SEQ
    assert sequence_hashes_for_tokens(TOKENS_1_TO_8, 4, "adapter-a") == signed_hashes(ADAPTER_A_SEQ)


def test_vector_repeated_token_block_size_1() -> None:
    assert compute_block_hash_for_seq([7, 7, 7], 1) == [SEVEN] * 3
    assert sequence_hashes_for_tokens([7, 7, 7], 1) == signed_hashes(
        [
            11011797887259449313,
            5194970134674063120,
            6904579805665688752,
        ]
    )


def test_vector_7_7_8_block_size_1() -> None:
    assert compute_block_hash_for_seq([7, 7, 8], 1) == [SEVEN, SEVEN, EIGHT]
    assert sequence_hashes_for_tokens([7, 7, 8], 1) == signed_hashes(
        [
            11011797887259449313,
            5194970134674063120,
            12884792542360926810,
        ]
    )


def test_vector_empty_lora_name_is_no_lora() -> None:
    assert compute_block_hash_for_seq([1, 2, 3, 4], 4, "") == [14643705804678351452]
    assert compute_block_hash_for_seq([1, 2, 3, 4], 4, "") == compute_block_hash_for_seq(
        [1, 2, 3, 4], 4, None
    )
    assert lora_seed("") == lora_seed(None) == XXH3_SEED == 1337


def test_http_signed_form_of_vector() -> None:
    """Appendix A: the signed i64 the HTTP API needs for the first block hash, which is what
    the service computes for tokens (its own form: signed)."""
    assert NO_LORA_BLOCKS[0] - 2**64 == -3803038269031200164
    assert sequence_hashes_for_tokens(TOKENS_1_TO_8, 4) == [
        -3803038269031200164,
        4945711292740353085,
    ]


def test_chained_hashes_are_the_reference_chain_in_the_signed_form() -> None:
    """Appendix A's sequence hashes from its block hashes given signed, whole or continued
    from a parent chain key."""
    blocks = signed_hashes(NO_LORA_BLOCKS)
    assert blocks[0] == -3803038269031200164  # negative: given as the API sends it
    assert (
        chained_hashes(blocks)
        == signed_hashes(NO_LORA_SEQ)
        == [
            -3803038269031200164,
            4945711292740353085,
        ]
    )
    assert chained_hashes(blocks[1:], parent=chained_hashes(blocks)[0]) == [4945711292740353085]
    assert chained_hashes([]) == []
    assert chained_hashes([], parent=5) == []


def test_partial_trailing_block_is_ignored() -> None:
    assert compute_block_hash_for_seq([*TOKENS_1_TO_8, 9, 10, 11], 4) == NO_LORA_BLOCKS
    assert sequence_hashes_for_tokens([*TOKENS_1_TO_8, 9, 10, 11], 4) == signed_hashes(NO_LORA_SEQ)
    assert compute_block_hash_for_seq([1, 2, 3], 4) == []
    assert sequence_hashes_for_tokens([1, 2, 3], 4) == []


def test_partial_trailing_block_is_not_validated() -> None:
    """Tokens past the last full block are dropped before conversion to u32."""
    assert compute_block_hash_for_seq([*TOKENS_1_TO_8, 2**32], 4) == NO_LORA_BLOCKS


def test_empty_inputs() -> None:
    assert compute_block_hash_for_seq([], 4) == []
    assert compute_seq_hash_for_block([]) == []
    assert sequence_hashes_for_tokens([], 1, "adapter-a") == []


def test_sequence_hash_is_a_prefix_chain() -> None:
    """Each sequence hash depends on the whole prefix, the first equals the first block hash."""
    first_block = sequence_hashes_for_tokens([1, 2, 3, 4], 4)
    assert first_block == signed_hashes([NO_LORA_SEQ[0]])
    # same second block under a different first block gives a different sequence hash
    other = sequence_hashes_for_tokens([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert compute_block_hash_for_seq([9, 9, 9, 9, 5, 6, 7, 8], 4)[1] == NO_LORA_BLOCKS[1]
    assert other[1] != signed_hashes(NO_LORA_SEQ)[1]


def test_lora_changes_block_hashes_but_not_chaining_seed() -> None:
    assert lora_seed("adapter-a") != XXH3_SEED
    assert ADAPTER_A_BLOCKS != NO_LORA_BLOCKS
    # chaining always uses seed 1337: chaining the LoRA block hashes gives the LoRA vector
    assert compute_seq_hash_for_block(ADAPTER_A_BLOCKS)[1] == ADAPTER_A_SEQ[1]


def test_lora_names_are_distinguished() -> None:
    assert compute_block_hash_for_seq(TOKENS_1_TO_8, 4, "adapter-b") != ADAPTER_A_BLOCKS
    assert compute_block_hash_for_seq(TOKENS_1_TO_8, 4, "adapter-b") != NO_LORA_BLOCKS


def test_token_outside_u32_raises() -> None:
    with pytest.raises((OverflowError, ValueError)):
        compute_block_hash_for_seq([1, 2, 3, 2**32], 4)
    with pytest.raises((OverflowError, ValueError)):
        compute_block_hash_for_seq([-1], 1)


def test_u32_max_token_is_accepted() -> None:
    hashes = compute_block_hash_for_seq([2**32 - 1], 1)
    assert len(hashes) == 1
    assert 0 <= hashes[0] < 2**64
    assert hashes != compute_block_hash_for_seq([0], 1)


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        compute_block_hash_for_seq([1, 2, 3], 0)
    with pytest.raises(ValueError):
        compute_block_hash_for_seq([1, 2, 3], -4)


def test_block_size_changes_grouping() -> None:
    by_two = compute_block_hash_for_seq([1, 2, 3, 4], 2)
    assert len(by_two) == 2
    assert by_two[0] == compute_block_hash_for_seq([1, 2], 2)[0]
    assert by_two[1] == compute_block_hash_for_seq([3, 4], 2)[0]
    assert by_two != compute_block_hash_for_seq([1, 2, 3, 4], 4) * 2


def test_signed_hashes_converts_the_u64_range_and_refuses_what_is_outside() -> None:
    assert signed_hashes([]) == []
    assert signed_hashes([0, 2**63 - 1, 2**63, 2**64 - 1]) == [0, 2**63 - 1, -(2**63), -1]
    assert signed_hashes((5, 6)) == [5, 6]
    for outside in ([-1], [1, -1], [2**64], [2**63, -(2**63)]):
        with pytest.raises(OverflowError):
            signed_hashes(outside)
    with pytest.raises(TypeError):
        signed_hashes([1.0])  # type: ignore[list-item]
