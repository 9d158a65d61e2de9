"""Why a peer's replica record is rejected, and the checks of a snapshot.

Records come from the shared stream, which anyone who reaches Redis can write to: a record is
input like an HTTP body. Before a record reaches a tracker it passes the checks the HTTP edge
and the service apply to the same values: its types, u32/u64 ranges and lengths while it is
decoded (``kv_slot_tracker.service.records``), then the block sizes, rank caps
(``kv_slot_tracker.service.topology_rules``) and the prompt's length. A record that fails is
*rejected* with one of ``REASONS``; the replica counts it, logs it (rate-limited) and goes on
with the records behind it.
"""

from __future__ import annotations

from typing import Any

from kv_slot_tracker.core.bounds import I64_MAX, I64_MIN, U64_MAX, is_u32, is_u64
from kv_slot_tracker.core.errors import TrackerError
from kv_slot_tracker.core.limits import (
    MAX_BLOCK_SIZE,
    MAX_ID_LENGTH,
    MAX_NAME_LENGTH,
)
from kv_slot_tracker.core.snapshot import SNAPSHOT_FORMAT
from kv_slot_tracker.service.early_calls import OPS
from kv_slot_tracker.service.errors import ServiceError
from kv_slot_tracker.service.topology_rules import check_capacity, check_reconcile

# Why a record was rejected (the ``reason`` label of the rejection counter; replication adds
# ``undecodable`` for stream entries that are not records at all):
ENVELOPE = "envelope"  # model_name, routing_group, block_size or the record kind
TOPOLOGY = "topology"  # a topology change of the wrong shape or beyond the limits
EVENT = "event"  # a lifecycle event of the wrong shape or beyond the limits
EARLY = "early"  # a tombstone or pending mark of the wrong shape
SELECTION = "selection"  # a selection change of the wrong shape or beyond the limits
CONFLICT = "conflict"  # well formed, but refused by the state here (e.g. block size)
SNAPSHOT = "snapshot"  # a snapshot read at bootstrap that fails these checks (not restored)
RELEASED = "released"  # a booking (its add or its selection record) of a released reservation id
REASONS = (ENVELOPE, TOPOLOGY, EVENT, EARLY, SELECTION, CONFLICT, SNAPSHOT, RELEASED)


