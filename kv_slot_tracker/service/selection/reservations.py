"""Reservations of the selection service (``SelectionService`` inherits these methods): book a
pending selection (replay) or an explicit rank, prefill complete, output blocks, release, and the
lingering-id rule after a worker delete (SELECTION.md §6). Like every mutation of selection
state, a booking or a release changes state only through ``SelectionService.commit``.
"""

from __future__ import annotations

from kv_slot_tracker.core.selection.catalog import WorkerSpec
from kv_slot_tracker.core.selection.errors import (
    InvalidDecayFraction,
    PendingSelectionNotFound,
    PendingWorkerGone,
    PrefillExceedsIsl,
    RankNotFound,
    ReservationConflict,
    ReservationNotFound,
    SchedulableWorkerNotFound,
)
from kv_slot_tracker.core.types import PrefillLoadHint, SequenceRequest, WorkerWithDpRank
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.selection import commands as sc
from kv_slot_tracker.service.selection import mutations as m
from kv_slot_tracker.service.selection.types import Booked, Reservation


class ReservationsMixin:
    # -- reservations ----------------------------------------------------------------------

    def _live(self, sid: str) -> Reservation | None:
        """The reservation of ``sid`` if it still holds its request; a lingering or stale id is
        forgotten on the way (through ``commit``)."""
        res = self.reservations.get(sid)
        if res is None:
            return None
        if not res.lingering:
            t = self.registry.find(res.key)
            if t is not None and t.worker_for(sid) == res.worker:
                return res
            self.stale_dropped += 1
        self.commit(m.Forget(sid))
        return None

    def _check_free(self, sid: str, key: Key) -> None:
        """409 when the id is reserved anywhere (a lingering id included), or when the
        partition's tracker already holds a request of that id (slot-tracker routes)."""
        res = self.reservations.get(sid)
        if res is not None:
            if res.lingering:
                raise ReservationConflict(sid)
            if self._live(sid) is not None:
                raise ReservationConflict(sid)
        t = self.registry.find(key)
        if t is not None and t.has_request(sid):
            raise ReservationConflict(sid)

    def replay(self, cmd: sc.ReplaySelection) -> Booked:
        """Book a pending selection exactly where it pointed (single use)."""
        key, sid = cmd.key, cmd.selection_id
        entry = self.pending.get((*key, sid), self.clock())
        if entry is None:
            raise PendingSelectionNotFound(sid, *key)
        self._partition(key)
        worker = entry.worker
        spec = self._placed_spec(key, worker)
        if spec is None:
            raise PendingWorkerGone(worker.worker_id, worker.dp_rank, *key)
        self._check_free(sid, key)
        self.commit(
            m.Book(
                selection_id=sid,
                model_name=key[0],
                routing_group=key[1],
                worker=worker,
                sequence_hashes=entry.sequence_hashes,
                block_hashes=entry.block_hashes,
                cache_chain=entry.sequence_hashes if entry.from_tokens else None,
                isl_tokens=entry.isl_tokens,
                prefill_tokens=entry.effective_prefill_tokens if entry.track_prefill_tokens else 0,
                expected_output_tokens=entry.expected_output_tokens,
                lora_name=entry.lora_name,
            )
        )
        self.counters.count(key, "replay")
        return Booked(
            selection_id=sid,
            model_name=key[0],
            routing_group=key[1],
            worker=worker,
            endpoint=spec.endpoint or "",
        )

    def _placed_spec(self, key: Key, worker: WorkerWithDpRank) -> WorkerSpec | None:
        """The spec of ``worker``'s worker when that rank is schedulable in ``key``."""
        part = self.partitions.get(key)
        spec = part.workers.get(worker.worker_id) if part is not None else None
        if spec is None or not spec.has_rank(worker.dp_rank):
            return None
        t = self.registry.find(key)
        placed = t.worker_range(worker.worker_id) if t is not None else None
        if (
            placed is None
            or not placed.dp_start <= worker.dp_rank < placed.dp_start + placed.dp_size
        ):
            return None
        return spec

    def book(self, cmd: sc.BookExplicit) -> Booked:
        """An explicit booking of a prompt on a given rank."""
        key, sid = cmd.key, cmd.selection_id
        part = self._partition(key)
        # the reference checks the block hashes (isl > 0, equal lengths) only after the worker
        with_blocks = cmd.token_ids is None and cmd.block_hashes is not None
        prompt = self._prompt(cmd, part.block_size, for_booking=True, block_hashes=False)
        ept = cmd.effective_prefill_tokens
        if ept is not None and ept > prompt.isl_tokens:
            raise PrefillExceedsIsl(ept, prompt.isl_tokens)
        if cmd.worker_id not in part.workers:
            raise SchedulableWorkerNotFound(cmd.worker_id, *key)
        if with_blocks:
            prompt = self._prompt(cmd, part.block_size, for_booking=False)
        self._check_free(sid, key)
        worker = WorkerWithDpRank(cmd.worker_id, cmd.dp_rank)
        spec = self._placed_spec(key, worker)
        if spec is None:
            raise RankNotFound(cmd.worker_id, cmd.dp_rank)
        # the booking's own flag decides, whatever the router's: only an explicit false stops
        # the given prefill tokens from counting (as in the reference)
        track = cmd.track_prefill_tokens is not False
        self.commit(
            m.Book(
                selection_id=sid,
                model_name=key[0],
                routing_group=key[1],
                worker=worker,
                sequence_hashes=prompt.sequence_hashes,
                block_hashes=prompt.block_hashes,
                cache_chain=prompt.sequence_hashes if prompt.from_tokens else None,
                isl_tokens=prompt.isl_tokens,
                prefill_tokens=ept if ept is not None and track else 0,
                expected_output_tokens=cmd.expected_output_tokens,
                lora_name=cmd.lora_name,
            )
        )
        self.counters.count(key, "explicit")
        return Booked(
            selection_id=sid,
            model_name=key[0],
            routing_group=key[1],
            worker=worker,
            endpoint=spec.endpoint or "",
        )

    def prefill_complete(self, cmd: sc.ReservationCall) -> None:
        if self._live(cmd.selection_id) is None:
            raise ReservationNotFound(cmd.selection_id)
        self.commit(m.CompletePrefill(cmd.selection_id))

    def output_block(self, cmd: sc.ReservationOutputBlock) -> None:
        f = cmd.decay_fraction
        if f is not None and not 0.0 <= f <= 1.0:
            raise InvalidDecayFraction()
        if self._live(cmd.selection_id) is None:
            raise ReservationNotFound(cmd.selection_id)
        self.commit(m.AddOutputBlock(cmd.selection_id, f))

    def release(self, cmd: sc.ReservationCall) -> None:
        if self._live(cmd.selection_id) is None:
            raise ReservationNotFound(cmd.selection_id)
        self.commit(m.Release(cmd.selection_id))

    def _apply_book(self, b: m.Book, now: int) -> None:
        key = b.key
        t = self.registry.get(key)
        prefill = b.prefill_tokens
        t.add_request_if_registered(
            SequenceRequest(
                b.selection_id,
                b.worker,
                list(b.sequence_hashes),
                prefill > 0,
                b.expected_output_tokens,
                PrefillLoadHint(prefill) if prefill > 0 else None,
                b.lora_name,
            ),
            now,
        )
        self.registry.counters_of(key).added += 1
        self._hold(b.selection_id, Reservation(key, b.worker, now))
        if b.block_hashes and not self.config.use_kv_events:
            self.partitions[key].cache.record(b.worker, b.block_hashes, now, chain=b.cache_chain)
        if b.consumes_pending:
            self.pending.discard((*key, b.selection_id))

    def _apply_release(self, r: m.Release, now: int) -> None:
        res = self.reservations[r.selection_id]
        if self.registry.get(res.key).free(r.selection_id, now):
            self.registry.counters_of(res.key).freed += 1
        self._forget(r.selection_id)

    def _hold(self, sid: str, res: Reservation) -> None:
        """Record the reservation ``sid`` (replacing an earlier one of that id)."""
        self._forget(sid)
        self.reservations[sid] = res
        self._reservations_of.setdefault(res.worker.worker_id, set()).add(sid)
        self._count(res, 1)

    def _count(self, res: Reservation, delta: int) -> None:
        held = self.held
        k = (res.key, res.lingering)
        n = held.get(k, 0) + delta
        if n:
            held[k] = n
        else:
            del held[k]

    def _forget(self, sid: str) -> None:
        res = self.reservations.pop(sid, None)
        if res is None:
            return
        self._count(res, -1)
        ids = self._reservations_of.get(res.worker.worker_id)
        if ids is not None:
            ids.discard(sid)
            if not ids:
                del self._reservations_of[res.worker.worker_id]
