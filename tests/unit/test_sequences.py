"""Per-worker tracker ``ActiveSequences``.

Part 1 ports every test of seed [seed-S] (``sequences/single.rs``) under its own name and with its
exact numbers; the seeds' paused tokio clock is a ``FakeClock`` here. Part 2 adds the SPEC §9.1
scenarios C01-C14 that assert more than the seed test they derive from.
"""

from __future__ import annotations

import random

from kv_slot_tracker.core.sequences import ActiveSequences
from kv_slot_tracker.core.types import NS_PER_S, PrefillLoadHint
from tests.fakes import FakeClock
from tests.support import sequences as seed
from tests.support.prefill import prefill_order
from tests.support.sequences import (
    PromptMembershipDelta,
    PromptMembershipRemove,
    PromptMembershipStore,
    SeedOutcome,
    active_block_hashes,
    active_prompt_hashes,
    num_requests,
    worker_load_snapshot,
)


def tracking_hint(tokens: int) -> PrefillLoadHint | None:
    """The seed's ``tracking_hint``: an unmodeled hint, or no hint at all for 0 tokens."""
    return PrefillLoadHint(tokens, None) if tokens > 0 else None


def prefill_hint(tokens: int, duration_secs: int) -> PrefillLoadHint:
    """The seed's ``prefill_hint``: a modeled hint of ``duration_secs`` seconds."""
    return PrefillLoadHint(tokens, duration_secs * NS_PER_S)


def make_slot(clock: FakeClock, **kwargs) -> ActiveSequences:
    """``ActiveSequences::new(4)`` on the fake clock (deterministic output-block hashes)."""
    kwargs.setdefault("rng", random.Random(20240601))
    return ActiveSequences(4, clock.now, **kwargs)


def add(
    slot: ActiveSequences,
    request_id: str,
    token_sequence: list[int] | None,
    hint: PrefillLoadHint | None,
    decay_now: int,
    *,
    track: bool = True,
) -> SeedOutcome:
    outcome = seed.add(slot, request_id, token_sequence, None, track, hint, decay_now)
    slot.assert_consistent()
    return outcome


def free(slot: ActiveSequences, request_id: str, decay_now: int) -> PromptMembershipDelta:
    delta = seed.free(slot, request_id, decay_now)
    slot.assert_consistent()
    return delta


def mark(slot: ActiveSequences, request_id: str, decay_now: int) -> None:
    slot.mark_prefill_completed(request_id, decay_now)
    slot.assert_consistent()


def output_block(slot: ActiveSequences, request_id: str, fraction: float | None) -> int | None:
    h = slot.add_output_block(request_id, fraction)
    slot.assert_consistent()
    return h


def expire(slot: ActiveSequences) -> SeedOutcome:
    outcome = seed.force_expiry(slot)
    slot.assert_consistent()
    return outcome


# --------------------------------------------------------------------------------------------
# Seed [seed-S] tests
# --------------------------------------------------------------------------------------------


def test_prompt_membership_delta_only_reports_first_add_and_last_remove() -> None:
    clock = FakeClock()
    slot = make_slot(clock)
    decay_now = clock.now()

    first = add(slot, "r1", [1, 2], tracking_hint(8), decay_now)
    assert first.membership_delta == PromptMembershipDelta(
        stores=[PromptMembershipStore(parent=None, hashes=[1, 2])], removes=[]
    )
    assert first.expired_request_ids == set()

    second = add(slot, "r2", [1, 2, 3], tracking_hint(12), decay_now)
    assert second.membership_delta == PromptMembershipDelta(
        stores=[PromptMembershipStore(parent=2, hashes=[3])], removes=[]
    )

    first_free = free(slot, "r1", decay_now)
    assert first_free.removes == []
    assert first_free.stores == []

    second_free = free(slot, "r2", decay_now)
    assert second_free.stores == []
    assert second_free.removes == [PromptMembershipRemove(hashes=[1, 2, 3])]


