"""The limits every entrance enforces, in one place.

A value reaches the service through two doors: an HTTP call (``kv_slot_tracker.http``: the models and the
plain-body structs) and a peer's replica record (``kv_slot_tracker.service.record_check``). Both read their
limits from here, so that a record is refused exactly when the call that would have produced it
is refused, and the two can never drift apart.
"""

from __future__ import annotations

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
