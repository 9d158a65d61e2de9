"""Invariants of a tracker, checked by the tests after every step (the seeds'
``assert_completely_drained`` and a full consistency check): every derived structure (active
block counts, the overlap trie, the request index, LoRA counts) equals what its source implies.
"""

from __future__ import annotations

from typing import Any, Protocol

from .overlap import PromptTrie
from .sequences import ActiveSequences
from .types import WorkerWithDpRank


class Inspected(Protocol):
    """What the checks read of a tracker (``ActiveSequencesMultiWorker`` has it)."""

    @property
    def slots(self) -> dict[WorkerWithDpRank, ActiveSequences]: ...
    @property
    def table(self) -> Any: ...
    @property
    def trie(self) -> PromptTrie: ...
    @property
    def columns(self) -> Any: ...
    @property
    def request_index(self) -> Any: ...
    @property
    def request_worker(self) -> dict[str, WorkerWithDpRank]: ...
    @property
    def lora_counts(self) -> dict[str, int]: ...
    def active_blocks(self) -> dict[WorkerWithDpRank, int]: ...
    def active_tokens(self, decay_now: int) -> dict[WorkerWithDpRank, int]: ...
    def active_request_counts(self) -> dict[WorkerWithDpRank, int]: ...
    def is_membership_empty(self) -> bool: ...


def assert_consistent(t: Inspected) -> None:
    slots = t.slots
    assert set(slots) == t.table.slots
    fresh = PromptTrie()
    for w, s in slots.items():
        s.assert_consistent()
        for st in s.requests.values():
            if st.prompt_blocks:
                fresh.add(w, st.prompt_blocks)
    assert fresh.expanded() == t.trie.expanded(), "overlap index out of sync"
    t.columns.assert_fresh(slots)
    for rid, w in t.request_worker.items():
        if w in slots:
            assert rid in slots[w].requests, f"{rid} mapped to {w} but not active there"
    t.request_index.assert_consistent()


def assert_completely_drained(t: Inspected, decay_now: int) -> None:
    blocks = t.active_blocks()
    assert all(v == 0 for v in blocks.values()), f"expected zero active blocks, got {blocks}"
    tokens = t.active_tokens(decay_now)
    assert all(v == 0 for v in tokens.values()), f"expected zero active tokens, got {tokens}"
    reqs = t.active_request_counts()
    assert all(v == 0 for v in reqs.values()), f"expected zero active requests, got {reqs}"
    assert not t.request_worker, f"expected no request mappings, got {t.request_worker}"
    assert not t.lora_counts, f"expected no LoRA counts, got {t.lora_counts}"
    assert t.is_membership_empty(), "expected the overlap index to be empty after drain"
    for w, s in t.slots.items():
        assert not s.blocks.refcount, f"{w} still references blocks"
