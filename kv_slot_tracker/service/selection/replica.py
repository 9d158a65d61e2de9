"""The selection state shared between instances: ``SelectionReplica``, held by the selection
service as ``replica`` and bound to the instance's replica (``ReplicaRecords.bind_selection``).

Out: ``SelectionService.commit`` hands every change it applied to ``send``, which passes the
replicated ones to ``publish`` (set by ``ReplicaRecords.bind_selection``): a worker put or removed, a
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

Released ids (``kv_slot_tracker.service.selection.tombstones``): a release, here or a peer's,
leaves a tombstone of the id on every instance; a peer's booking of a released id is dropped
(``released``, asked by ``kv_slot_tracker.service.replica`` for the booking's add record and its
selection record), and a peer's release also frees a booking of the id this instance made
before the release reached it. So two bookings of one id by two instances, then one release,
leave no reservation anywhere: the first add in the stream won on every instance, the release
frees whichever copy is held, and a copy applied after it is refused.

Snapshots: ``export_selection`` / ``restore_selection`` carry the catalog, the partitions with
their approximate caches, the reservations, the pending selections and the released ids
(instants as wall time);
the placed ranks and reservations' requests are in the trackers' part of the snapshot.

The replica works on the service through its public API only (``SharedState``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from kv_slot_tracker.core.events import FREE, ActiveSequenceEvent
from kv_slot_tracker.core.publisher import ReplicaEffects
from kv_slot_tracker.core.selection import ApproximateCache, RouterConfig
from kv_slot_tracker.core.selection.catalog import SCHEDULABLE, WorkerRecord
from kv_slot_tracker.core.selection.pending import PendingSelections
from kv_slot_tracker.core.selection.sessions import SessionAffinity
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.registry import TrackerRegistry
from kv_slot_tracker.service.selection import mutations, wire
from kv_slot_tracker.service.selection.reservations import Reservations
from kv_slot_tracker.service.selection.tombstones import Tombstone
from kv_slot_tracker.service.selection.types import Partition, Reservation

log = logging.getLogger(__name__)

SELECTION_FORMAT = 1

Publish = Callable[[wire.SelectionChange], None]


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

    def apply(self, mutation: mutations.Mutation, now: int) -> None:
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
        self.tombstones = state.reservations.tombstones.entries
        """The ids released lately: while it is empty, ``released`` is False for every id
        (a caller on the lifecycle path tests it first, a call fewer per add)."""
        self.publish: Publish | None = None
        """Where replicated changes go (``None``: this instance shares nothing)."""

    def send(self, mutation: mutations.Mutation) -> None:
        """Publish ``mutation``, just applied here, when it is replicated."""
        publish = self.publish
        if publish is not None and not isinstance(
            mutation, (mutations.CompletePrefill, mutations.AddOutputBlock)
        ):
            publish(wire.mutation_to_wire(mutation))

    def apply_peer(self, record: wire.SelectionChange, instant: int) -> bool:
        """Apply a peer's selection record, decoded and checked (see the module docstring);
        whether it changed anything. Raises ``ValueError`` when the record is inconsistent."""
        state = self._state
        mutation = wire.mutation_from_wire(record)
        if isinstance(mutation, mutations.Book):
            return self._apply_peer_book(mutation, instant)
        if isinstance(mutation, mutations.Release):
            return self._apply_peer_release(mutation.selection_id, instant)
        if isinstance(mutation, mutations.RemoveWorker) and mutation.worker_id not in state.catalog:
            return False
        assert isinstance(
            mutation, (mutations.CacheSelection, mutations.PutWorker, mutations.RemoveWorker)
        )
        state.apply(mutation, instant)
        return True

    def released(self, selection_id: str, key: Key) -> bool:
        """Whether a booking of ``selection_id`` in the partition ``key`` is refused here: its
        reservation was released lately (``kv_slot_tracker.service.selection.tombstones``). A
        peer's booking of it, its request's add and its selection record, is dropped
        (``kv_slot_tracker.service.replica``). O(1); the slot-tracker routes' own partitions
        (no selection worker ever placed in them) are not concerned."""
        state = self._state
        reservations = state.reservations
        # the partition first: a dict lookup, where the tombstones' size is a Python call
        return (
            key in state.partitions
            and len(reservations.tombstones) > 0
            and reservations.released(selection_id, state.clock())
        )

    def _apply_peer_release(self, sid: str, instant: int) -> bool:
        """A peer's release: the reservation goes and the id is remembered as released, on
        every instance. The release's free (a lifecycle record just before it) removed the
        request it found here; a request of the id still held under the reservation here is a
        booking this instance made before that record arrived (a late call), and goes too: a
        free removes whichever booking of the id exists, so every instance ends without it."""
        state = self._state
        res = state.reservations.release(sid, instant, state.clock())
        if res is not None and not res.lingering:
            t = state.registry.find(res.key)
            if t is not None and t.worker_for(sid) == res.worker:
                effects = ReplicaEffects()
                t.apply_replica_event(ActiveSequenceEvent(sid, res.worker, FREE, 0), effects,
                                      decay_now=instant)  # fmt: skip
                t.flush_replica_effects(effects)
                log.info("reservation %s booked here was released on a peer first: freed", sid)
        return res is not None

    def _apply_peer_book(self, b: mutations.Book, instant: int) -> bool:
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
        out = {
            "format": SELECTION_FORMAT,
            "catalog": [
                [wire.spec_to_wire(r.spec), r.lifecycle, list(r.reasons)]
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
                    wire.worker_to_wire(r.worker),
                    r.created_at + wall_offset,
                    r.lingering,
                ]
                for sid, r in state.reservations.items()
            ],
            "pending": [
                [sid, expires + wall_offset, wire.pending_to_wire(entry)]
                for sid, expires, entry in state.pending.entries()
            ],
        }
        released = state.reservations.tombstones.export(wall_offset, now)
        if released:  # absent when none: readers before tombstones see the same form
            out["released"] = released
        return out

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
        catalog, partitions, reservations, pending, released = decoded
        state.replace_catalog(catalog, partitions)
        state.reservations.restore(reservations)
        state.reservations.tombstones.restore(released, state.clock())
        state.pending.restore(pending)


_EMPTY: dict[str, Any] = {"format": SELECTION_FORMAT, "catalog": [], "partitions": [],
                          "reservations": [], "pending": []}  # fmt: skip


def _decoded(router_ttl_ns: int, data: dict[str, Any], shift: int, now: int) -> tuple[Any, ...]:
    if data.get("format") != SELECTION_FORMAT:
        raise ValueError(f"unsupported format {data.get('format')!r}")
    catalog: dict[int, WorkerRecord] = {}
    for spec, lifecycle, reasons in data["catalog"]:
        s = wire.spec_from_wire(spec)
        if lifecycle not in (SCHEDULABLE, "incomplete") or not all(type(x) is str for x in reasons):
            raise ValueError(f"bad catalog record {lifecycle!r}")
        catalog[s.worker_id] = WorkerRecord(s, lifecycle, tuple(reasons))
    partitions: dict[tuple[str, str], Partition] = {}
    for model, group, block_size, worker_ids, rows in data["partitions"]:
        key = (wire.as_str(model, "model_name"), wire.as_str(group, "routing_group"))
        cache = ApproximateCache(router_ttl_ns)
        cache.restore(rows, shift)
        part = Partition(key, wire.as_uint(block_size, "block_size"), cache)
        for wid in worker_ids:
            part.workers[wid] = catalog[wid].spec
        partitions[key] = part
    reservations: dict[str, Reservation] = {}
    for sid, model, group, worker, created, lingering in data["reservations"]:
        if type(lingering) is not bool:
            raise ValueError("bad lingering flag")
        reservations[wire.as_str(sid, "id")] = Reservation(
            (wire.as_str(model, "model_name"), wire.as_str(group, "routing_group")),
            wire.worker_from_wire(worker),
            min(_int(created, "created_at") + shift, now),  # never in this clock's future
            lingering,
        )
    pending = [
        (wire.as_str(sid, "id"), _int(expires, "expires") + shift, wire.pending_from_wire(entry))
        for sid, expires, entry in data["pending"]
    ]
    released: dict[str, Tombstone] = {}
    for sid, model, group, at in data.get("released", ()):  # absent before tombstones
        where = None
        if model is not None or group is not None:
            where = (wire.as_str(model, "model_name"), wire.as_str(group, "routing_group"))
        at = min(_int(at, "released_at") + shift, now)  # never in this clock's future
        released[wire.as_str(sid, "id")] = Tombstone(where, at)
    return catalog, partitions, reservations, pending, released


def _int(v: Any, what: str) -> int:
    if type(v) is not int:
        raise ValueError(f"bad {what} {v!r}")
    return v
