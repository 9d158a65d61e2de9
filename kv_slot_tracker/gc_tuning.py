"""Cyclic garbage collector settings for the serving process.

Tracker state (request records, prompts, trie nodes, prefill entries) holds no reference cycles:
reference counting frees it the moment a request ends. The cyclic collector still walks it, and
its cost grows with the heap: every young collection is cheap, but each full collection visits
every tracked object, and with 100,000 active requests a full pass takes tens of milliseconds
in the middle of a call.

``tune_gc`` moves everything alive at start-up (modules, the application, its routes and
schemas) into the permanent generation, which no collection scans again, and collects the young
generation less often, so fewer short-lived request objects survive into older generations.
"""

from __future__ import annotations

import gc

# allocations (net of deallocations) between young collections; CPython's default is 700
GEN0_THRESHOLD = 50000
GEN1_THRESHOLD = 20
GEN2_THRESHOLD = 100


def tune_gc() -> None:
    """Freeze the start-up heap and raise the collection thresholds (call once, before serving)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD)
