"""One worker rank's active requests: blocks, prefill load and expiry (SPEC §2)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from .blocks import BlockTracker, FractionGroup, count_elements
from .errors import TooManyOutputBlocks
from .hashing import random_hash
from .limits import MAX_OUTPUT_BLOCKS_PER_REQUEST
from .overlap import PromptTrie
from .prefill import PrefillLoadTracker
from .types import (
    NS_PER_S,
    PrefillLoadHint,
    SequenceMutationOutcome,
    WorkerWithDpRank,
)

log = logging.getLogger(__name__)

EXPIRY_DURATION_NS = 300 * NS_PER_S
CHECK_EXPIRY_FREQUENCY_NS = 30 * NS_PER_S
_NEVER = 1 << 64  # a time no monotonic clock in nanoseconds reaches

Clock = Callable[[], int]


class RequestState:
    """One active request. ``prompt_blocks`` is the list the overlap index shares: indexing it
    swaps its ints for the equal ones already in the index and keeps a view of its tail, so a
    prompt's hashes are stored once (see ``PromptTrie``)."""

    __slots__ = ("prompt_blocks", "_outputs", "started_at", "expected_output_tokens")

    def __init__(
        self, prompt_blocks: list[int], started_at: int, expected_output_tokens: int | None
    ) -> None:
        self.prompt_blocks = prompt_blocks
        self._outputs: list[int] | None = None  # most requests never get an output block
        self.started_at = started_at
        self.expected_output_tokens = expected_output_tokens

    @property
    def output_blocks(self) -> tuple[int, ...]:
        """The output blocks in creation order (a read-only copy)."""
        return tuple(self._outputs) if self._outputs else ()