class RejectedRecord(ValueError):
    """A record refused before it reached the state; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _uint(v: Any, high: int) -> bool:
    return type(v) is int and 0 <= v <= high


def _triple(w: Any) -> tuple[int, int, int]:
    if (
        type(w) is not list
        or len(w) != 3
        or not is_u64(w[0])
        or not is_u32(w[1])
        or not is_u32(w[2])
    ):
        raise RejectedRecord(TOPOLOGY, f"worker range {w!r:.120} is not (u64, u32, u32)")
    return w[0], w[1], w[2]


# -- snapshots ---------------------------------------------------------------------------------
# A snapshot is read from the same Redis as the records, so it is input too: every value it
# would put in a tracker passes the rules the HTTP call (or the record) carrying it passes.


def _snap(ok: bool, what: str, value: Any) -> None:
    if not ok:
        raise RejectedRecord(SNAPSHOT, f"snapshot {what} {value!r:.120} is invalid")


def _text(v: Any, limit: int) -> bool:
    return type(v) is str and len(v) <= limit


def _row(v: Any, n: int) -> bool:
    return type(v) is list and len(v) == n


def check_snapshot(trackers: Any, early: Any, max_hashes: int) -> None:
    """A snapshot's trackers and early calls (``kv_slot_tracker.core.snapshot`` and
    ``export_early``), checked before anything is restored: keys, block sizes, the topology
    (``topology_rules``), request ids, prompts (at most ``max_hashes`` 64-bit hashes, as
    ``/add`` allows), LoRA names, output token counts, prefill tokens and durations, instants.
    Raises ``RejectedRecord`` with reason ``SNAPSHOT``."""
    _snap(type(trackers) is list, "trackers", type(trackers).__name__)
    for entry in trackers:
        _snap(type(entry) is dict, "tracker entry", entry)
        key = (entry.get("model_name"), entry.get("routing_group"))
        _snap(_text(key[0], MAX_NAME_LENGTH) and _text(key[1], MAX_NAME_LENGTH), "key", key)
        _check_tracker(key, entry.get("tracker"), max_hashes)
    _snap(early is None or type(early) is list, "early calls", type(early).__name__)
    for row in early or ():
        _snap(
            _row(row, 5)
            and _text(row[0], MAX_NAME_LENGTH)
            and _text(row[1], MAX_NAME_LENGTH)
            and _text(row[2], MAX_ID_LENGTH)
            and row[3] in OPS
            and type(row[4]) is int,
            "early call",
            row,
        )


def _hashes(prompt: list[Any]) -> bool:
    """Unsigned 64-bit hashes (as the tracker keeps them), checked in C."""
    return not prompt or (
        set(map(type, prompt)) == {int} and min(prompt) >= 0 and max(prompt) <= U64_MAX
    )


def _instant(v: Any) -> bool:
    return type(v) is int and I64_MIN <= v <= I64_MAX


def _check_tracker(key: tuple[str, str], data: Any, max_hashes: int) -> None:
    _snap(type(data) is dict and data.get("format") == SNAPSHOT_FORMAT, "tracker of", key)
    block_size = data.get("block_size")
    _snap(_uint(block_size, MAX_BLOCK_SIZE) and block_size > 0, "block_size", block_size)
    ranges, slots, index_only = data.get("ranges"), data.get("slots"), data.get("index_only")
    _snap(type(ranges) is list, "ranges", ranges)
    try:
        check_reconcile(key, block_size, [_triple(r) for r in ranges])
    except (ServiceError, TrackerError, RejectedRecord, ValueError) as err:
        raise RejectedRecord(SNAPSHOT, f"snapshot topology of {key!r:.120}: {err}") from None
    _snap(type(slots) is list, "slots", slots)
    try:
        check_capacity(key, len(slots))
    except ServiceError as err:
        raise RejectedRecord(SNAPSHOT, f"snapshot slots of {key!r:.120}: {err}") from None
    for slot in slots:
        _snap(type(slot) is dict, "slot", slot)
        worker = slot.get("worker")
        _snap(
            _row(worker, 2) and is_u64(worker[0]) and is_u32(worker[1]),
            "worker",
            worker,
        )
        anchor = slot.get("anchor_since")
        _snap(anchor is None or _instant(anchor), "anchor_since", anchor)
        requests, prefills = slot.get("requests"), slot.get("prefills")
        _snap(type(requests) is list and type(prefills) is list, "slot of", worker)
        for req in requests:
            _snap(
                _row(req, 6)
                and _text(req[0], MAX_ID_LENGTH)
                and type(req[1]) is list
                and len(req[1]) <= max_hashes
                and _instant(req[2])
                and (req[3] is None or is_u32(req[3]))
                and type(req[4]) is bool
                and (req[5] is None or _text(req[5], MAX_NAME_LENGTH)),
                "request",
                req,
            )
            _snap(_hashes(req[1]), "prompt of request", req[0])
        for pre in prefills:
            _snap(
                _row(pre, 3)
                and _text(pre[0], MAX_ID_LENGTH)
                and is_u64(pre[1])
                and (pre[2] is None or _uint(pre[2], I64_MAX)),
                "prefill",
                pre,
            )
    _snap(type(index_only) is list, "index_only", index_only)
    for row in index_only:
        _snap(
            _row(row, 4)
            and _text(row[0], MAX_ID_LENGTH)
            and is_u64(row[1])
            and is_u32(row[2])
            and (row[3] is None or _text(row[3], MAX_NAME_LENGTH)),
            "indexed request",
            row,
        )
