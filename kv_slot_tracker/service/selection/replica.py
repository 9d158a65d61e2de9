"""The selection state shared between instances (``SelectionService`` inherits these methods).

Out: ``commit`` hands every replicated change to ``publish`` (set by ``Replica.bind_selection``)
after applying it here: a worker put or removed, a booking, a pending selection, a release.
What is not sent, and why: a booking's request, its prefill completion and its free travel as
the tracker's own lifecycle records (published by the tracker as it changes, so they come
first in the stream); an output block is local to the instance that receives it, as on the
slot-tracker routes; forgetting a lingering or stale id is derived by every instance from state
it already shares.

In: ``apply_peer`` repeats a peer's change at the producer's instant. A peer's booking records
the reservation only when the request it names is active here on that rank: when the same id
was booked on two instances at once, the request's first add in the stream won on every
instance (``kv_slot_tracker.service.replica``), and the booking that names the winner's rank is the one
kept everywhere. Its approximate-cache write is applied in any case, since every booking wrote
the cache of the instance that made it.

Snapshots: ``export_selection`` / ``restore_selection`` carry the catalog, the partitions with
their approximate caches, the reservations and the pending selections (instants as wall time);
the placed ranks and reservations' requests are in the trackers' part of the snapshot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kv_slot_tracker.core.selection import ApproximateCache
from kv_slot_tracker.core.selection.catalog import SCHEDULABLE, WorkerRecord
from kv_slot_tracker.service.selection import mutations as m
from kv_slot_tracker.service.selection import wire as w
from kv_slot_tracker.service.selection.types import Partition, Reservation

if TYPE_CHECKING:
    from kv_slot_tracker.service.selection.service import SelectionService

SELECTION_FORMAT = 1

Publish = Callable[[dict[str, Any]], None]


class SelectionReplicaMixin:
    publish: Publish | None = None
    """Where replicated changes go (``None``: this instance shares nothing)."""

    def _publish(self, mutation: m.Mutation) -> None:
        publish = self.publish
        if publish is not None and not isinstance(
            mutation, (m.CompletePrefill, m.AddOutputBlock, m.Forget)
        ):
            publish(w.mutation_to_wire(mutation))

    def apply_peer(self: SelectionService, wire: Any, instant: int) -> bool:
        """Apply a peer's selection record (see the module docstring); whether it changed
        anything. Raises ``ValueError`` when the record is malformed."""
        mutation = w.mutation_from_wire(wire)
        if isinstance(mutation, m.Book):
            return self._apply_peer_book(mutation, instant)
        if isinstance(mutation, m.Release):
            known = mutation.selection_id in self.reservations
            self._forget(mutation.selection_id)
            return known
        if isinstance(mutation, m.CacheSelection):
            self.pending.put(mutation.selection_id, mutation.entry, instant)
            return True
        if isinstance(mutation, m.PutWorker):
            self._apply_put_worker(mutation.spec)
            return True
        assert isinstance(mutation, m.RemoveWorker)
        if mutation.worker_id not in self.catalog:
            return False
        self._apply_remove_worker(mutation.worker_id)
        return True

    def _apply_peer_book(self: SelectionService, b: m.Book, instant: int) -> bool:
        key, sid = b.key, b.selection_id
        part = self.partitions.get(key)
        if part is not None and b.block_hashes and not self.config.use_kv_events:
            part.cache.record(b.worker, b.block_hashes, instant, chain=b.cache_chain)
        if b.consumes_pending:
            self.pending.discard((*key, sid))
        t = self.registry.find(key)
        if t is None or t.worker_for(sid) != b.worker:
            return False  # its request is not here (cancelled, or another booking won)
        held = self.reservations.get(sid)
        if held is not None and held.key == key and held.worker == b.worker:
            return False
        self._hold(sid, Reservation(key, b.worker, instant))
        return True

    # -- snapshots -------------------------------------------------------------------------

    def export_selection(self: SelectionService, wall_offset: int) -> dict[str, Any]:
        """The selection state; ``wall_offset``: wall-clock time minus this clock's instant."""
        now = self.clock()
        return {
            "format": SELECTION_FORMAT,
            "catalog": [
                [w.spec_to_wire(r.spec), r.lifecycle, list(r.reasons)]
                for r in self.catalog.values()
            ],
            "partitions": [
                [
                    key[0],
                    key[1],
                    part.block_size,
                    list(part.workers),
                    [[*row[:5], row[5] + wall_offset] for row in part.cache.export(now)],
                ]
                for key, part in self.partitions.items()
            ],
            "reservations": [
                [
                    sid,
                    r.key[0],
                    r.key[1],
                    w.worker_to_wire(r.worker),
                    r.created_at + wall_offset,
                    r.lingering,
                ]
                for sid, r in self.reservations.items()
            ],
            "pending": [
                [sid, expires + wall_offset, w.pending_to_wire(entry)]
                for sid, expires, entry in self.pending.entries()
            ],
        }

    def restore_selection(
        self: SelectionService, data: dict[str, Any] | None, wall_offset: int
    ) -> None:
        """Replace the selection state by an ``export_selection`` (``None``: empty), instants
        moved by ``-wall_offset``; run after the trackers were restored. All or nothing:
        ``ValueError`` on malformed data, with the previous state kept."""
        try:
            state = _decoded(self, data or _EMPTY, -wall_offset, self.clock())
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed selection snapshot: {e}") from None
        self.catalog, self.partitions, self.reservations, pending = state
        self._schedulable = sum(r.schedulable for r in self.catalog.values())
        self._reservations_of = {}
        self.held = {}
        for sid, res in self.reservations.items():
            self._count(res, 1)
            if not res.lingering:
                self._reservations_of.setdefault(res.worker.worker_id, set()).add(sid)
        self.pending.restore(pending)