def test_generic_block_membership_includes_output_blocks() -> None:
    clock = FakeClock()
    slot = make_slot(clock)
    decay_now = clock.now()

    outcome = add(slot, "r1", [1, 2, 3], tracking_hint(12), decay_now)
    assert outcome.membership_delta.stores == [PromptMembershipStore(None, [1, 2, 3])]
    assert active_block_hashes(slot) == {1, 2, 3}

    output_hash = output_block(slot, "r1", 0.5)
    assert output_hash is not None, "request exists"
    assert active_block_hashes(slot) == {1, 2, 3, output_hash}

    mark(slot, "r1", decay_now)
    assert slot.active_tokens(decay_now) == 0
    assert active_block_hashes(slot) == {1, 2, 3, output_hash}

    free_delta = free(slot, "r1", decay_now)
    assert free_delta.removes == [PromptMembershipRemove([1, 2, 3])]


def test_active_sequences_shared_blocks() -> None:
    clock = FakeClock()
    slot = make_slot(clock)
    decay_now = clock.now()

    add(slot, "request_1", [1, 2, 3], tracking_hint(12), decay_now)
    assert slot.active_blocks() == 3
    assert slot.active_tokens(decay_now) == 12

    add(slot, "request_2", [4], tracking_hint(4), decay_now)
    assert slot.active_blocks() == 4
    assert slot.active_tokens(decay_now) == 16

    add(slot, "request_3", [1, 2, 3, 4], tracking_hint(0), decay_now)
    assert slot.active_blocks() == 4
    assert slot.active_tokens(decay_now) == 16

    free(slot, "request_2", decay_now)
    assert slot.active_blocks() == 4
    assert slot.active_tokens(decay_now) == 12

    free(slot, "request_3", decay_now)
    assert slot.active_blocks() == 3
    assert slot.active_tokens(decay_now) == 12

    free(slot, "request_1", decay_now)
    assert slot.active_blocks() == 0
    assert slot.active_tokens(decay_now) == 0


def test_output_blocks_with_fractional_decay() -> None:
    clock = FakeClock()
    slot = make_slot(clock)
    decay_now = clock.now()

    add(slot, "r1", [1, 2, 3], tracking_hint(12), decay_now)
    assert slot.active_blocks() == 3

    assert output_block(slot, "r1", 0.5) is not None
    assert slot.active_blocks() == 2

    add(slot, "r2", [1, 2], tracking_hint(8), decay_now)
    assert slot.active_blocks() == 2

    assert output_block(slot, "r1", 0.0) is not None
    assert slot.active_blocks() == 1

    free(slot, "r2", decay_now)
    free(slot, "r1", decay_now)
    assert slot.active_blocks() == 0
    assert slot.active_tokens(decay_now) == 0


def test_mark_prefill_completed() -> None:
    clock = FakeClock()
    slot = make_slot(clock)
    decay_now = clock.now()

    add(slot, "r1", [1, 2, 3], tracking_hint(12), decay_now)
    assert slot.active_tokens(decay_now) == 12

    mark(slot, "r1", decay_now)
    assert slot.active_tokens(decay_now) == 0

    mark(slot, "r1", decay_now)
    assert slot.active_tokens(decay_now) == 0

    add(slot, "r2", [4, 5], tracking_hint(8), decay_now)
    assert slot.active_tokens(decay_now) == 8

    free(slot, "r2", decay_now)
    assert slot.active_tokens(decay_now) == 0


def test_add_request_without_prefill_tracking_keeps_active_tokens_zero() -> None:
    clock = FakeClock()
    slot = make_slot(clock)
    decay_now = clock.now()

    add(slot, "r1", [1, 2, 3], None, decay_now, track=False)

    assert slot.active_tokens(decay_now) == 0
    assert not prefill_order(slot.prefill)
    assert slot.prefill.full_sum == 0

    mark(slot, "r1", decay_now)
    assert slot.active_tokens(decay_now) == 0
    free(slot, "r1", decay_now)
    assert slot.active_blocks() == 0


