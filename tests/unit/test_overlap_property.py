"""Stateful property test: random lifecycles keep the overlap index equal to a brute-force oracle.

Random adds (lineage-consistent prompts that share prefixes, raw non-chained hash lists and empty
prompts), frees, prefill completions, output blocks, clock advances with expiry sweeps and topology
changes run against an ``ActiveSequencesMultiWorker``. After every step, potential loads, overlaps
and projections for several queries must equal ``naive_potential_loads`` (SPEC §4.9 prefix rule),
the request index, LoRA counts and rank slots must equal a small model, and the tracker must pass
``assert_consistent``. At the end every request is freed and the tracker must be fully drained.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kv_slot_tracker.core.errors import (
    DuplicateRequest,
    DuplicateWorker,
    InvalidDpSize,
    RequestNotFound,
    WorkerIdNotRegistered,
    WorkerNotFound,
)
from kv_slot_tracker.core.types import (
    NS_PER_S,
    PrefillTokenDeltas,
    WorkerDpRange,
    WorkerWithDpRank,
)
from tests.fakes import FakeClock
from tests.support.recording import (
    RecordingPublisher,
    modeled_hint,
    naive_overlap,
    naive_potential_loads,
    seq_hashes_for_tokens,
    tracking_hint,
)
from tests.support.tracker import (
    SequenceRequest,
    active_request_counts,
    add_request,
    add_request_if_registered,
    assert_completely_drained,
    assert_trie_consistent,
    new_tracker,
    potential_blocks_and_tokens,
    request_ranks,
    slots,
)

BLOCK_SIZE = 2
EXPIRY_NS = 300 * NS_PER_S
CHECK_NS = 30 * NS_PER_S
ALPHABET = (0, 1)  # tiny token alphabet: lineage prompts share prefixes often
LORAS = (None, "adapter-a")

worker_ids = st.integers(1, 4)
ranks = st.builds(WorkerWithDpRank, worker_ids, st.integers(0, 3))
ranges = st.builds(WorkerDpRange, worker_ids, st.integers(0, 2), st.integers(0, 2))
token_lists = st.lists(st.sampled_from(ALPHABET), max_size=2 * BLOCK_SIZE * 3)
raw_prompts = st.lists(st.integers(1, 6), max_size=5)
hints = st.one_of(
    st.none(),
    st.builds(tracking_hint, st.integers(0, 40)),
    st.builds(modeled_hint, st.integers(0, 40), st.sampled_from([0, 1, 4, 10])),
)
fractions = st.sampled_from([None, 0.0, 0.25, 0.5, 1.0])
decay_offsets_ns = st.sampled_from([0, NS_PER_S // 2, 2 * NS_PER_S])


@dataclass
class ModelRequest:
    worker: WorkerWithDpRank
    started_at: int
    lora: str | None


class OverlapMachine(RuleBasedStateMachine):
    """Drives one tracker and a model of its request index and rank slots."""

    @initialize(seed=st.integers(0, 2**32 - 1))
    def setup(self, seed: int) -> None:
        self.rng = random.Random(seed)  # picks the queries checked after each step
        self.clock = FakeClock()
        self.pub = RecordingPublisher()
        initial = {1: (0, 2), 2: (0, 1)}
        self.tracker = new_tracker(
            self.pub, BLOCK_SIZE, initial, False, 0, worker_type="prop", clock=self.clock.now
        )
        self.ranges = {wid: WorkerDpRange(wid, s, n) for wid, (s, n) in initial.items()}
        self.slots = {w for r in self.ranges.values() for w in r.ranks()}
        self.model: dict[str, ModelRequest] = {}
        self.token_pool: list[tuple[list[int], str | None]] = []  # lineage prompts as tokens
        self.used_ids: list[str] = []
        self.next_id = 0

    # -- helpers ------------------------------------------------------------------------------

    def _fresh_id(self) -> str:
        self.next_id += 1
        rid = f"r{self.next_id}"
        self.used_ids.append(rid)
        return rid

    def _some_id(self, data: st.DataObject) -> str:
        """Mostly an active id; sometimes a freed, expired, dropped or unknown one."""
        if request_ranks(self.tracker) and data.draw(st.integers(0, 3)):
            return data.draw(st.sampled_from(sorted(request_ranks(self.tracker))))
        return data.draw(st.sampled_from([*self.used_ids, "ghost"]))

    def _apply_removed(self, removed: list[WorkerWithDpRank]) -> None:
        gone = set(removed)
        self.slots -= gone
        for rid in [rid for rid, m in self.model.items() if m.worker in gone]:
            del self.model[rid]

    def _expect_change(self, change, added: set, removed: set) -> None:
        assert set(change.added) == added
        assert set(change.removed) == removed
        assert sorted(self.pub.registered) == sorted(added)
        assert sorted(self.pub.removed) == sorted(removed)
        self._apply_removed(list(removed))
        self.slots |= added

    def _reconcile_id(self, worker_id: int) -> tuple[set, set]:
        r = self.ranges.get(worker_id)
        target = set(r.ranks()) if r is not None else set()
        current = {w for w in self.slots if w.worker_id == worker_id}
        return target - current, current - target

    # -- lifecycle rules ----------------------------------------------------------------------

    def _add(self, data: st.DataObject, kind: str) -> None:
        lora = data.draw(st.sampled_from(LORAS))
        prompt: list[int] | None
        if kind == "lineage" or (kind == "extend" and not self.token_pool):
            tokens = data.draw(token_lists)
            prompt = seq_hashes_for_tokens(tokens, lora, BLOCK_SIZE)
            self.token_pool.append((tokens, lora))
        elif kind == "extend":
            base, lora = data.draw(st.sampled_from(self.token_pool))
            keep = data.draw(st.integers(0, len(base)))
            tokens = base[:keep] + data.draw(token_lists)
            prompt = seq_hashes_for_tokens(tokens, lora, BLOCK_SIZE)
            self.token_pool.append((tokens, lora))
        elif kind == "raw":
            prompt = data.draw(raw_prompts)
        else:
            prompt = data.draw(st.sampled_from([None, []]))
        if self.slots and data.draw(st.integers(0, 4)):
            worker = data.draw(st.sampled_from(sorted(self.slots)))
        else:
            worker = data.draw(ranks)
        duplicate = bool(request_ranks(self.tracker)) and not data.draw(st.integers(0, 6))
        if duplicate:
            rid = data.draw(st.sampled_from(sorted(request_ranks(self.tracker))))
        else:
            rid = self._fresh_id()
        hint, track = data.draw(hints), data.draw(st.booleans())
        strict = not data.draw(st.integers(0, 3))
        request = SequenceRequest(rid, worker, prompt, track, None, hint, lora)
        decay_now = self.clock.now() + data.draw(decay_offsets_ns)
        self.pub.clear()
        if strict and worker not in self.slots:
            with pytest.raises(WorkerNotFound) as err:
                add_request_if_registered(self.tracker, request, decay_now)
            assert err.value.worker == worker
            assert self.pub.registered == []
            return
        if worker not in self.slots:
            self.slots.add(worker)  # lazy creation, kept even if the add then fails
        if strict:
            add = functools.partial(add_request_if_registered, self.tracker)
        else:
            add = functools.partial(add_request, self.tracker)
        if duplicate:
            owner = request_ranks(self.tracker)[rid]
            with pytest.raises(DuplicateRequest) as err:
                add(request, decay_now)
            assert str(err.value) == (
                f"Request {rid} already exists (assigned to worker {owner.debug()})"
            )
            assert self.pub.single_loads == []
            return
        add(request, decay_now)
        self.model[rid] = ModelRequest(worker, self.clock.now(), lora)
        assert len(self.pub.single_loads) == 1
        assert slots(self.tracker)[worker].requests[rid].prompt_blocks == (prompt or [])

    @rule(data=st.data())
    def add_lineage(self, data) -> None:
        self._add(data, "lineage")

    @rule(data=st.data())
    def add_extending_lineage(self, data) -> None:
        self._add(data, "extend")

    @rule(data=st.data(), kind=st.sampled_from(["extend", "raw", "empty"]))
    def add_other(self, data, kind) -> None:
        self._add(data, kind)

    @rule(data=st.data(), decay_offset=decay_offsets_ns)
    def free(self, data, decay_offset) -> None:
        rid = self._some_id(data)
        self.tracker.free(rid, self.clock.now() + decay_offset)  # never raises
        self.model.pop(rid, None)
        assert rid not in request_ranks(self.tracker)

    @rule(data=st.data(), decay_offset=decay_offsets_ns)
    def mark_prefill_completed(self, data, decay_offset) -> None:
        rid = self._some_id(data)
        decay_now = self.clock.now() + decay_offset
        if rid in request_ranks(self.tracker):
            self.tracker.mark_prefill_completed(rid, decay_now)
            assert rid not in slots(self.tracker)[request_ranks(self.tracker)[rid]].prefill.prefills
        else:
            with pytest.raises(RequestNotFound) as err:
                self.tracker.mark_prefill_completed(rid, decay_now)
            assert str(err.value) == f"Request {rid} not found"

    @rule(data=st.data(), fraction=fractions)
    def add_output_block(self, data, fraction) -> None:
        rid = self._some_id(data)
        if rid in request_ranks(self.tracker):
            h = self.tracker.add_output_block(rid, fraction)
            slot = slots(self.tracker)[request_ranks(self.tracker)[rid]]
            assert slot.requests[rid].output_blocks[-1] == h
        else:
            with pytest.raises(RequestNotFound) as err:
                self.tracker.add_output_block(rid, fraction)
            assert str(err.value) == f"Request {rid} not found"

    @rule(
        seconds=st.sampled_from([0, 1, 10, 29, 30, 31, 100, 150, 299, 300, 301, 331]),
        sweep=st.booleans(),
    )
    def advance_clock(self, seconds, sweep) -> None:
        self.clock.advance(seconds)
        if not sweep:
            return
        expired = self.tracker.force_expire_requests_across_all_workers()
        assert len(expired) == len(set(expired))
        now = self.clock.now()
        for rid in expired:
            assert self.model[rid].started_at < now - EXPIRY_NS
        # every rank checked within the last 30 s, so nothing older than 330 s survives a sweep
        for rid, m in self.model.items():
            if rid not in expired:
                assert m.started_at >= now - EXPIRY_NS - CHECK_NS, rid

    # -- topology -----------------------------------------------------------------------------

    @rule(
        op=st.sampled_from(["register", "upsert", "unregister", "reconcile"]),
        r=ranges,
        new=st.lists(ranges, max_size=3),
    )
    def change_topology(self, op, r, new) -> None:
        self.pub.clear()
        if op == "register":
            self._register_worker(r)
        elif op == "upsert":
            self._upsert_worker(r)
        elif op == "unregister":
            self._unregister_worker(r.worker_id)
        else:
            self._reconcile_workers(new)

    def _register_worker(self, r: WorkerDpRange) -> None:
        if r.dp_size == 0:
            with pytest.raises(InvalidDpSize):
                self.tracker.register_worker(r)
        elif r.worker_id in self.ranges:
            with pytest.raises(DuplicateWorker) as err:
                self.tracker.register_worker(r)
            assert str(err.value) == f"worker {r.worker_id} is already registered"
        else:
            change = self.tracker.register_worker(r)
            self.ranges[r.worker_id] = r
            self._expect_change(change, *self._reconcile_id(r.worker_id))
            return
        assert self.pub.registered == self.pub.removed == []

    def _upsert_worker(self, r: WorkerDpRange) -> None:
        if r.dp_size == 0:
            with pytest.raises(InvalidDpSize):
                self.tracker.upsert_worker(r)
            return
        change = self.tracker.upsert_worker(r)
        if self.ranges.get(r.worker_id) == r:
            assert change.is_empty()
            assert self.pub.registered == self.pub.removed == []
            return
        self.ranges[r.worker_id] = r
        self._expect_change(change, *self._reconcile_id(r.worker_id))

    def _unregister_worker(self, worker_id: int) -> None:
        if worker_id not in self.ranges:
            with pytest.raises(WorkerIdNotRegistered) as err:
                self.tracker.unregister_worker(worker_id)
            assert str(err.value) == f"worker {worker_id} is not registered"
            return
        change = self.tracker.unregister_worker(worker_id)
        del self.ranges[worker_id]
        self._expect_change(change, *self._reconcile_id(worker_id))

    def _reconcile_workers(self, new: list[WorkerDpRange]) -> None:
        seen: set[int] = set()
        error: type[Exception] | None = None
        for r in new:
            if r.dp_size == 0:
                error = InvalidDpSize
                break
            if r.worker_id in seen:
                error = DuplicateWorker
                break
            seen.add(r.worker_id)
        if error is not None:
            with pytest.raises(error):
                self.tracker.reconcile_workers(new)
            assert self.pub.registered == self.pub.removed == []
            return
        change = self.tracker.reconcile_workers(new)
        self.ranges = {r.worker_id: r for r in new}
        target = {w for r in new for w in r.ranks()}
        self._expect_change(change, target - self.slots, self.slots - target)

    # -- checks -------------------------------------------------------------------------------

    def _queries(self) -> list[list[int] | None]:
        rng = self.rng
        queries: list[list[int] | None] = [None, []]
        prompts = [
            st_.prompt_blocks for s in slots(self.tracker).values() for st_ in s.requests.values()
        ]
        for _ in range(2):
            if prompts:
                p = rng.choice(prompts)
                queries.append(p[: rng.randint(0, len(p))])
                q = list(p)
                if q:
                    q[rng.randrange(len(q))] = rng.randint(1, 6)
                queries.append(q + [rng.randint(1, 6) for _ in range(rng.randint(0, 2))])
        if self.token_pool:
            tokens, lora = rng.choice(self.token_pool)
            tokens = tokens[: rng.randint(0, len(tokens))]
            tokens += [rng.choice(ALPHABET) for _ in range(rng.randint(0, 2 * BLOCK_SIZE))]
            queries.append(seq_hashes_for_tokens(tokens, lora, BLOCK_SIZE))
        queries.append([rng.randint(1, 6) for _ in range(rng.randint(1, 5))])
        return queries

    @invariant()
    def loads_match_naive(self) -> None:
        tracker, rng = self.tracker, self.rng
        tracker.assert_consistent()
        assert_trie_consistent(tracker)
        workers = sorted(slots(tracker))
        for query in self._queries():
            decay_now = self.clock.now() + rng.choice([0, NS_PER_S, 7 * NS_PER_S, 40 * NS_PER_S])
            by_worker = {w: rng.randint(0, 50) for w in workers if rng.random() < 0.5}
            deltas = PrefillTokenDeltas.new(rng.randint(0, 50), by_worker)
            exp_blocks, exp_tokens = naive_potential_loads(tracker, query, deltas, decay_now)
            blocks, tokens, requests = potential_blocks_and_tokens(
                tracker, query, deltas, decay_now, include_active_requests=True
            )
            assert blocks == exp_blocks, query
            assert tokens == exp_tokens, query
            assert requests == {w: len(s.requests) for w, s in slots(tracker).items()}

            overlaps = tracker.overlaps(query)
            q_len = len(query) if query else 0
            projections = tracker.project_worker_loads(query, decay_now)
            assert set(projections) == set(workers)
            for worker, slot in slots(tracker).items():
                prompts = [st_.prompt_blocks for st_ in slot.requests.values()]
                overlap = naive_overlap(prompts, query)
                assert overlaps.get(worker, 0) == overlap, (worker, query)
                assert (worker in overlaps) == (overlap > 0)
                proj = projections[worker]
                assert proj.active_decode_blocks == slot.active_blocks()
                assert proj.additional_active_blocks == q_len - overlap
                assert proj.active_prefill_tokens == slot.active_tokens(decay_now)
                assert proj.potential_decode_blocks() == exp_blocks[worker]

    @invariant()
    def index_matches_model(self) -> None:
        tracker, now = self.tracker, self.clock.now()
        assert set(slots(tracker)) == self.slots
        assert tracker.worker_ranges() == [self.ranges[k] for k in sorted(self.ranges)]
        assert tracker.has_registered_workers() == bool(self.ranges)
        actual = dict(request_ranks(tracker))
        for rid in [rid for rid in self.model if rid not in actual]:
            # the only silent removal is expiry (strictly older than 300 s)
            assert self.model.pop(rid).started_at < now - EXPIRY_NS, rid
        assert actual == {rid: m.worker for rid, m in self.model.items()}
        counts = Counter(m.worker for m in self.model.values())
        assert active_request_counts(tracker) == {w: counts.get(w, 0) for w in self.slots}
        loras = Counter(m.lora for m in self.model.values() if m.lora is not None)
        assert tracker.get_active_lora_counts() == dict(loras)

    def teardown(self) -> None:
        tracker = getattr(self, "tracker", None)
        if tracker is None:
            return
        now = self.clock.now()
        for rid in list(request_ranks(tracker)):
            tracker.free(rid, now)
        tracker.assert_consistent()
        assert_completely_drained(tracker, now)
        assert tracker.active_blocks() == {w: 0 for w in self.slots}


OverlapMachine.TestCase.settings = settings(
    max_examples=200,
    deadline=None,
    stateful_step_count=30,
    # each add draws a prompt, a hint and a target rank, so even the smallest run is large
    suppress_health_check=[HealthCheck.large_base_example],
)
TestOverlapMachine = OverlapMachine.TestCase
