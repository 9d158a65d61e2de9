"""The limits every entrance enforces, in one place.

A value reaches the service through two doors: an HTTP call (``kv_slot_tracker.http``: the models and the
plain-body structs) and a peer's replica record (``kv_slot_tracker.service.record_check``). Both read their
limits from here, so that a record is refused exactly when the call that would have produced it
is refused, and the two can never drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from .types import U32_MAX

# Most data-parallel ranks one worker may declare (the reference's limit): every rank costs
# memory in its tracker.
MAX_DP_SIZE = 4096

# Most worker ranks one tracker (a selection partition is one) may hold: a registration with a
# huge ``dp_size`` repeated over many workers must not exhaust the process.
MAX_RANKS_PER_TRACKER = 16_384

# Block sizes are u32 and never 0.
MAX_BLOCK_SIZE = U32_MAX

# Longest strings a client may make the service keep (characters), far beyond what a fleet
# uses. They are part of the API (the OpenAPI document states them), hence not settings.
MAX_NAME_LENGTH = 1024  # model names, routing groups, LoRA names
MAX_ID_LENGTH = 1024  # request ids, selection ids
MAX_TEXT_LENGTH = 4096  # what a selection worker declares: endpoints, domains, taints, ...

# Longest modeled prefill a client may declare (``expected_prefill_ms``): about 31 years.
MAX_PREFILL_MS = 1e12

# Most output blocks one request may hold (each ``/output_block`` call adds one): a million
# blocks are tens of millions of generated tokens.
MAX_OUTPUT_BLOCKS_PER_REQUEST = 1 << 20

# Most trackers (model name, routing group) one process holds by default (``max_trackers``): a
# fleet has a few hundred; a client inventing names must meet a limit, not exhaust memory.
DEFAULT_MAX_TRACKERS = 4096


class Usage:
    """What the trackers of one process hold in all, kept as their state changes (each tracker
    counts into the one ``Usage`` of its registry), so that a budget check is O(1): worker
    ranks, indexed active requests and prompt block hashes held by those requests."""

    __slots__ = ("ranks", "requests", "hashes")

    def __init__(self) -> None:
        self.ranks = 0
        self.requests = 0
        self.hashes = 0


# What one item costs in resident memory, in bytes, rounded up from ``bench/budget_bench.py``
# (a rank with its slot, load columns and metrics rows; an active request with its id, index
# entries and state; a prompt hash in its request and the prefix trie; a selection worker's
# catalog record): the default budgets divide a share of the memory budget by these.
BYTES_PER_RANK = 6144
BYTES_PER_REQUEST = 3072
BYTES_PER_HASH = 96
BYTES_PER_SELECTION_WORKER = 6144

# The share of the memory limit the instance lets itself grow to (the rest: the interpreter,
# buffers of connections in flight, a scrape being built, the allocator's slack).
MEMORY_BUDGET_SHARE = 0.85
# The share of the memory budget each count budget may take by default (four budgets: all of
# them full at once fill the memory budget).
COUNT_BUDGET_SHARE = 0.25


@dataclass(frozen=True)
class Budgets:
    """The global budgets of one process (0 in a setting: sized from the memory limit)."""

    memory_bytes: int
    active_requests: int
    ranks: int
    block_hashes: int
    selection_workers: int

    @classmethod
    def sized(
        cls,
        memory_limit: int,
        *,
        memory_bytes: int = 0,
        active_requests: int = 0,
        ranks: int = 0,
        block_hashes: int = 0,
        selection_workers: int = 0,
    ) -> Budgets:
        """The budgets for ``memory_limit`` bytes, each given one (non-zero) taking its place."""
        memory = memory_bytes or int(memory_limit * MEMORY_BUDGET_SHARE)
        share = memory * COUNT_BUDGET_SHARE
        return cls(
            memory_bytes=memory,
            active_requests=active_requests or max(1, int(share // BYTES_PER_REQUEST)),
            ranks=ranks or max(1, int(share // BYTES_PER_RANK)),
            block_hashes=block_hashes or max(1, int(share // BYTES_PER_HASH)),
            selection_workers=selection_workers or max(1, int(share // BYTES_PER_SELECTION_WORKER)),
        )


UNLIMITED = Budgets(1 << 62, 1 << 62, 1 << 62, 1 << 62, 1 << 62)