def test_prefill_queue_and_sum_invariants_survive_idempotent_cleanup() -> None:
    clock = FakeClock()
    slot = make_slot(clock)
    decay_now = clock.now()

    add(slot, "r1", [1], prefill_hint(50, 10), decay_now)
    add(slot, "r2", [2], prefill_hint(30, 10), decay_now)

    assert slot.prefill.full_sum == 80
    assert list(prefill_order(slot.prefill)) == ["r1", "r2"]

    mark(slot, "r1", decay_now)
    mark(slot, "r1", decay_now)
    assert slot.prefill.full_sum == 30
    assert list(prefill_order(slot.prefill)) == ["r2"]

    free(slot, "r1", decay_now)
    free(slot, "r1", decay_now)
    assert slot.prefill.full_sum == 30
    assert list(prefill_order(slot.prefill)) == ["r2"]

    free(slot, "r2", decay_now)
    assert slot.prefill.full_sum == 0
    assert not prefill_order(slot.prefill)
    assert not slot.requests


def test_force_expiry() -> None:
    clock = FakeClock()
    slot = make_slot(clock)

    add(slot, "r1", [1, 2], tracking_hint(8), clock.now())
    add(slot, "r2", [3, 4], tracking_hint(8), clock.now())
    assert slot.active_blocks() == 4

    clock.advance(20)
    expired = expire(slot)
    assert expired.expired_request_ids == set(), "no check before CHECK_EXPIRY_FREQUENCY"
    assert slot.active_blocks() == 4

    clock.advance(11)
    expired = expire(slot)
    assert expired.expired_request_ids == set(), "requests not old enough to expire"
    assert slot.active_blocks() == 4

    clock.advance(270)
    expired = expire(slot)
    assert expired.expired_request_ids == {"r1", "r2"}
    assert slot.active_blocks() == 0
    assert slot.active_tokens(clock.now()) == 0

    clock.advance(31)
    expired = add(slot, "r3", [5], tracking_hint(4), clock.now())
    assert expired.expired_request_ids == set()
    assert slot.active_blocks() == 1
    assert slot.active_tokens(clock.now()) == 4


def test_force_expiry_reanchors_new_oldest_request() -> None:
    clock = FakeClock()
    slot = make_slot(clock)
    first_decay_now = clock.now()

    add(slot, "r1", [1], prefill_hint(40, 100), first_decay_now)
    clock.advance(250)
    add(slot, "r2", [2], prefill_hint(30, 100), clock.now())

    clock.advance(60)
    expired = expire(slot)
    assert expired.expired_request_ids == {"r1"}
    assert slot.active_tokens(clock.now()) == 30
    assert slot.prefill.anchor_rid == "r2"

    clock.advance(20)
    assert slot.active_tokens(clock.now()) == 24


# --------------------------------------------------------------------------------------------
# SPEC §9.1 scenarios (only where they assert more than the seed test above)
# C04 = test_prompt_membership_delta_only_reports_first_add_and_last_remove,
# C05 = test_generic_block_membership_includes_output_blocks, C06 = test_mark_prefill_completed,
# C07 = test_add_request_without_prefill_tracking_keeps_active_tokens_zero and
# C08 = test_prefill_queue_and_sum_invariants_survive_idempotent_cleanup assert nothing more.
# --------------------------------------------------------------------------------------------