_EMPTY: dict[str, Any] = {"format": SELECTION_FORMAT, "catalog": [], "partitions": [],
                          "reservations": [], "pending": []}  # fmt: skip


def _decoded(
    service: SelectionService, data: dict[str, Any], shift: int, now: int
) -> tuple[Any, ...]:
    if data.get("format") != SELECTION_FORMAT:
        raise ValueError(f"unsupported format {data.get('format')!r}")
    catalog: dict[int, WorkerRecord] = {}
    for spec, lifecycle, reasons in data["catalog"]:
        s = w.spec_from_wire(spec)
        if lifecycle not in (SCHEDULABLE, "incomplete") or not all(type(x) is str for x in reasons):
            raise ValueError(f"bad catalog record {lifecycle!r}")
        catalog[s.worker_id] = WorkerRecord(s, lifecycle, tuple(reasons))
    partitions: dict[tuple[str, str], Partition] = {}
    for model, group, block_size, worker_ids, rows in data["partitions"]:
        key = (w.as_str(model, "model_name"), w.as_str(group, "routing_group"))
        cache = ApproximateCache(service.config.router_ttl_ns)
        cache.restore(rows, shift)
        part = Partition(key, w.as_uint(block_size, "block_size"), cache)
        for wid in worker_ids:
            part.workers[wid] = catalog[wid].spec
        partitions[key] = part
    reservations: dict[str, Reservation] = {}
    for sid, model, group, worker, created, lingering in data["reservations"]:
        if type(lingering) is not bool:
            raise ValueError("bad lingering flag")
        reservations[w.as_str(sid, "id")] = Reservation(
            (w.as_str(model, "model_name"), w.as_str(group, "routing_group")),
            w.worker_from_wire(worker),
            min(_int(created, "created_at") + shift, now),  # never in this clock's future
            lingering,
        )
    pending = [
        (w.as_str(sid, "id"), _int(expires, "expires") + shift, w.pending_from_wire(entry))
        for sid, expires, entry in data["pending"]
    ]
    return catalog, partitions, reservations, pending


def _int(v: Any, what: str) -> int:
    if type(v) is not int:
        raise ValueError(f"bad {what} {v!r}")
    return v