class ActiveSequences:
    """Active requests of one ``(worker_id, dp_rank)``.

    ``clock`` returns monotonic integer nanoseconds; it stamps ``started_at`` and drives expiry.
    Every prefill-related method takes an explicit ``decay_now`` instead.

    The rank's prompts are indexed in ``trie`` under ``key``: the tracker's trie of all ranks,
    or a trie of this rank alone. The trie counts how many prompts of the rank hold each node,
    so the block counts hold each position of a node the rank holds once, however many of its
    prompts pass through it (``BlockTracker``): a prompt sharing a prefix already held costs
    block-count work only for its new positions.

    A request's decay (``add_output_block`` with a fraction) gives the fraction to every block
    only it holds (SPEC §2.2), through its ``FractionGroup`` (``BlockTracker``): those blocks
    are its output blocks and the end of its prompt from where its trie nodes are held by
    this prompt alone (``PromptTrie.exclusive_from``). Each call walks the path's nodes and
    touches only the positions whose state changed since the request's previous call.
    """

    max_output_blocks = (
        MAX_OUTPUT_BLOCKS_PER_REQUEST  # per request (``kv_slot_tracker.core.limits``)
    )

    __slots__ = (
        "requests",
        "prefill",
        "blocks",
        "trie",
        "key",
        "clock",
        "expiry_ns",
        "check_interval_ns",
        "last_expiry_check",
        "next_expiry_check",
        "_rng",
        "_groups",
    )

    def __init__(
        self,
        block_size: int,
        clock: Clock,
        *,
        expiry_ns: int | None = EXPIRY_DURATION_NS,
        check_interval_ns: int = CHECK_EXPIRY_FREQUENCY_NS,
        rng: random.Random | None = None,
        trie: PromptTrie | None = None,
        key: WorkerWithDpRank = WorkerWithDpRank(0, 0),
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be greater than 0")
        self.requests: dict[str, RequestState] = {}
        self.prefill = PrefillLoadTracker()
        self.blocks = BlockTracker()
        self.trie = PromptTrie() if trie is None else trie
        self.key = key
        self.clock = clock
        self.expiry_ns = expiry_ns
        self.check_interval_ns = check_interval_ns
        self.last_expiry_check = clock()
        self.next_expiry_check = self._next_check()
        self._rng = rng or random.Random()
        self._groups: dict[str, FractionGroup] = {}  # per request that has decayed

    # -- lifecycle -------------------------------------------------------------------------

    def add_request_with_prefill_tracking(
        self,
        request_id: str,
        token_sequence: list[int] | None,
        expected_output_tokens: int | None,
        track_prefill_tokens: bool,
        prefill_load_hint: PrefillLoadHint | None,
        decay_now: int,
        started_at: int | None = None,
    ) -> SequenceMutationOutcome:
        """Add a request; a duplicate id is logged and ignored. May expire stale requests first.

        ``started_at`` defaults to ``clock()``; replication passes the producer's add time.
        """
        if request_id in self.requests:
            log.error("Request %s is already active. Ignoring duplicate add.", request_id)
            return SequenceMutationOutcome()
        outcome = self.force_expiry()
        tokens = 0
        duration_ns = None
        if track_prefill_tokens and prefill_load_hint is not None:
            tokens = prefill_load_hint.initial_effective_prefill_tokens
            duration_ns = prefill_load_hint.expected_prefill_duration_ns
        self.admit(
            request_id,
            prompt=list(token_sequence) if token_sequence else [],
            expected_output_tokens=expected_output_tokens,
            prefill_tokens=tokens,
            duration_ns=duration_ns,
            decay_now=decay_now,
            started_at=self.clock() if started_at is None else started_at,
        )
        return outcome

    def _next_check(self) -> int:
        """When ``force_expiry`` may next sweep (``next_expiry_check``: its rate check, which
        the tracker's lifecycle hot path reads before calling it)."""
        if self.expiry_ns is None:
            return _NEVER
        return self.last_expiry_check + self.check_interval_ns

    def admit(
        self,
        request_id: str,
        *,
        prompt: list[int],
        expected_output_tokens: int | None,
        prefill_tokens: int,
        duration_ns: int | None,
        decay_now: int,
        started_at: int,
    ) -> None:
        """Add a request that is not active here, without the expiry check (the lifecycle hot
        path; ``add_request_with_prefill_tracking`` wraps it): indexes ``prompt`` (kept: the
        caller gives it up), holds the positions the rank did not hold yet and tracks
        ``prefill_tokens`` when positive."""
        if prompt:
            hold = self.blocks.hold
            for edge in self.trie.add(self.key, prompt):
                hold(edge)
        if prefill_tokens > 0:
            self.prefill.add(request_id, prefill_tokens, duration_ns, decay_now)
        self.requests[request_id] = RequestState(prompt, started_at, expected_output_tokens)

    def release(self, request_id: str, decay_now: int) -> None:
        """Release a request's blocks (implies prefill completion); unknown ids are a no-op."""
        self.prefill.discard(request_id, decay_now)
        state = self.requests.pop(request_id, None)
        if state is None:
            log.warning("Trying to free non-existent request %s", request_id)
            return
        if self._groups and request_id in self._groups:
            self._release_decayed(state, self._groups.pop(request_id))
            return
        if state.prompt_blocks:
            unhold = self.blocks.unhold
            for edge in self.trie.remove(self.key, state.prompt_blocks):
                unhold(edge)  # positions the rank no longer holds
        if state._outputs:
            self._release_outputs(state)

    def _release_decayed(self, state: RequestState, group: FractionGroup) -> None:
        """``release`` of a request that has decayed: the members at positions other prompts
        of the rank still hold keep the group's value; the others go with their holds."""
        prompt = state.prompt_blocks
        if prompt:
            lost = self.trie.remove(self.key, prompt)
            kept = len(prompt) - sum(map(len, lost))
            if kept > group.lo:
                self.blocks.freeze(group, prompt[group.lo : kept])
            unhold = self.blocks.unhold
            for edge in lost:
                unhold(edge)
        if state._outputs:
            self._release_outputs(state)
        self.blocks.disband(group)

    def _release_outputs(self, state: RequestState) -> None:
        release = self.blocks.release_and_try_remove
        for h in state._outputs or ():
            release(h)

    def unindex_all(self) -> None:
        """Take every prompt of the rank out of the trie (the rank is going away)."""
        remove, key = self.trie.remove, self.key
        for st in self.requests.values():
            if st.prompt_blocks:
                remove(key, st.prompt_blocks)

    def mark_prefill_completed(self, request_id: str, decay_now: int) -> None:
        self.prefill.discard(request_id, decay_now)

    def add_output_block(self, request_id: str, decay_fraction: float | None) -> int | None:
        """Append a fresh random output block; returns its hash, or None if the request is unknown.

        (The seeds return None too when the new hash was already present, which their tracker
        then reports as an unknown request; a known request always gets its hash here.)"""
        state = self.requests.get(request_id)
        if state is None:
            log.warning("Trying to add output block to non-existent request %s", request_id)
            return None
        outputs = state._outputs
        if outputs is not None and len(outputs) >= self.max_output_blocks:
            raise TooManyOutputBlocks(request_id, self.max_output_blocks)
        h = random_hash(self._rng)
        self.blocks.touch(h)
        if state._outputs is None:
            state._outputs = [h]
        else:
            state._outputs.append(h)
        if decay_fraction is not None:
            self._decay(request_id, state, decay_fraction)
        return h

    def _decay(self, request_id: str, state: RequestState, fraction: float) -> None:
        """Give ``fraction`` to every block only this request holds (its held-once hashes at
        positions only its prompt holds, and its held-once output blocks), as the seeds'
        ``set_single_ref_blocks_as_fractional`` does by visiting all of them.

        The group's members are the blocks it gave its previous fraction to, minus those that
        got a second hold since (``BlockTracker`` froze them then). Positions that other
        prompts of the rank started to share since are frozen now: the group's value has not
        changed in between, so they keep the value they had when the sharing began. The cost
        is O(trie nodes on the path + positions that started or stopped being exclusive +
        output blocks added since the previous call + watched hashes that dropped to one hold).
        """
        blocks = self.blocks
        prompt = state.prompt_blocks
        group = self._groups.get(request_id)
        if group is None:
            group = self._groups[request_id] = FractionGroup(len(prompt))
        start = self.trie.exclusive_from(self.key, prompt) if prompt else 0
        lo = group.lo
        if start > lo:  # shared since the previous call
            blocks.freeze(group, prompt[lo:start])
        blocks.set_group_value(group, fraction)
        if start < lo:  # only this prompt holds them now (or never joined yet)
            blocks.join(group, prompt[start:lo], start)
        group.lo = start
        outputs = state._outputs or ()
        if group.out < len(outputs):
            blocks.join(group, outputs[group.out :], -1)
            group.out = len(outputs)
        if group.ready:
            self._take_back(group, prompt, start)

    def _take_back(self, group: FractionGroup, prompt: list[int], start: int) -> None:
        """Watched hashes of the request that dropped to one hold: members again if their
        position is the request's alone; the others are watched on, or left to the walk."""
        blocks, watch = self.blocks, group.watch
        ready, group.ready = group.ready, []
        for h in ready:
            if h not in watch:
                continue
            pos = watch[h]
            if blocks.count(h) != 1:
                blocks.watch(group, h, pos)  # held twice again
                continue
            del watch[h]
            if pos is None:  # a member that got a second hold: find where it is
                try:
                    pos = prompt.index(h)
                except ValueError:
                    pos = -1  # an output block
            if pos < 0 or pos >= start:
                blocks.join_one(group, h)
            # else: a position shared with other prompts; joined when it is alone again

    def force_expiry(self) -> SequenceMutationOutcome:
        """Free requests older than the expiry, at most once per check interval."""
        outcome = SequenceMutationOutcome()
        if self.expiry_ns is None:
            return outcome
        now = self.clock()
        if now < self.next_expiry_check:
            return outcome
        self.last_expiry_check = now
        self.next_expiry_check = self._next_check()
        cutoff = now - self.expiry_ns
        expired = [rid for rid, st in self.requests.items() if st.started_at < cutoff]
        for rid in expired:
            log.warning("Expiring stale request: %s", rid)
            outcome.expired_prompts[rid] = self.requests[rid].prompt_blocks
            self.release(rid, now)
        outcome.expired_request_ids = set(expired)
        return outcome

    # -- snapshots -------------------------------------------------------------------------

    def export_requests(self) -> list[tuple[str, list[int], int, int | None]]:
        """``(request_id, prompt_blocks, started_at, expected_output_tokens)`` per request."""
        return [
            (rid, list(st.prompt_blocks), st.started_at, st.expected_output_tokens)
            for rid, st in self.requests.items()
        ]

    def restore_request(
        self, request_id: str, prompt: list[int], started_at: int, eot: int | None
    ) -> None:
        """Put back an exported request (no expiry check, no prefill: see ``prefill.restore``).

        Indexes and holds the prompt as if the request had been added.
        """
        self.admit(
            request_id,
            prompt=prompt,
            expected_output_tokens=eot,
            prefill_tokens=0,
            duration_ns=None,
            decay_now=0,
            started_at=started_at,
        )

    # -- reads -----------------------------------------------------------------------------

    def active_blocks(self) -> int:
        return self.blocks.active_blocks()

    def active_tokens(self, decay_now: int) -> int:
        return self.prefill.active_tokens(decay_now)

    def block_references(self) -> dict[int, int]:
        """Per present hash, how many prompt and output positions of active requests hold it
        (the reference counts of SPEC §2.1; a full walk, for checks and tests)."""
        out: dict[int, int] = {}
        for st in self.requests.values():
            count_elements(out, st.prompt_blocks)
            count_elements(out, st.output_blocks)
        return out

    def assert_consistent(self) -> None:
        self.prefill.assert_consistent()
        expected = self.trie.held_positions(self.key)
        for st in self.requests.values():
            count_elements(expected, st.output_blocks)
        assert expected == self.blocks.refcount, "block counts must equal the held positions"
        assert set(expected) == set(self.block_references()), "present blocks differ"
        self.blocks.assert_consistent()
        assert set(self.prefill.prefills) <= set(self.requests)