def test_c01_shared_blocks_with_zero_token_hint_and_untracked_request() -> None:
    """C01 with the two "no prefill" inputs the seed's ``tracking_hint(0) -> None`` skips."""
    clock = FakeClock()
    slot = make_slot(clock)
    t = clock.now()

    add(slot, "r1", [1, 2, 3], tracking_hint(12), t)
    assert (slot.active_blocks(), slot.active_tokens(t)) == (3, 12)
    add(slot, "r2", [4], tracking_hint(4), t)
    assert (slot.active_blocks(), slot.active_tokens(t)) == (4, 16)
    # a hint that is present but carries 0 tokens creates no prefill (SPEC §2.3 step 5)
    add(slot, "r3", [1, 2, 3, 4], PrefillLoadHint(0, 5 * NS_PER_S), t)
    assert (slot.active_blocks(), slot.active_tokens(t)) == (4, 16)
    assert list(prefill_order(slot.prefill)) == ["r1", "r2"]
    # track_prefill_tokens=False ignores even a positive hint
    add(slot, "r4", [1, 2], PrefillLoadHint(100, None), t, track=False)
    assert (slot.active_blocks(), slot.active_tokens(t)) == (4, 16)
    assert len(slot.prefill) == 2
    assert slot.block_references() == {1: 3, 2: 3, 3: 2, 4: 2}
    # the block counts hold each position of the trie once: [1, 2] (r1, r3, r4), [3] below it
    # (r1, r3), [4] below that (r3) and [4] at the root (r2)
    assert slot.blocks.refcount == {1: 1, 2: 1, 3: 1, 4: 2}

    free(slot, "r4", t)
    free(slot, "r2", t)
    assert (slot.active_blocks(), slot.active_tokens(t)) == (4, 12)
    free(slot, "r3", t)
    assert (slot.active_blocks(), slot.active_tokens(t)) == (3, 12)
    free(slot, "r1", t)
    assert (slot.active_blocks(), slot.active_tokens(t)) == (0, 0)
    assert slot.blocks.is_empty()


def test_c02_fractional_decay_fractions_are_sticky() -> None:
    """C02 / SPEC §2.9: the refcounts and fractions behind 3 -> 2 -> 2 -> 1 -> 0."""
    clock = FakeClock()
    slot = make_slot(clock)
    t = clock.now()

    add(slot, "r1", [1, 2, 3], tracking_hint(12), t)
    assert slot.block_references() == {1: 1, 2: 1, 3: 1}
    assert slot.blocks.fraction == {}
    assert slot.active_blocks() == 3

    h1 = output_block(slot, "r1", 0.5)
    assert h1 is not None
    assert slot.blocks.fraction == {1: 0.5, 2: 0.5, 3: 0.5, h1: 0.5}
    assert slot.active_blocks() == 2  # 4 - 4 + 4 * 0.5

    add(slot, "r2", [1, 2], tracking_hint(8), t)
    assert slot.block_references() == {1: 2, 2: 2, 3: 1, h1: 1}
    assert slot.blocks.fraction == {1: 0.5, 2: 0.5, 3: 0.5, h1: 0.5}  # sticky when shared
    assert slot.active_blocks() == 2

    h2 = output_block(slot, "r1", 0.0)
    assert h2 is not None and h2 != h1
    # shared blocks 1 and 2 keep 0.5; the exclusive ones are overwritten with 0.0
    assert slot.blocks.fraction == {1: 0.5, 2: 0.5, 3: 0.0, h1: 0.0, h2: 0.0}
    assert slot.active_blocks() == 1  # 5 - 5 + 1.0

    free(slot, "r2", t)
    assert slot.active_blocks() == 1
    free(slot, "r1", t)
    assert slot.blocks.refcount == {}
    assert slot.blocks.fraction == {}
    assert slot.active_blocks() == 0
    assert slot.active_tokens(t) == 0


def test_c03_rounding_half_away_from_zero() -> None:
    clock = FakeClock()
    t = clock.now()

    slot = make_slot(clock)
    add(slot, "r1", [1, 2], None, t, track=False)
    assert output_block(slot, "r1", 0.5) is not None
    assert slot.active_blocks() == 2  # 3 exclusive blocks x 0.5 = 1.5 -> 2

    slot = make_slot(clock)
    add(slot, "r1", [1, 2, 3, 4], None, t, track=False)
    assert output_block(slot, "r1", 0.5) is not None
    assert slot.active_blocks() == 3  # 5 x 0.5 = 2.5 -> 3 (Python's round() would say 2)

    add(slot, "r2", [10, 11], None, t, track=False)
    assert output_block(slot, "r2", 0.5) is not None
    assert slot.active_blocks() == 4  # 8 x 0.5 = 4.0
    free(slot, "r2", t)
    assert slot.active_blocks() == 3  # back to 2.5 -> 3


