"""A batch of KV events applied to the index in slices, so that no batch holds the event loop
long: at most ``SLICE_BLOCKS`` blocks in one synchronous call, the index ending as the whole
batch would leave it (``tests/ingest/test_slices.py`` compares both on random batches)."""

from __future__ import annotations

from collections.abc import Iterator

from kv_slot_tracker.core.selection.kv_blocks import DEVICE

from .port import KvEventSink
from .records import AllCleared, BlocksRemoved, BlocksStored, KvBatch, KvEvent

SLICE_BLOCKS = 1_024
"""Blocks applied to the index in one synchronous call before the loop gets a turn."""


def batch_blocks(batch: KvBatch) -> int:
    """Block hashes the batch's stores and removals carry."""
    return sum(len(e.block_hashes) for e in batch.events if not isinstance(e, AllCleared))


def _split(ev: KvEvent, limit: int) -> list[KvEvent]:
    """``ev`` as events of at most ``limit`` blocks that leave the index as ``ev`` does when
    applied in order, the parts of a store stopping at the first refused (``apply_in_slices``).

    Only removals and device-tier stores are cut: a store of the host or disk tier keeps its
    run of blocks under the parent as a whole (cut, its later blocks can land where the whole
    store leaves them out), and so does a store that repeats a hash (refused whole). Both are
    bounded by ``kv_events_max_batch_blocks``."""
    if isinstance(ev, AllCleared) or len(ev.block_hashes) <= limit:
        return [ev]
    hashes = ev.block_hashes
    if isinstance(ev, BlocksRemoved):
        return [BlocksRemoved(hashes[i : i + limit], ev.tier) for i in range(0, len(hashes), limit)]
    if ev.tier != DEVICE or len(set(hashes)) != len(hashes) or ev.parent_hash in hashes:
        return [ev]
    bs = ev.block_size
    return [
        BlocksStored(hashes[i : i + limit], ev.parent_hash if i == 0 else hashes[i - 1],
                     ev.token_ids[i * bs : (i + limit) * bs], bs, ev.tier, ev.lora_name)
        for i in range(0, len(hashes), limit)
    ]  # fmt: skip


def apply_in_slices(
    sink: KvEventSink, worker_id: int, dp_rank: int, batch: KvBatch, limit: int = SLICE_BLOCKS
) -> Iterator[None]:
    """Apply ``batch`` to ``sink`` in calls of at most ``limit`` blocks each (one call when it
    fits), yielding between two calls: the caller gives the event loop its turn there.

    The index ends as the whole batch would leave it: small events go together in order; a
    large device store is cut into runs, each under the last block of the one before, and once
    a run is refused (its parent unknown on the rank: the whole store would have been) the rest
    of that store is skipped (``tests/ingest/test_slices.py`` compares both on random batches)."""
    if batch_blocks(batch) <= limit:
        sink.apply_kv_batch(worker_id, dp_rank, batch)
        return
    piece: list[KvEvent] = []
    size = 0

    def flush() -> None:
        nonlocal piece, size
        if piece:
            sink.apply_kv_batch(worker_id, dp_rank, KvBatch(batch.seq, batch.dp_rank, tuple(piece)))
        piece, size = [], 0

    for ev in batch.events:
        parts = _split(ev, limit)
        if len(parts) == 1:
            n = 0 if isinstance(ev, AllCleared) else len(ev.block_hashes)
            if piece and size + n > limit:
                flush()
                yield
            piece.append(ev)
            size += n
            continue
        if piece:
            flush()
            yield
        for i, part in enumerate(parts):
            if i:
                yield
            refused = sink.stores_refused
            sink.apply_kv_batch(worker_id, dp_rank, KvBatch(batch.seq, batch.dp_rank, (part,)))
            if sink.stores_refused > refused:
                break
        yield
    flush()
