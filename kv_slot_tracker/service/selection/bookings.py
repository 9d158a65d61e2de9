"""The reservations' lifecycle: a prompt booked on a rank, then the calls that follow it to its
end (SELECTION.md §6).

``Bookings`` is one of ``SelectionService``'s collaborators (as ``WorkerPlacement``,
``Reservations``, ``SelectionReplica``, ``KvEvents`` and ``ReceiptKeeper`` are). A booking is a
request of the partition's tracker whose id is the selection id, so its load is the tracker's
like any other request's; ``Reservations`` (``reservations.py``) is the index of which id holds
which rank's request, and this module is what books and ends them. A reservation is booked by a
``/select_and_reserve`` (``book_prompt``, called by the selection once it has chosen), by an
explicit booking on a given rank (``book``), or in two steps: a ``/select`` with an id keeps its
decision as a pending selection (``cache_selection``), which a replay books exactly there
(``replay``). Then come the reservation's calls (``prefill_complete``, ``output_block``,
``release``), and a slot-tracker call's outcome for a selection's receipt (``request_outcome``).

Each call first checks, raising a domain error with nothing changed, then changes state through
the service's ``commit`` with one record of ``mutations``; ``apply_book``, ``apply_release``,
``apply_prefill_complete`` and ``apply_output_block`` apply such a record, made on this
instance or a peer's (``SelectionService.apply`` hands each kind to its own). The HTTP edge
calls the service, whose methods of the same names hand each call here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kv_slot_tracker.core.commands import Add
from kv_slot_tracker.core.selection import Prompt, RouterConfig
from kv_slot_tracker.core.selection.catalog import WorkerSpec
from kv_slot_tracker.core.selection.errors import (
    InvalidDecayFraction,
    PendingSelectionNotFound,
    PendingWorkerGone,
    PrefillExceedsIsl,
    RankNotFound,
    ReservationNotFound,
    SchedulableWorkerNotFound,
)
from kv_slot_tracker.core.selection.pending import PendingSelection, PendingSelections
from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.registry import TrackerRegistry
from kv_slot_tracker.service.selection import commands, mutations
from kv_slot_tracker.service.selection.receipt_keeper import ReceiptKeeper
from kv_slot_tracker.service.selection.reservations import Reservations
from kv_slot_tracker.service.selection.types import (
    Booked,
    Partition,
    Reservation,
    SelectionCounters,
)


class BookingHost(Protocol):
    """What the bookings need of the selection service: the state a booking reads and changes,
    its collaborators, the partition and prompt checks a booking shares with the selection, and
    ``commit`` for the changes they decide."""

    registry: TrackerRegistry
    config: RouterConfig
    clock: Callable[[], int]
    partitions: dict[Key, Partition]
    pending: PendingSelections
    reservations: Reservations
    counters: SelectionCounters
    receipt_keeper: ReceiptKeeper | None

    def commit(self, mutation: mutations.Mutation) -> None: ...

    def partition(self, key: Key) -> Partition: ...

    def prompt_of(
        self,
        cmd: commands.PromptCommand,
        block_size: int,
        *,
        for_booking: bool,
        block_hashes: bool = True,
    ) -> Prompt: ...


class Bookings:
    """The reservations' bookings and calls (module notes)."""

    def __init__(self, service: BookingHost) -> None:
        self.service = service

    # -- booking ---------------------------------------------------------------------------

    def replay(self, cmd: commands.ReplaySelection) -> Booked:
        """Book a pending selection exactly where it pointed (single use)."""
        service = self.service
        key, sid = cmd.key, cmd.selection_id
        entry = service.pending.get((*key, sid), service.clock())
        if entry is None:
            raise PendingSelectionNotFound(sid, *key)
        service.partition(key)
        worker = entry.worker
        spec = self._placed_spec(key, worker)
        if spec is None:
            raise PendingWorkerGone(worker.worker_id, worker.dp_rank, *key)
        service.reservations.check_free(sid, key, service.clock())
        self.book_prompt(
            sid,
            key,
            worker,
            entry,
            prefill_tokens=entry.effective_prefill_tokens if entry.track_prefill_tokens else 0,
            expected_output_tokens=entry.expected_output_tokens,
            lora_name=entry.lora_name,
        )
        if service.receipt_keeper is not None:
            service.receipt_keeper.booked(sid, key, worker, entry)
        return self._booked(sid, key, worker, spec, "replay")

    def book(self, cmd: commands.BookExplicit) -> Booked:
        """An explicit booking of a prompt on a given rank."""
        service = self.service
        key, sid = cmd.key, cmd.selection_id
        part = service.partition(key)
        # the reference checks the block hashes (isl > 0, equal lengths) only after the worker
        with_blocks = cmd.token_ids is None and cmd.block_hashes is not None
        prompt = service.prompt_of(cmd, part.block_size, for_booking=True, block_hashes=False)
        ept = cmd.effective_prefill_tokens
        if ept is not None and ept > prompt.isl_tokens:
            raise PrefillExceedsIsl(ept, prompt.isl_tokens)
        if cmd.worker_id not in part.workers:
            raise SchedulableWorkerNotFound(cmd.worker_id, *key)
        if with_blocks:
            prompt = service.prompt_of(cmd, part.block_size, for_booking=False)
        service.reservations.check_free(sid, key, service.clock())
        worker = WorkerWithDpRank(cmd.worker_id, cmd.dp_rank)
        spec = self._placed_spec(key, worker)
        if spec is None:
            raise RankNotFound(cmd.worker_id, cmd.dp_rank)
        # the booking's own flag decides, whatever the router's: only an explicit false stops
        # the given prefill tokens from counting (as in the reference)
        track = cmd.track_prefill_tokens is not False
        self.book_prompt(
            sid,
            key,
            worker,
            prompt,
            prefill_tokens=ept if ept is not None and track else 0,
            expected_output_tokens=cmd.expected_output_tokens,
            lora_name=cmd.lora_name,
        )
        if service.receipt_keeper is not None:
            service.receipt_keeper.booked(sid, key, worker, prompt)
        return self._booked(sid, key, worker, spec, "explicit")

    def cache_selection(
        self,
        cmd: commands.Select,
        sid: str,
        worker: WorkerWithDpRank,
        prompt: Prompt,
        effective_prefill_tokens: int,
        track_prefill_tokens: bool,
    ) -> None:
        """A ``/select`` with an id chose ``worker`` for ``prompt``: keep the decision as a
        pending selection (through ``commit``), for a replay to book exactly there."""
        key = cmd.key
        self.service.commit(
            mutations.CacheSelection(
                sid,
                PendingSelection(
                    model_name=key[0],
                    routing_group=key[1],
                    worker=worker,
                    sequence_hashes=prompt.sequence_hashes,
                    block_hashes=prompt.block_hashes,
                    isl_tokens=prompt.isl_tokens,
                    effective_prefill_tokens=effective_prefill_tokens,
                    track_prefill_tokens=track_prefill_tokens,
                    expected_output_tokens=cmd.expected_output_tokens,
                    lora_name=cmd.lora_name,
                    from_tokens=prompt.from_tokens,
                ),
            )
        )

    def book_prompt(
        self,
        sid: str,
        key: Key,
        worker: WorkerWithDpRank,
        prompt: Prompt | PendingSelection,
        *,
        prefill_tokens: int,
        expected_output_tokens: int | None,
        lora_name: str | None,
        cache_chain: tuple[int, ...] | None = None,
        consumes_pending: bool = True,
        session_id: str | None = None,
    ) -> None:
        """Book ``prompt`` on ``worker`` as ``sid`` (through ``commit``), every check passed;
        ``cache_chain``: its approximate-cache keys when known (a token prompt's are its
        sequence hashes); ``session_id``: a select_and_reserve's session, bound on every
        instance."""
        if cache_chain is None and prompt.from_tokens:
            cache_chain = prompt.sequence_hashes
        hashes = prompt.sequence_hashes
        service = self.service
        n = len(hashes) if hashes else 0
        registry, now = service.registry, service.clock()
        if registry.over_request_budgets(n, now):
            registry.admit_request(n, now)
        service.commit(
            mutations.Book(
                selection_id=sid,
                model_name=key[0],
                routing_group=key[1],
                worker=worker,
                sequence_hashes=prompt.sequence_hashes,
                block_hashes=prompt.block_hashes,
                cache_chain=cache_chain,
                isl_tokens=prompt.isl_tokens,
                prefill_tokens=prefill_tokens,
                expected_output_tokens=expected_output_tokens,
                lora_name=lora_name,
                consumes_pending=consumes_pending,
                session_id=session_id,
            )
        )

    def _booked(
        self, sid: str, key: Key, worker: WorkerWithDpRank, spec: WorkerSpec, outcome: str
    ) -> Booked:
        """A booking's answer, counted as ``outcome``."""
        self.service.counters.count(key, outcome)
        return Booked(
            selection_id=sid,
            model_name=key[0],
            routing_group=key[1],
            worker=worker,
            endpoint=spec.endpoint or "",
        )

    def _placed_spec(self, key: Key, worker: WorkerWithDpRank) -> WorkerSpec | None:
        """The spec of ``worker``'s worker when that rank is schedulable in ``key``."""
        part = self.service.partitions.get(key)
        spec = part.workers.get(worker.worker_id) if part is not None else None
        if spec is None or not spec.has_rank(worker.dp_rank):
            return None
        t = self.service.registry.find(key)
        placed = t.worker_range(worker.worker_id) if t is not None else None
        if (
            placed is None
            or not placed.dp_start <= worker.dp_rank < placed.dp_start + placed.dp_size
        ):
            return None
        return spec

    # -- the reservation's calls -----------------------------------------------------------

    def prefill_complete(self, cmd: commands.ReservationCall) -> None:
        """The reservation's prefill is done (its prompt tokens stop counting as prefill
        load); the receipt records the cached tokens the client reported."""
        self._check_live(cmd.selection_id)
        service = self.service
        service.commit(mutations.CompletePrefill(cmd.selection_id))
        if service.receipt_keeper is not None:
            service.receipt_keeper.prefill_done(cmd.selection_id, cmd.cached_tokens)

    def output_block(self, cmd: commands.ReservationOutputBlock) -> None:
        """One more output block of the reservation's request; ``decay_fraction`` (in [0, 1],
        checked before anything changes) is then what each block only it holds counts for."""
        f = cmd.decay_fraction
        if f is not None and not 0.0 <= f <= 1.0:
            raise InvalidDecayFraction()
        self._check_live(cmd.selection_id)
        self.service.commit(mutations.AddOutputBlock(cmd.selection_id, f))

    def release(self, cmd: commands.ReservationCall) -> None:
        """The reservation ends: its request is freed and the id remembered as released; the
        receipt records the cached tokens the client reported."""
        self._check_live(cmd.selection_id)
        service = self.service
        service.commit(mutations.Release(cmd.selection_id))
        if service.receipt_keeper is not None:
            service.receipt_keeper.freed(cmd.selection_id, cmd.cached_tokens)

    def request_outcome(self, key: Key, request_id: str, cached_tokens: int, freed: bool) -> None:
        """A slot-tracker ``/prefill_complete`` or ``/free`` (``freed``) of ``request_id`` in
        ``key`` reported ``cached_tokens``: the receipt of that selection, if this instance
        made it, records them (``ReceiptKeeper.request_outcome``)."""
        keeper = self.service.receipt_keeper
        if keeper is not None:
            keeper.request_outcome(key, request_id, cached_tokens, freed)

    def _check_live(self, sid: str) -> None:
        """404 unless ``sid`` still holds its request (a dead id is dropped on the way)."""
        if self.service.reservations.live(sid) is None:
            raise ReservationNotFound(sid)

    # -- applying the records (``SelectionService.apply``) ---------------------------------
    # Each looks the reservation up itself rather than through a shared helper: one Python
    # call less on every reservation call.

    def apply_book(self, b: mutations.Book, now: int) -> None:
        """A booking at ``now``: its request added on the rank, its id held, its blocks
        written to the approximate cache (KV events off: with them on, the engines report
        what they store) and the pending selection of its id dropped (``consumes_pending``)."""
        service = self.service
        key = b.key
        t = service.registry.get(key)
        t.add_on_rank(
            Add(
                model_name=key[0],
                routing_group=key[1],
                request_id=b.selection_id,
                worker_id=b.worker.worker_id,
                dp_rank=b.worker.dp_rank,
                lora_name=b.lora_name,
                new_isl_tokens=b.prefill_tokens,
                expected_output_tokens=b.expected_output_tokens,
            ),
            list(b.sequence_hashes),
            now,
        )
        service.reservations.hold(b.selection_id, Reservation(key, b.worker, now))
        if b.block_hashes and not service.config.use_kv_events:
            service.partitions[key].cache.record(b.worker, b.block_hashes, now, chain=b.cache_chain)
        if b.consumes_pending:
            service.pending.discard((*key, b.selection_id))

    def apply_release(self, r: mutations.Release, now: int) -> None:
        """A release at ``now``: the request freed, the id remembered as released (a late
        booking of it is refused)."""
        service = self.service
        sid = r.selection_id
        res = service.reservations.get(sid)
        assert res is not None, sid
        service.registry.get(res.key).free(sid, now)
        service.reservations.release(sid, now, now)

    def apply_prefill_complete(self, c: mutations.CompletePrefill, now: int) -> None:
        """The reservation's prefill done at ``now``."""
        service = self.service
        res = service.reservations.get(c.selection_id)
        assert res is not None, c.selection_id
        service.registry.get(res.key).mark_prefill_completed(c.selection_id, now)

    def apply_output_block(self, o: mutations.AddOutputBlock) -> None:
        """One more output block of the reservation's request."""
        service = self.service
        res = service.reservations.get(o.selection_id)
        assert res is not None, o.selection_id
        service.registry.get(res.key).add_output_block(o.selection_id, o.decay_fraction)