def test_c09_expiry_timing_and_check_bookkeeping() -> None:
    """C09 plus the check instants of SPEC §2.10 and the prompts released by the expiry."""
    clock = FakeClock()
    t0 = clock.now()
    slot = make_slot(clock)
    assert slot.last_expiry_check == t0

    add(slot, "r1", [1, 2], tracking_hint(8), t0)
    add(slot, "r2", [3, 4], tracking_hint(8), t0)
    assert slot.active_blocks() == 4
    assert slot.last_expiry_check == t0  # the adds at t=0 were rate-limited

    clock.advance(20)
    out = expire(slot)
    assert out.expired_request_ids == set()
    assert out.membership_delta == PromptMembershipDelta()
    assert slot.last_expiry_check == t0
    assert slot.active_blocks() == 4

    clock.advance(11)
    out = expire(slot)
    assert out.expired_request_ids == set()
    assert slot.last_expiry_check == t0 + 31 * NS_PER_S
    assert slot.active_blocks() == 4

    clock.advance(270)
    out = expire(slot)
    assert out.expired_request_ids == {"r1", "r2"}
    assert slot.last_expiry_check == t0 + 301 * NS_PER_S
    assert out.membership_delta.stores == []
    assert sorted(r.hashes for r in out.membership_delta.removes) == [[1, 2], [3, 4]]
    assert out.expired_prompts == {"r1": [1, 2], "r2": [3, 4]}
    assert (slot.active_blocks(), slot.active_tokens(clock.now()), num_requests(slot)) == (0, 0, 0)

    clock.advance(31)
    out = add(slot, "r3", [5], tracking_hint(4), clock.now())
    assert out.expired_request_ids == set()
    assert slot.last_expiry_check == t0 + 332 * NS_PER_S  # the add's own check ran
    assert out.membership_delta.stores == [PromptMembershipStore(None, [5])]
    assert slot.active_blocks() == 1
    assert slot.active_tokens(clock.now()) == 4


def test_c10_strict_age_boundary() -> None:
    clock = FakeClock()
    t0 = clock.now()
    slot = make_slot(clock)
    add(slot, "r1", [1], None, t0, track=False)

    clock.advance(300)
    out = expire(slot)  # the check runs (300 >= 30) but an age of exactly 300 s is not expired
    assert out.expired_request_ids == set()
    assert slot.last_expiry_check == t0 + 300 * NS_PER_S
    assert slot.active_blocks() == 1

    clock.advance(29)
    out = expire(slot)  # rate-limited: r1 would be expired if the check ran
    assert out.expired_request_ids == set()
    assert slot.active_blocks() == 1

    clock.advance(1)
    out = expire(slot)
    assert out.expired_request_ids == {"r1"}
    assert out.membership_delta.removes == [PromptMembershipRemove([1])]
    assert slot.active_blocks() == 0


def test_c11_reanchor_on_expiry_uses_expiry_time() -> None:
    """C11 / E6: the expired anchor's successor decays from the expiry instant, not its add."""
    clock = FakeClock()
    t0 = clock.now()
    slot = make_slot(clock)

    add(slot, "r1", [1], prefill_hint(40, 100), t0)
    clock.advance(250)
    out = add(slot, "r2", [2], prefill_hint(30, 100), clock.now())
    assert out.expired_request_ids == set()  # its own check ran at 250 s and found nothing
    assert slot.last_expiry_check == t0 + 250 * NS_PER_S
    assert slot.prefill.anchor_rid == "r1"
    assert slot.prefill.anchor_since == t0

    clock.advance(60)
    out = expire(slot)
    assert out.expired_request_ids == {"r1"}
    assert slot.prefill.anchor_rid == "r2"
    assert slot.prefill.anchor_since == t0 + 310 * NS_PER_S
    assert slot.active_tokens(t0 + 310 * NS_PER_S) == 30
    # modeled backlog restarts at r2's full 100 s at the expiry instant
    assert slot.prefill.modeled_remaining_prefill_time_ms(t0 + 310 * NS_PER_S) == 100_000

    clock.advance(20)
    assert slot.active_tokens(clock.now()) == 24  # 30 - floor(30 * 20 / 100)
    assert slot.prefill.modeled_remaining_prefill_time_ms(clock.now()) == 80_000


