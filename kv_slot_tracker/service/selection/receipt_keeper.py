"""Routing receipts of the selection service: what a decision computed, kept as a receipt, then
followed to its outcome (booked, prefill done, freed, the cached tokens the engine reported,
and with KV events whether the chosen rank still held the predicted blocks).

``ReceiptKeeper`` is one of ``SelectionService``'s collaborators, as ``Reservations``,
``SelectionReplica`` and ``KvEvents`` are: the service decides and changes state, the keeper
records. Receipts stay on the instance that decided (``kv_slot_tracker.core.selection.receipts``
holds the receipt, ``receipt_ring`` beside it the ring that keeps them): nothing here is
replicated, and on another instance a follow-up finds no receipt and does nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from kv_slot_tracker.core.selection import Prompt, RouterConfig
from kv_slot_tracker.core.selection.approx_cache import cache_chain
from kv_slot_tracker.core.selection.pending import PendingSelection
from kv_slot_tracker.core.selection.receipt_ring import ReceiptRing
from kv_slot_tracker.core.selection.receipts import BOOKED, SELECTED, Receipt, pack_columns
from kv_slot_tracker.core.selection.selector import Selection
from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.selection import commands
from kv_slot_tracker.service.selection.types import Candidates, Partition


def decision_receipt(
    at: float,
    cmd: commands.Select,
    part: Partition,
    prompt: Prompt,
    config: RouterConfig,
    now: int,
    c: Candidates,
    chosen: Selection,
    receipt_id: str,
    action: str,
    session: str | None,
    bound: int | None,
    by_session: bool,
    booked: bool = False,
) -> Receipt:
    """The receipt of a decision made at ``at`` (wall clock) and ``now`` (the service's
    clock): references to what it computed, the rest derived when read (the columns and costs
    packed into one bytes object, in C: see ``Receipt``). Positional, in ``Receipt``'s field
    order: this runs on every selection."""
    blocks = prompt.block_hashes
    scored = chosen.scored
    workers, overlap = c.workers, c.overlap
    return Receipt(
        receipt_id,
        receipt_id if booked else cmd.selection_id,
        action,
        at,
        now,
        part.key,
        part.block_size,
        prompt.isl_tokens,
        len(blocks) if blocks is not None else len(prompt.sequence_hashes),
        workers,
        pack_columns((c.prefill, c.decode, c.requests, overlap, chosen.costs)),
        max(overlap),
        c.lower,
        scored if scored is workers else tuple(scored),
        chosen.worker,
        chosen.overlap_blocks,
        chosen.effective_prefill_tokens,
        config,
        cmd.pinned_worker,
        cmd.allowed_worker_ids,
        session,
        bound,
        by_session,
        BOOKED if booked else SELECTED,
        at if booked else None,
        now if booked else None,
    )


class ReceiptKeeper:
    """The receipts of one instance's selections, in ``ring`` (module notes)."""

    def __init__(
        self,
        ring: ReceiptRing,
        config: RouterConfig,
        clock: Callable[[], int],
        wall_clock: Callable[[], float],
    ) -> None:
        self.ring = ring
        self.config = config
        self.clock = clock
        self.wall_clock = wall_clock
        self._seq = 0  # numbers the receipts of selections made without an id
        # KV events on: (chosen rank, the prompt's first block past the predicted prefix) ->
        # the receipt and the predicted prefix's cache keys (``_watch_kv``)
        self._kv_watch: dict[tuple[WorkerWithDpRank, int], tuple[Receipt, tuple[int, ...]]] = {}

    def selected(
        self,
        cmd: commands.Select,
        part: Partition,
        prompt: Prompt,
        config: RouterConfig,
        now: int,
        candidates: Candidates,
        chosen: Selection,
        selection_id: str | None,
        session: str | None,
        bound: int | None,
        by_session: bool,
        chain: tuple[int, ...] | None,
    ) -> None:
        """A ``/select`` or ``/select_and_reserve`` decided: keep its receipt (a reservation's
        is booked at once, and watched for the KV check)."""
        reserve = cmd.reserve
        rid = selection_id
        if rid is None:  # a /select without an id
            self._seq += 1
            rid = f"auto:{self._seq}"
        r = decision_receipt(
            self.wall_clock(), cmd, part, prompt, config, now, candidates, chosen, rid,
            "select_and_reserve" if reserve else "select", session, bound, by_session, reserve,
        )  # fmt: skip
        self.ring.put(r)
        if reserve and chain is not None and self.config.use_kv_events:
            self._watch_kv(r, prompt, chain)

    def booked(
        self, sid: str, key: Key, worker: WorkerWithDpRank, prompt: Prompt | PendingSelection
    ) -> None:
        """A replay or an explicit booking of ``sid``: the receipt of the ``/selection/select``
        that chose ``worker`` for it (same id, same partition) is booked, and then followed
        as a ``select_and_reserve``'s is (prefill, free, the reported cached tokens, the KV
        check). A booking on another rank than the one chosen is not that decision's outcome:
        the receipt stays ``selected``."""
        ring = self.ring
        r = ring.get(sid)
        if r is None or r.selection_id != sid or r.key != key or r.chosen != worker:
            return
        if r.state != SELECTED:
            return
        ring.booked(sid, self.wall_clock(), self.clock())
        blocks = prompt.block_hashes
        if (
            self.config.use_kv_events
            and blocks is not None
            and len(blocks) == r.prompt_blocks
            and prompt.isl_tokens == r.isl_tokens
        ):  # the prompt the decision saw (by its size): watch it as a reservation's
            self._watch_kv(r, prompt, cache_chain(prompt))

    def prefill_done(self, sid: str, cached_tokens: int | None) -> None:
        """The reservation ``sid``'s prefill completed, with the cached tokens reported."""
        ring = self.ring
        r = ring.prefill_done(sid, self.wall_clock(), self.clock())
        if r is not None and cached_tokens is not None:
            ring.report_cached(r, cached_tokens)

    def freed(self, sid: str, cached_tokens: int | None) -> None:
        """The reservation ``sid`` was released, with the cached tokens reported."""
        ring = self.ring
        r = ring.freed(sid, self.wall_clock())
        if r is not None and cached_tokens is not None:
            ring.report_cached(r, cached_tokens)

    def request_outcome(self, key: Key, request_id: str, cached_tokens: int, freed: bool) -> None:
        """A slot-tracker ``/prefill_complete`` or ``/free`` (``freed``) of ``request_id`` in
        ``key`` reported ``cached_tokens``: the receipt of the selection of that id in that
        partition, if this instance made it, records them (the first report counts) and, when
        the selection was booked through this API, the prefill or free time as the
        reservation's calls do."""
        ring = self.ring
        r = ring.get(request_id)
        if r is None or r.selection_id != request_id or r.key != key:
            return
        if freed:
            ring.freed(request_id, self.wall_clock())
        else:
            ring.prefill_done(request_id, self.wall_clock(), self.clock())
        ring.report_cached(r, cached_tokens)

    def _watch_kv(
        self, r: Receipt, prompt: Prompt | PendingSelection, chain: tuple[int, ...] | None
    ) -> None:
        """KV events on: watch for the chosen rank storing the prompt's first block past the
        predicted prefix, to check then that the predicted blocks were still there."""
        if not self.config.use_kv_events or chain is None or prompt.block_hashes is None:
            return
        k = r.chosen_overlap
        if k >= len(prompt.block_hashes):
            return
        watch = self._kv_watch
        watch[r.chosen, prompt.block_hashes[k]] = (r, chain[:k])
        limit = self.ring.max_entries
        while len(watch) > limit:
            del watch[next(iter(watch))]

    def kv_storing(self, part: Partition, rank: WorkerWithDpRank, locals_: list[int]) -> None:
        """A rank is about to store blocks (KV events): a receipt watching one of them (the
        first block of its prompt past the predicted prefix) learns how many of the predicted
        blocks the rank still holds, before this store adds any back."""
        watch = self._kv_watch
        if not watch:
            return
        ring = self.ring
        for h in locals_:
            found = watch.pop((rank, h), None)
            if found is None:
                continue
            r, keys = found
            held = 0
            if keys:
                o = part.index.overlaps(keys).get(rank)
                held = min(o.device, len(keys)) if o is not None else 0
            ring.kv_checked(r, len(keys), held)
