"""The selection state shared between instances: ``SelectionReplica``, held by the selection
service as ``replica`` and bound to the instance's replica (``Replica.bind_selection``).

Out: ``SelectionService.commit`` hands every change it applied to ``send``, which passes the
replicated ones to ``publish`` (set by ``Replica.bind_selection``): a worker put or removed, a
booking, a pending selection, a release. What is not sent, and why: a booking's request, its
prefill completion and its free travel as the tracker's own lifecycle records (published by the
tracker as it changes, so they come first in the stream); an output block is local to the
instance that receives it, as on the slot-tracker routes; forgetting a lingering or stale id is
derived by every instance from state it already shares.

In: ``apply_peer`` repeats a peer's change at the producer's instant. A peer's booking records
the reservation only when the request it names is active here on that rank: when the same id
was booked on two instances at once, the request's first add in the stream won on every
instance (``kv_slot_tracker.service.replica``), and the booking that names the winner's rank is the one
kept everywhere. Its approximate-cache write is applied in any case, since every booking wrote
the cache of the instance that made it, and so is its session binding (session affinity on): a
session booked on one instance stays on that worker on every instance.

Snapshots: ``export_selection`` / ``restore_selection`` carry the catalog, the partitions with
their approximate caches, the reservations and the pending selections (instants as wall time);
the placed ranks and reservations' requests are in the trackers' part of the snapshot.

The replica works on the service through its public API only (``SharedState``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kv_slot_tracker.core.selection import ApproximateCache, RouterConfig
from kv_slot_tracker.core.selection.catalog import SCHEDULABLE, WorkerRecord
from kv_slot_tracker.core.selection.pending import PendingSelections
from kv_slot_tracker.core.selection.sessions import SessionAffinity
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.registry import TrackerRegistry
from kv_slot_tracker.service.selection import mutations as m
from kv_slot_tracker.service.selection import wire as w
from kv_slot_tracker.service.selection.reservations import Reservations
from kv_slot_tracker.service.selection.types import Partition, Reservation

SELECTION_FORMAT = 1

Publish = Callable[[dict[str, Any]], None]


class SharedState(Protocol):
    """What the replica needs of the selection service."""

    registry: TrackerRegistry
    config: RouterConfig
    clock: Callable[[], int]
    pending: PendingSelections
    reservations: Reservations
    sessions: SessionAffinity | None

    @property
    def catalog(self) -> dict[int, WorkerRecord]: ...

    @property
    def partitions(self) -> dict[Key, Partition]: ...

    def apply(self, mutation: m.Mutation, now: int) -> None:
        """Apply one change here, publishing nothing."""
        ...

    def replace_catalog(
        self, catalog: dict[int, WorkerRecord], partitions: dict[Key, Partition]
    ) -> None:
        """Replace the catalog and the partitions (a snapshot's)."""
        ...


class SelectionReplica:
    def __init__(self, state: SharedState) -> None:
        self._state = state
        self.publish: Publish | None = None
        """Where replicated changes go (``None``: this instance shares nothing)."""

    def send(self, mutation: m.Mutation) -> None:
        """Publish ``mutation``, just applied here, when it is replicated."""
        publish = self.publish
        if publish is not None and not isinstance(mutation, (m.CompletePrefill, m.AddOutputBlock)):
            publish(w.mutation_to_wire(mutation))

    def apply_peer(self, wire: Any, instant: int) -> bool:
        """Apply a peer's selection record (see the module docstring); whether it changed
        anything. Raises ``ValueError`` when the record is malformed."""
        state = self._state
        mutation = w.mutation_from_wire(wire)
        if isinstance(mutation, m.Book):
            return self._apply_peer_book(mutation, instant)
        if isinstance(mutation, m.Release):
            return state.reservations.forget(mutation.selection_id)
        if isinstance(mutation, m.RemoveWorker) and mutation.worker_id not in state.catalog:
            return False
        assert isinstance(mutation, (m.CacheSelection, m.PutWorker, m.RemoveWorker))
        state.apply(mutation, instant)
        return True

    def _apply_peer_book(self, b: m.Book, instant: int) -> bool:
        state = self._state
        key, sid = b.key, b.selection_id
        part = state.partitions.get(key)
        if part is not None and b.block_hashes and not state.config.use_kv_events:
            part.cache.record(b.worker, b.block_hashes, instant, chain=b.cache_chain)
        if b.consumes_pending:
            state.pending.discard((*key, sid))
        sessions, session = state.sessions, b.session_id
        # bound as on the booking instance, when the worker is a candidate here too
        if (
            session is not None
            and sessions is not None
            and part is not None
            and b.worker.worker_id in part.workers
        ):
            sessions.bind(session, b.worker.worker_id, instant)
        t = state.registry.find(key)
        if t is None or t.worker_for(sid) != b.worker:
            return False  # its request is not here (cancelled, or another booking won)
        held = state.reservations.get(sid)
        if held is not None and held.key == key and held.worker == b.worker:
            return False
        state.reservations.hold(sid, Reservation(key, b.worker, instant))
        return True

    # -- snapshots -------------------------------------------------------------------------

    def export_selection(self, wall_offset: int) -> dict[str, Any]:
        """The selection state; ``wall_offset``: wall-clock time minus this clock's instant."""
        state = self._state
        now = state.clock()
        return {
            "format": SELECTION_FORMAT,
            "catalog": [
                [w.spec_to_wire(r.spec), r.lifecycle, list(r.reasons)]
                for r in state.catalog.values()
            ],
            "partitions": [
                [
                    key[0],
                    key[1],
                    part.block_size,
                    list(part.workers),
                    [[*row[:5], row[5] + wall_offset] for row in part.cache.export(now)],
                ]
                for key, part in state.partitions.items()
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
                for sid, r in state.reservations.items()
            ],
            "pending": [
                [sid, expires + wall_offset, w.pending_to_wire(entry)]
                for sid, expires, entry in state.pending.entries()
            ],
        }

    def restore_selection(self, data: dict[str, Any] | None, wall_offset: int) -> None:
        """Replace the selection state by an ``export_selection`` (``None``: empty), instants
        moved by ``-wall_offset``; run after the trackers were restored. All or nothing:
        ``ValueError`` on malformed data, with the previous state kept."""
        state = self._state
        try:
            decoded = _decoded(
                state.config.router_ttl_ns, data or _EMPTY, -wall_offset, state.clock()
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed selection snapshot: {e}") from None
        catalog, partitions, reservations, pending = decoded
        state.replace_catalog(catalog, partitions)
        state.reservations.restore(reservations)
        state.pending.restore(pending)


_EMPTY: dict[str, Any] = {"format": SELECTION_FORMAT, "catalog": [], "partitions": [],
                          "reservations": [], "pending": []}  # fmt: skip


def _decoded(router_ttl_ns: int, data: dict[str, Any], shift: int, now: int) -> tuple[Any, ...]:
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
        cache = ApproximateCache(router_ttl_ns)
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