def test_c12_duplicate_add_ignored() -> None:
    clock = FakeClock()
    t = clock.now()
    slot = make_slot(clock)
    add(slot, "r1", [1, 2], tracking_hint(8), t)

    out = add(slot, "r1", [9], tracking_hint(100), t)
    assert out == SeedOutcome()
    assert out.membership_delta.is_empty()
    assert out.expired_request_ids == set()
    assert slot.active_blocks() == 2
    assert slot.active_tokens(t) == 8
    assert num_requests(slot) == 1
    assert active_block_hashes(slot) == {1, 2}
    assert slot.requests["r1"].prompt_blocks == [1, 2]


def test_c12_duplicate_add_skips_expiry_check() -> None:
    """SPEC §2.3 step 1: a duplicate add changes nothing, not even the expiry check."""
    clock = FakeClock()
    t0 = clock.now()
    slot = make_slot(clock)
    add(slot, "old", [1], None, t0, track=False)
    add(slot, "r1", [2], None, t0, track=False)

    clock.advance(301)
    out = add(slot, "r1", [3], None, clock.now(), track=False)
    assert out.expired_request_ids == set()
    assert num_requests(slot) == 2
    assert slot.last_expiry_check == t0

    out = expire(slot)
    assert out.expired_request_ids == {"old", "r1"}


def test_c13_unknown_ids() -> None:
    clock = FakeClock()
    t = clock.now()
    slot = make_slot(clock)
    add(slot, "r1", [1, 2], prefill_hint(100, 10), t)

    assert free(slot, "x", t) == PromptMembershipDelta()
    mark(slot, "x", t + 5 * NS_PER_S)
    assert output_block(slot, "x", 0.5) is None

    # nothing moved: r1's prefill is still the anchor since t, blocks untouched, no fractions
    assert slot.prefill.anchor_rid == "r1"
    assert slot.prefill.anchor_since == t
    assert slot.active_tokens(t) == 100
    assert slot.active_blocks() == 2
    assert slot.blocks.fraction == {}
    assert num_requests(slot) == 1


def test_c14_expiry_disabled() -> None:
    clock = FakeClock()
    t0 = clock.now()
    slot = make_slot(clock, expiry_ns=None)
    add(slot, "r1", [1, 2], tracking_hint(8), t0)

    clock.advance(1000)
    out = expire(slot)
    assert out.expired_request_ids == set()
    assert slot.active_blocks() == 2
    assert slot.active_tokens(clock.now()) == 8

    out = add(slot, "r2", [3], None, clock.now(), track=False)  # an add does not expire either
    assert out.expired_request_ids == set()
    assert num_requests(slot) == 2
    assert slot.active_blocks() == 3


# --------------------------------------------------------------------------------------------
# Further §2 rules the scenarios above do not pin down
# --------------------------------------------------------------------------------------------


def test_expiry_age_uses_clock_not_decay_now() -> None:
    """SPEC §2.7: age is measured from ``clock.now()`` at add, never from ``decay_now``."""
    clock = FakeClock()
    t0 = clock.now()
    slot = make_slot(clock)
    # decay_now far in the past: it must not make the request look old
    add(slot, "r1", [1], tracking_hint(4), t0 - 10_000 * NS_PER_S)
    assert slot.requests["r1"].started_at == t0

    clock.advance(60)
    assert expire(slot).expired_request_ids == set()
    clock.advance(241)
    assert expire(slot).expired_request_ids == {"r1"}


