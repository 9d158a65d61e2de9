"""Stateful property test: every rank's blocks equal SPEC §2.1-§2.2 computed literally.

The tracker counts a rank's blocks by the trie positions it holds, not by prompt references
(``ActiveSequences``). This test keeps the SPEC's own model beside it: one reference per prompt
position and per output block, duplicates counted; a hash is present while it has a reference;
an output block with a decay fraction gives that fraction to every block of its request held by
exactly one reference; a fraction sticks until its hash goes. Prompts are short runs of a few
small hashes, so they repeat inside one prompt, reappear under other prefixes and are shared
between ranks; output hashes are drawn from the same few values, so they collide with prompt
hashes too. Other prompts follow one lineage (chained hashes, as real prompts are) with a short
tail, so they share prefixes of different lengths: positions go from one prompt to shared and
back, which is what the decaying requests' fraction groups must follow. Fractions include NaN
and infinity (the literal floating-point loop). After every step each rank's present hashes,
fractions and active blocks must equal the model's.
"""

from __future__ import annotations

import math
import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kv_slot_tracker.core.sequences import ActiveSequences
from kv_slot_tracker.core.types import (
    WorkerWithDpRank,
    round_half_away_from_zero_usize,
)
from tests.fakes import FakeClock
from tests.support import sequences as seed
from tests.support.tracker import SequenceRequest, add_request, new_without_expiry, slots

RANKS = [WorkerWithDpRank(1, 0), WorkerWithDpRank(1, 1), WorkerWithDpRank(2, 0)]
LINEAGE = list(range(1001, 1013))
prompts = st.one_of(
    st.lists(st.integers(1, 6), max_size=6),
    st.builds(
        lambda k, tail: LINEAGE[:k] + tail,
        st.integers(0, len(LINEAGE)),
        st.lists(st.sampled_from([2001, 2002, 2003]), max_size=2, unique=True),
    ),
)
fractions = st.sampled_from([None, None, 0.0, 0.25, 0.5, 0.75, 1.0, math.nan, math.inf])


class FewValues(random.Random):
    """Output hashes from the prompts' own few values (a fake of the rank's generator)."""

    def getrandbits(self, k: int) -> int:
        return 1 + int(self.random() * 8)


class ModelRank:
    """SPEC §2.1-§2.2 as written: reference counts per hash, sticky fractions."""

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}
        self.fraction: dict[int, float] = {}
        self.requests: dict[str, tuple[list[int], list[int]]] = {}

    def take(self, h: int) -> None:
        self.refs[h] = self.refs.get(h, 0) + 1

    def add(self, rid: str, prompt: list[int]) -> None:
        self.requests[rid] = (list(prompt), [])
        for h in prompt:
            self.take(h)

    def free(self, rid: str) -> None:
        prompt, outputs = self.requests.pop(rid)
        for h in (*prompt, *outputs):
            self.refs[h] -= 1
            if not self.refs[h]:
                del self.refs[h]
                self.fraction.pop(h, None)

    def output(self, rid: str, h: int, fraction: float | None) -> None:
        prompt, outputs = self.requests[rid]
        self.take(h)
        outputs.append(h)
        if fraction is not None:
            for b in (*prompt, *outputs):
                if self.refs[b] == 1:
                    self.fraction[b] = fraction

    def active_blocks(self) -> int:
        count = float(len(self.refs))
        for f in self.fraction.values():
            count = count - 1.0 + f
        return round_half_away_from_zero_usize(count)


class BlockCountsMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**32 - 1), alone=st.booleans())
    def setup(self, seed: int, alone: bool) -> None:
        """``alone``: one rank standing alone, with its own trie; else the tracker's ranks."""
        self.clock = FakeClock()
        self.alone = alone
        if alone:
            self.slot = ActiveSequences(2, self.clock.now, expiry_ns=None, rng=FewValues(seed))
            self.slots = {RANKS[0]: self.slot}
        else:
            self.tracker = new_without_expiry(None, 2, {1: (0, 2), 2: (0, 1)}, clock=self.clock.now)
            self.slots = slots(self.tracker)
            for i, slot in enumerate(self.slots.values()):
                slot._rng = FewValues(seed + i)
        self.model = {w: ModelRank() for w in self.slots}
        self.where: dict[str, WorkerWithDpRank] = {}
        self.next_id = 0

    @rule(rank=st.sampled_from(RANKS), prompt=prompts)
    def add(self, rank: WorkerWithDpRank, prompt: list[int]) -> None:
        if self.alone:
            rank = RANKS[0]
        self.next_id += 1
        rid = f"r{self.next_id}"
        now = self.clock.now()
        if self.alone:
            self.slot.add_request_with_prefill_tracking(rid, prompt, None, False, None, now)
        else:
            add_request(self.tracker, SequenceRequest(rid, rank, list(prompt)), now)
        self.model[rank].add(rid, prompt)
        self.where[rid] = rank

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if not self.where:
            return
        rid = data.draw(st.sampled_from(sorted(self.where)))
        rank = self.where.pop(rid)
        if self.alone:
            self.slot.release(rid, self.clock.now())
        else:
            assert self.tracker.free(rid, self.clock.now())
        self.model[rank].free(rid)

    @rule(data=st.data(), fraction=fractions)
    def output_block(self, data: st.DataObject, fraction: float | None) -> None:
        if not self.where:
            return
        rid = data.draw(st.sampled_from(sorted(self.where)))
        rank = self.where[rid]
        if self.alone:
            self.slot.add_output_block(rid, fraction)
            h = self.slot.requests[rid].output_blocks[-1]
        else:
            h = self.tracker.add_output_block(rid, fraction)
        self.model[rank].output(rid, h, fraction)

    @rule(data=st.data())
    def prefill_complete(self, data: st.DataObject) -> None:
        """Changes no block (the model does nothing)."""
        if not self.where:
            return
        rid = data.draw(st.sampled_from(sorted(self.where)))
        if self.alone:
            self.slot.mark_prefill_completed(rid, self.clock.now())
        else:
            self.tracker.mark_prefill_completed(rid, self.clock.now())

    @invariant()
    def blocks_match_the_model(self) -> None:
        for rank, slot in self.slots.items():
            model = self.model[rank]
            assert slot.block_references() == model.refs
            assert slot.blocks.active_hashes() == set(model.refs)
            assert dict(slot.blocks.fraction) == model.fraction
            assert slot.active_blocks() == model.active_blocks()
            slot.assert_consistent()
        if not self.alone:
            self.tracker.assert_consistent()


BlockCountsMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockCountsMachine = BlockCountsMachine.TestCase


def test_the_model_fails_on_a_wrong_fraction() -> None:
    """The model is not vacuous: a fraction on a block held twice is not what it expects."""
    model = ModelRank()
    model.add("a", [1, 1])
    model.output("a", 7, 0.5)
    assert model.fraction == {7: 0.5}  # 1 is held twice, so only the output block decays
    assert model.active_blocks() == 2  # 1 + 0.5 -> 1.5 rounds to 2


def test_free_reports_the_prompt_from_the_first_hash_that_went() -> None:
    """A repeated hash goes at its last occurrence: ``[7, 7]`` removes ``[7]``; ``[1, 2, 1]``
    removes ``[2, 1]`` (2 goes at index 1, 1 at index 2)."""
    clock = FakeClock()
    slot = ActiveSequences(2, clock.now, expiry_ns=None)
    slot.add_request_with_prefill_tracking("a", [7, 7], None, False, None, clock.now())
    slot.add_request_with_prefill_tracking("b", [1, 2, 1], None, False, None, clock.now())
    slot.add_request_with_prefill_tracking("c", [3, 9], None, False, None, clock.now())
    slot.add_request_with_prefill_tracking("d", [9], None, False, None, clock.now())
    assert [r.hashes for r in seed.free(slot, "a", clock.now()).removes] == [[7]]
    assert [r.hashes for r in seed.free(slot, "b", clock.now()).removes] == [[2, 1]]
    # 9 is still held by d, under another prefix: only 3 went, and the rest follows it
    assert [r.hashes for r in seed.free(slot, "c", clock.now()).removes] == [[3, 9]]
    assert [r.hashes for r in seed.free(slot, "d", clock.now()).removes] == [[9]]
    assert slot.blocks.is_empty() and slot.trie.is_empty()


def replay(steps: list[tuple[str, str, list[int] | float | None]]) -> ActiveSequences:
    """Run ``steps`` (``("add", rid, prompt)``, ``("out", rid, fraction)``, ``("free", rid,
    None)``) on one rank and on the model, comparing fractions and counts after each."""
    clock = FakeClock()
    slot = ActiveSequences(2, clock.now, expiry_ns=None)
    model = ModelRank()
    for op, rid, arg in steps:
        if op == "add":
            assert isinstance(arg, list)
            slot.add_request_with_prefill_tracking(rid, arg, None, False, None, clock.now())
            model.add(rid, arg)
        elif op == "out":
            assert not isinstance(arg, list)
            h = slot.add_output_block(rid, arg)
            assert h is not None
            model.output(rid, h, arg)
        else:
            slot.release(rid, clock.now())
            model.free(rid)
        assert slot.blocks.fraction == model.fraction, (op, rid, arg)
        assert slot.active_blocks() == model.active_blocks(), (op, rid, arg)
        slot.assert_consistent()
    return slot


def test_a_block_alone_again_but_on_a_shared_position_keeps_its_fraction() -> None:
    """2 gets a second hold elsewhere (it keeps 0.5), then the prompt's own position is
    shared by another prompt; when the other hold goes, 2 is held once again but by a shared
    position: the next decay must leave it at 0.5."""
    replay([
        ("add", "a", [1, 2]),
        ("out", "a", 0.5),
        ("add", "b", [5, 2]),  # 2 held twice: a's fraction sticks
        ("add", "c", [1, 2]),  # a's positions are shared now
        ("out", "a", 0.25),
        ("free", "b", None),  # 2 is held once again, by a position a and c share
        ("out", "a", 0.0),
        ("free", "c", None),  # a's positions are a's alone again
        ("out", "a", 1.0),
        ("free", "a", None),
    ])  # fmt: skip


def test_shared_then_alone_then_shared_again_between_two_decays() -> None:
    """Positions shared and unshared between two decays keep the value they had when the
    sharing began; a request freed while another shares its prefix leaves the value behind."""
    slot = replay([
        ("add", "a", [1, 2, 3, 4]),
        ("out", "a", 0.5),
        ("add", "b", [1, 2]),
        ("free", "b", None),
        ("add", "c", [1, 2, 3]),
        ("out", "a", 0.25),  # 1, 2, 3 shared: they keep 0.5
        ("out", "c", 0.75),  # c holds nothing alone but its output block
        ("free", "a", None),  # 1, 2, 3 stay (c), at 0.5
        ("out", "c", 0.0),  # now c's alone: all of them follow c
        ("free", "c", None),
    ])  # fmt: skip
    assert slot.blocks.is_empty()
