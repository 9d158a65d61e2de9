"""Invariants of a tracker (``ActiveSequencesMultiWorker.assert_consistent``, which the tests
call after every step): every derived structure (active block counts, the overlap trie, the
load columns, the request index, LoRA counts) equals what its source implies.
"""

from __future__ import annotations

from .loads import LoadColumns
from .overlap import PromptTrie
from .request_index import RequestIndex
from .sequences import ActiveSequences
from .topology import WorkerTable
from .types import WorkerWithDpRank


def assert_consistent(
    slots: dict[WorkerWithDpRank, ActiveSequences],
    table: WorkerTable,
    trie: PromptTrie,
    columns: LoadColumns,
    requests: RequestIndex,
) -> None:
    assert set(slots) == table.slots
    fresh = PromptTrie()
    for w, s in slots.items():
        s.assert_consistent()
        for st in s.requests.values():
            if st.prompt_blocks:
                fresh.add(w, st.prompt_blocks)
    assert fresh.expanded() == trie.expanded(), "overlap index out of sync"
    columns.assert_fresh(slots)
    for rid, w in requests.workers.items():
        if w in slots:
            assert rid in slots[w].requests, f"{rid} mapped to {w} but not active there"
    requests.assert_consistent()