def test_expired_free_reanchors_at_check_time() -> None:
    """SPEC §2.7: an expiry run from an add frees with ``decay_now = now`` of the check."""
    clock = FakeClock()
    t0 = clock.now()
    slot = make_slot(clock)
    add(slot, "r1", [1], prefill_hint(10, 10), t0)
    clock.advance(200)
    add(slot, "r2", [2], prefill_hint(50, 100), clock.now())
    clock.advance(101)  # t = 301: r1 (age 301) expires inside r3's add, r2 (age 101) stays
    add_time = clock.now()
    out = add(slot, "r3", [3], prefill_hint(20, 10), add_time - 7 * NS_PER_S)
    assert out.expired_request_ids == {"r1"}
    assert out.membership_delta.removes == [PromptMembershipRemove([1])]
    assert out.membership_delta.stores == [PromptMembershipStore(None, [3])]
    assert slot.prefill.anchor_rid == "r2"
    assert slot.prefill.anchor_since == add_time  # re-anchored at the check, not at decay_now
    assert list(prefill_order(slot.prefill)) == ["r2", "r3"]
    assert slot.active_tokens(add_time + 10 * NS_PER_S) == 65  # 70 - floor(50 * 10 / 100)


def test_free_reports_suffix_from_first_removed_block() -> None:
    """SPEC §2.4: the remove list starts at the first block that disappeared."""
    clock = FakeClock()
    t = clock.now()
    slot = make_slot(clock)
    add(slot, "a", [1, 2, 3, 4], None, t, track=False)
    out = add(slot, "b", [1, 2], None, t, track=False)
    assert out.membership_delta == PromptMembershipDelta()  # nothing became present
    out = add(slot, "c", [1, 2, 5], None, t, track=False)
    assert out.membership_delta.stores == [PromptMembershipStore(2, [5])]

    assert free(slot, "a", t).removes == [PromptMembershipRemove([3, 4])]
    assert free(slot, "c", t).removes == [PromptMembershipRemove([5])]
    assert free(slot, "b", t).removes == [PromptMembershipRemove([1, 2])]
    assert slot.blocks.is_empty()


def test_free_remove_list_continues_past_still_held_blocks() -> None:
    """SPEC §2.4: once a block disappeared, every later prompt block joins the remove list.

    Only visible with prompts that break the lineage assumption (``2`` after two prefixes).
    """
    clock = FakeClock()
    t = clock.now()
    slot = make_slot(clock)
    add(slot, "a", [1, 2, 3], None, t, track=False)
    add(slot, "b", [2, 3], None, t, track=False)
    assert free(slot, "a", t).removes == [PromptMembershipRemove([1, 2, 3])]
    assert active_block_hashes(slot) == {2, 3}


def test_store_reports_whole_tail_after_first_new_block() -> None:
    """SPEC §2.3 step 4: the store holds the remaining tail, even hashes already present."""
    clock = FakeClock()
    t = clock.now()
    slot = make_slot(clock)
    add(slot, "a", [1, 3], None, t, track=False)
    out = add(slot, "b", [1, 2, 3], None, t, track=False)
    assert out.membership_delta.stores == [PromptMembershipStore(1, [2, 3])]
    out = add(slot, "c", None, None, t, track=False)
    assert out.membership_delta == PromptMembershipDelta()
    assert slot.requests["c"].prompt_blocks == []


def test_worker_load_snapshot_counts_blocks_and_requests() -> None:
    clock = FakeClock()
    t = clock.now()
    slot = make_slot(clock)
    add(slot, "r1", [1, 2, 3], tracking_hint(12), t)
    add(slot, "r2", [1, 2], None, t, track=False)
    snap = worker_load_snapshot(slot)
    assert (snap.active_blocks, snap.active_requests) == (3, 2)
    assert active_prompt_hashes(slot) == {1, 2, 3}


# --------------------------------------------------------------------------------------------
# Storage of one request
# --------------------------------------------------------------------------------------------


def test_request_keeps_a_copy_of_its_prompt_and_no_output_list_until_needed() -> None:
    clock = FakeClock()
    slot = make_slot(clock)
    given = [5, 2**64 - 1, 7]
    add(slot, "r1", given, tracking_hint(10), clock.now())
    st = slot.requests["r1"]
    given.append(9)  # the caller's list is not the request's
    assert st.prompt_blocks == [5, 2**64 - 1, 7]
    assert st._outputs is None and st.output_blocks == ()
    h = output_block(slot, "r1", None)
    assert st.output_blocks == (h,)
    assert free(slot, "r1", clock.now()).removes[0].hashes == [5, 2**64 - 1, 7]
    assert slot.blocks.refcount == {}
