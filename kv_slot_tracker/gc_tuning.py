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

import ctypes
import ctypes.util
import gc
from collections.abc import Callable

# allocations (net of deallocations) between young collections; CPython's default is 700
GEN0_THRESHOLD = 50000
GEN1_THRESHOLD = 20
GEN2_THRESHOLD = 100


def tune_gc() -> None:
    """Freeze the start-up heap and raise the collection thresholds (call once, before serving)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim(0)``).

    A burst that queued in C buffers (libzmq's receive queues hold up to a socket's high-water
    mark of messages while the loop catches up) leaves the heap large and mostly free once it
    drained; glibc keeps those pages mapped unless asked. Returns whether anything could be
    asked (False where the C library has no such call)."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
