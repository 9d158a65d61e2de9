"""Whole-tracker state as plain data, for bootstrapping an instance from a peer's snapshot.

A snapshot holds what replication carries: the topology (authoritative ranges, plus any slot
created without one), every active request (rank, prompt hashes, LoRA, expected output tokens,
start time) and each rank's prefill load (prefills in insertion order with tokens and modeled
duration, and the anchor's start). Output blocks are local to the instance that saw them and
are left out, as are decay fractions (they only apply to output blocks of a finished prompt).

Prompt hashes are exported unsigned (u64), the format snapshots always had (stored snapshots
and instances of earlier versions keep working); the service's signed form
(``kv_slot_tracker.core.hashing``) converts here both ways.

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

from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from .hashing import signed_hashes, unsigned_hashes
from .sequences import ActiveSequences
from .types import WorkerDpRange, WorkerWithDpRank

SNAPSHOT_FORMAT = 1

InstantMap = Callable[[int], int]


class Exported(Protocol):
    """The tracker's read API that an export uses (``ActiveSequencesMultiWorker`` has it)."""

    block_size: int

    def ranks(self) -> list[tuple[WorkerWithDpRank, ActiveSequences]]: ...
    def worker_for(self, request_id: str) -> WorkerWithDpRank | None: ...
    def lora_of(self, request_id: str) -> str | None: ...
    def worker_ranges(self) -> list[WorkerDpRange]: ...
    def indexed_requests(self) -> list[tuple[str, WorkerWithDpRank]]: ...


class Restored(Protocol):
    """The tracker's write API that a restore uses (``ActiveSequencesMultiWorker`` has it)."""

    block_size: int

    def num_ranks(self) -> int: ...
    def num_requests(self) -> int: ...
    def reconcile_workers(self, ranges: Iterable[WorkerDpRange]) -> Any: ...
    def ensure_rank(self, worker: WorkerWithDpRank) -> None: ...
    def restore_rank(
        self, worker: WorkerWithDpRank, requests: list[Any], prefills: list[Any], anchor_since: int
    ) -> None: ...
    def index_request(
        self, request_id: str, worker: WorkerWithDpRank, lora: str | None
    ) -> None: ...


R = TypeVar("R", bound=Restored)


def export_tracker(tracker: Exported, to_wall: InstantMap) -> dict[str, Any]:
    """The tracker's replicated state as plain data; instants mapped with ``to_wall``."""
    covered: set[str] = set()
    slots = []
    worker_for, lora_of = tracker.worker_for, tracker.lora_of
    for worker, rank in tracker.ranks():
        requests = []
        for rid, prompt, started_at, eot in rank.export_requests():
            indexed = worker_for(rid) == worker
            if indexed:
                covered.add(rid)
            requests.append(
                [
                    rid,
                    unsigned_hashes(prompt),
                    to_wall(started_at),
                    eot,
                    indexed,
                    lora_of(rid) if indexed else None,
                ]
            )
        anchor = rank.prefill.anchored()
        slots.append(
            {
                "worker": [worker.worker_id, worker.dp_rank],
                "requests": requests,
                "prefills": [list(e) for e in rank.prefill.entries()],
                "anchor_since": None if anchor is None else to_wall(anchor.since_ns),
            }
        )
    return {
        "format": SNAPSHOT_FORMAT,
        "block_size": tracker.block_size,
        "ranges": [[r.worker_id, r.dp_start, r.dp_size] for r in tracker.worker_ranges()],
        "slots": slots,
        "index_only": [
            [rid, w.worker_id, w.dp_rank, lora_of(rid)]
            for rid, w in tracker.indexed_requests()
            if rid not in covered
        ],
    }


def restore_tracker(tracker: R, data: dict[str, Any], from_wall: InstantMap) -> R:
    """Fill an empty tracker (no slots, no requests) from ``export_tracker`` data.

    No events are emitted, no expiry runs, no loads are published. Returns the tracker.
    """
    if data.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"unsupported tracker snapshot format {data.get('format')!r}")
    if data["block_size"] != tracker.block_size:
        raise ValueError(
            f"snapshot block size {data['block_size']} != tracker block size {tracker.block_size}"
        )
    if tracker.num_ranks() or tracker.num_requests():
        raise ValueError("restore_tracker needs an empty tracker")

    tracker.reconcile_workers(WorkerDpRange(*r) for r in data["ranges"])
    for w in sorted(WorkerWithDpRank(*s["worker"]) for s in data["slots"]):
        tracker.ensure_rank(w)  # slots that exist without an authoritative range
    for s in data["slots"]:
        since = s["anchor_since"]
        tracker.restore_rank(
            WorkerWithDpRank(*s["worker"]),
            [
                (rid, signed_hashes(prompt), from_wall(started), eot, indexed, lora)
                for rid, prompt, started, eot, indexed, lora in s["requests"]
            ],
            [tuple(p) for p in s["prefills"]],
            from_wall(since) if since is not None else 0,
        )
    for rid, worker_id, dp_rank, lora in data["index_only"]:
        tracker.index_request(rid, WorkerWithDpRank(worker_id, dp_rank), lora)
    return tracker


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
