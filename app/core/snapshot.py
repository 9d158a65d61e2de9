"""Whole-tracker state as plain data, for bootstrapping an instance from a peer's snapshot.

A snapshot holds what replication carries: the topology (authoritative ranges, plus any slot
created without one), every active request (rank, prompt hashes, LoRA, expected output tokens,
start time) and each rank's prefill load (prefills in insertion order with tokens and modeled
duration, and the anchor's start). Output blocks are local to the instance that saw them and
are left out, as are decay fractions (they only apply to output blocks of a finished prompt).

Instants are exported as **wall-clock** nanoseconds (``to_wall``) because monotonic clocks of two
processes share no origin; the importer maps them back onto its own clock (``from_wall``).
Everything else restores exactly: a restored tracker answers ``active_blocks``,
``active_tokens(now)``, request counts, overlaps, potential loads and modeled prefill times
identically (at instants mapped through the same wall offset).

The data is msgpack/JSON friendly (lists, ints, strings, None); requests are positional lists
to keep large snapshots compact:

* ``ranges``: ``[[worker_id, dp_start, dp_size], ...]``
* ``slots``: ``[{"worker": [worker_id, dp_rank], "requests": [...], "prefills": [...],
  "anchor_since": wall | None}, ...]``
* a request: ``[request_id, prompt_hashes, started_at_wall, expected_output_tokens, indexed,
  lora_name]`` (``indexed`` is false for a stale copy whose id now maps to another rank)
* a prefill: ``[request_id, tokens, duration_ns | None]``
* ``index_only``: ``[[request_id, worker_id, dp_rank, lora_name], ...]`` ids mapped to a rank
  whose slot does not hold them (rare; kept so the request index restores exactly)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from itertools import chain
from typing import Any

from .prefill import PrefillLoadState
from .sequences import RequestState
from .tracker import ActiveSequencesMultiWorker
from .types import WorkerDpRange, WorkerWithDpRank

SNAPSHOT_FORMAT = 1

InstantMap = Callable[[int], int]


def export_tracker(tracker: ActiveSequencesMultiWorker, to_wall: InstantMap) -> dict[str, Any]:
    """The tracker's replicated state as plain data; instants mapped with ``to_wall``."""
    index = tracker.request_worker
    loras = tracker.request_lora
    covered: set[str] = set()
    slots = []
    for worker in tracker.workers():
        slot = tracker.slots[worker]
        requests = []
        for rid, st in slot.requests.items():
            indexed = index.get(rid) == worker
            if indexed:
                covered.add(rid)
            requests.append(
                [
                    rid,
                    list(st.prompt_blocks),
                    to_wall(st.started_at),
                    st.expected_output_tokens,
                    indexed,
                    loras.get(rid) if indexed else None,
                ]
            )
        prefill = slot.prefill
        slots.append(
            {
                "worker": [worker.worker_id, worker.dp_rank],
                "requests": requests,
                "prefills": [
                    [rid, prefill.prefills[rid].tokens, prefill.prefills[rid].duration_ns]
                    for rid in prefill.order
                ],
                "anchor_since": None
                if prefill.anchor_rid is None
                else to_wall(prefill.anchor_since),
            }
        )
    return {
        "format": SNAPSHOT_FORMAT,
        "block_size": tracker.block_size,
        "ranges": [[r.worker_id, r.dp_start, r.dp_size] for r in tracker.worker_ranges()],
        "slots": slots,
        "index_only": [
            [rid, w.worker_id, w.dp_rank, loras.get(rid)]
            for rid, w in index.items()
            if rid not in covered
        ],
    }


def restore_tracker(
    tracker: ActiveSequencesMultiWorker, data: dict[str, Any], from_wall: InstantMap
) -> ActiveSequencesMultiWorker:
    """Fill an empty tracker (no slots, no requests) from ``export_tracker`` data.

    Operates on the core objects directly: no events are emitted, no expiry runs, no loads are
    published. Returns the tracker.
    """
    if data.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"unsupported tracker snapshot format {data.get('format')!r}")
    if data["block_size"] != tracker.block_size:
        raise ValueError(
            f"snapshot block size {data['block_size']} != tracker block size {tracker.block_size}"
        )
    if tracker.slots or tracker.request_worker:
        raise ValueError("restore_tracker needs an empty tracker")

    tracker.reconcile_workers(WorkerDpRange(*r) for r in data["ranges"])
    extra = [WorkerWithDpRank(*s["worker"]) for s in data["slots"]]
    extra = [w for w in extra if w not in tracker.slots]
    for w in sorted(extra):  # slots that exist without an authoritative range
        tracker._ensure_worker(w)

    trie = tracker.trie
    for s in data["slots"]:
        worker = WorkerWithDpRank(*s["worker"])
        slot = tracker.slots[worker]
        requests = slot.requests
        prompts = []
        for rid, prompt, started_wall, eot, indexed, lora in s["requests"]:
            prompt = list(prompt)
            requests[rid] = RequestState(prompt, from_wall(started_wall), eot)
            if prompt:
                prompts.append(prompt)
                trie.add(worker, prompt)
            if indexed:
                tracker._index(rid, worker, lora)
        # one reference per prompt position, as if every request had been added in turn
        slot.blocks.refcount.update(Counter(chain.from_iterable(prompts)))
        prefill = slot.prefill
        since = s["anchor_since"]
        anchor = from_wall(since) if since is not None else 0
        for rid, tokens, duration_ns in s["prefills"]:
            prefill.insert(rid, PrefillLoadState(tokens, duration_ns), anchor)
        if prefill.anchor_rid is not None:
            prefill.anchor_since = anchor
        tracker.blocks[worker] = slot.active_blocks()
    for rid, worker_id, dp_rank, lora in data["index_only"]:
        tracker._index(rid, WorkerWithDpRank(worker_id, dp_rank), lora)
    return tracker


def import_tracker(
    data: dict[str, Any], from_wall: InstantMap, **tracker_kwargs: Any
) -> ActiveSequencesMultiWorker:
    """A new tracker built with ``tracker_kwargs`` (``clock`` is required) holding ``data``."""
    tracker_kwargs.setdefault("publisher", None)
    tracker = ActiveSequencesMultiWorker(block_size=data["block_size"], **tracker_kwargs)
    return restore_tracker(tracker, data, from_wall)


def wall_mapping(clock_now: int, wall_now: int) -> tuple[InstantMap, InstantMap]:
    """``(to_wall, from_wall)`` for one process, from one simultaneous reading of its clocks.

    ``from_wall`` never returns an instant after ``clock_now``: a peer whose wall clock runs
    ahead cannot place a start or an anchor in this process's future (the same clamp as the
    live replica path).
    """
    offset = wall_now - clock_now

    def to_wall(instant: int) -> int:
        return instant + offset

    def from_wall(wall: int) -> int:
        instant = wall - offset
        return instant if instant < clock_now else clock_now

    return to_wall, from_wall
