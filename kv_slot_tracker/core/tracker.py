"""All ranks of one model: the seeds' ``ActiveSequencesMultiWorker`` (SPEC §4-§6).

A synchronous state machine. Lifecycle calls take an explicit ``decay_now``; the injected
``clock`` stamps request start times and drives expiry. Loads and replica events leave through
a ``SequencePublisher``; the default publisher discards them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, KeysView
from typing import Any

from . import invariants
from .commands import Add
from .errors import (
    DuplicateRequest,
    PrefillTokensOverflow,
    PublishRejected,
    RequestNotFound,
    WorkerNotFound,
)
from .events import FREE, MARK_PREFILL_COMPLETED, ActiveSequenceEvent, AddRequest, Free
from .limits import Usage
from .loads import Columns, LoadColumns, PotentialLoadRow, RankLoadRow, rank_rows
from .overlap import PromptTrie
from .publisher import (
    NoopSequencePublisher,
    ReplicaEffects,
    ReplicaWorkerPolicy,
    SequencePublisher,
)
from .request_index import RequestIndex
from .sequences import CHECK_EXPIRY_FREQUENCY_NS, EXPIRY_DURATION_NS, ActiveSequences, Clock
from .snapshot import export_tracker, restore_tracker
from .topology import TopologyChange, WorkerTable, validate_range
from .types import (
    NS_PER_MS,
    U64_MAX,
    ActiveLoad,
    LifecycleCounts,
    PrefillLoadHint,
    PrefillTokenDeltas,
    SequenceMutationOutcome,
    WorkerDpRange,
    WorkerLoadProjection,
    WorkerWithDpRank,
)

__all__ = [
    "ActiveSequencesMultiWorker",
    "NoopSequencePublisher",
    "ReplicaEffects",
    "ReplicaWorkerPolicy",
    "SequencePublisher",
]

log = logging.getLogger(__name__)


class ActiveSequencesMultiWorker:
    def __init__(
        self,
        publisher: SequencePublisher | None,
        block_size: int,
        dp_range: dict[int, tuple[int, int]] | None = None,
        replica_sync: bool = False,
        router_id: int = 0,
        *,
        worker_type: str,
        clock: Clock,
        expiry_ns: int | None = EXPIRY_DURATION_NS,
        check_interval_ns: int = CHECK_EXPIRY_FREQUENCY_NS,
        replica_worker_policy: ReplicaWorkerPolicy = ReplicaWorkerPolicy.LAZY_REGISTER,
        counts: LifecycleCounts | None = None,
        usage: Usage | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be greater than 0")
        self.publisher = publisher or SequencePublisher()
        kind, base = type(self.publisher), SequencePublisher
        # skip building loads nobody looks at (the default hooks discard them)
        self._loads_wanted = (
            kind.publish_load is not base.publish_load
            or kind.publish_load_batch is not base.publish_load_batch
            or kind.observe_load is not base.observe_load
        )
        self.block_size = block_size
        self.replica_sync = replica_sync
        self.router_id = router_id
        self._worker_type = worker_type
        self.clock = clock
        self.expiry_ns = expiry_ns
        self.check_interval_ns = check_interval_ns
        self.replica_worker_policy = replica_worker_policy
        # every add, free and swept expiry is counted here (``counts``: the owner's, kept
        # across a replacement of this tracker)
        self.counts = LifecycleCounts() if counts is None else counts

        self._table = WorkerTable()
        self._sorted_workers: list[WorkerWithDpRank] | None = None
        self._slots: dict[WorkerWithDpRank, ActiveSequences] = {}
        # (worker_id, dp_rank) -> the rank's one WorkerWithDpRank, which every request shares
        self._rank_keys: dict[tuple[int, int], WorkerWithDpRank] = {}
        # read model: every rank's load, for queries; any change to a rank marks it in
        # ``_columns.changed`` (its block count is read from its sequences, kept in O(1))
        self._columns = LoadColumns([])
        # what this tracker holds is counted into ``usage`` too (its owner's, across trackers)
        self.usage = Usage() if usage is None else usage
        self._trie = PromptTrie(self.usage)
        self._requests = RequestIndex(self.usage)

        ranges = [WorkerDpRange(wid, s, n) for wid, (s, n) in sorted((dp_range or {}).items())]
        for r in ranges:
            validate_range(r)
        self._apply_topology(self._table.reconcile(ranges))

    # -- topology --------------------------------------------------------------------------

    def register_worker(self, r: WorkerDpRange) -> TopologyChange:
        return self._apply_topology(self._table.register(r))

    def upsert_worker(self, r: WorkerDpRange) -> TopologyChange:
        return self._apply_topology(self._table.upsert(r))

    def unregister_worker(self, worker_id: int) -> TopologyChange:
        return self._apply_topology(self._table.unregister(worker_id))

    def reconcile_workers(self, ranges: Iterable[WorkerDpRange]) -> TopologyChange:
        return self._apply_topology(self._table.reconcile(ranges))

    def worker_ranges(self) -> list[WorkerDpRange]:
        return self._table.worker_ranges()

    def has_registered_workers(self) -> bool:
        return self._table.has_registered_workers()

    def num_ranks(self) -> int:
        """Tracked ranks (registered or created lazily), not workers."""
        return len(self._slots)

    def workers(self) -> list[WorkerWithDpRank]:
        """Every tracked rank (registered or lazily created), sorted."""
        if self._sorted_workers is None:
            self._sorted_workers = sorted(self._slots)
        return self._sorted_workers

    def has_worker(self, worker_id: int) -> bool:
        """Whether the worker id has an authoritative (registered) range."""
        return worker_id in self._table.ranges

    def registered_worker_ids(self) -> KeysView[int]:
        """The ids of the registered workers (a live view, to read at once)."""
        return self._table.ranges.keys()

    def worker_range(self, worker_id: int) -> WorkerDpRange | None:
        return self._table.ranges.get(worker_id)

    def ensure_rank(self, worker: WorkerWithDpRank) -> None:
        """Create a rank slot without an authoritative range (LazyRegister), if missing."""
        self._ensure_worker(worker)

    def _apply_topology(self, change: TopologyChange) -> TopologyChange:
        wt = self._worker_type
        if not change.is_empty():
            self._sorted_workers = None
        if change.removed:
            removed = set(change.removed)
            self._requests.remove_on(removed)
            for w in change.removed:
                self.publisher.observe_worker_removed(w, wt)
                self._slots.pop(w).unindex_all()
                del self._rank_keys[w]
                self.usage.ranks -= 1
        for w in change.added:
            self.publisher.observe_worker_registered(w, wt)
            self._slots[w] = ActiveSequences(
                self.block_size,
                self.clock,
                expiry_ns=self.expiry_ns,
                check_interval_ns=self.check_interval_ns,
                trie=self._trie,
                key=w,
            )
            self._rank_keys[w] = w
            self.usage.ranks += 1
        if not change.is_empty():
            self._columns = LoadColumns(self.workers())
        return change

    def _ensure_worker(self, worker: WorkerWithDpRank) -> None:
        self._apply_topology(self._table.ensure(worker))

    # -- request index ---------------------------------------------------------------------

    def worker_for(self, request_id: str) -> WorkerWithDpRank | None:
        return self._requests.worker(request_id)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def num_requests(self) -> int:
        """Indexed (active) request ids across all ranks."""
        return len(self._requests)

    def held_hashes(self) -> int:
        """Prompt block hashes of the active requests (each prompt's, per request): a walk
        over them, for a recount (the lifecycle counts them into ``usage`` as they change)."""
        return sum(
            len(state.prompt_blocks)
            for slot in self._slots.values()
            for state in slot.requests.values()
        )

    def count_into(self, usage: Usage) -> None:
        """Count from now on into ``usage``, adding what this tracker holds now."""
        self.usage = self._trie.usage = self._requests.usage = usage
        usage.ranks += len(self._slots)
        usage.requests += len(self._requests)
        usage.hashes += self.held_hashes()

    def lora_of(self, request_id: str) -> str | None:
        return self._requests.lora(request_id)

    def started_at(self, request_id: str) -> int | None:
        """When an indexed request started (the producer's add time for a replicated one)."""
        worker = self._requests.worker(request_id)
        slot = self._slots.get(worker) if worker is not None else None
        state = slot.requests.get(request_id) if slot is not None else None
        return state.started_at if state is not None else None

    def indexed_requests(self) -> list[tuple[str, WorkerWithDpRank]]:
        """Every indexed request id with its rank."""
        return list(self._requests.workers.items())

    def index_request(self, request_id: str, worker: WorkerWithDpRank, lora: str | None) -> None:
        """Map an id to a rank without adding it there (snapshots restore such stale ids)."""
        self._requests.set(request_id, worker, lora)

    # -- snapshots -------------------------------------------------------------------------

    def ranks(self) -> list[tuple[WorkerWithDpRank, ActiveSequences]]:
        """Every rank with its sequences, sorted (for exports; callers only read them)."""
        return [(w, self._slots[w]) for w in self.workers()]

    def export(self, to_wall: Callable[[int], int]) -> dict[str, Any]:
        """The replicated state as plain data (``kv_slot_tracker.core.snapshot``)."""
        return export_tracker(self, to_wall)

    def restore(self, data: dict[str, Any], from_wall: Callable[[int], int]) -> None:
        """Fill this empty tracker from ``export`` data."""
        restore_tracker(self, data, from_wall)

    def restore_rank(
        self,
        worker: WorkerWithDpRank,
        requests: list[tuple[str, list[int], int, int | None, bool, str | None]],
        prefills: list[tuple[str, int, int | None]],
        anchor_since: int,
    ) -> None:
        """Put back one rank's exported requests and prefills (``kv_slot_tracker.core.snapshot``)."""
        slot = self._slots[worker]
        for rid, prompt, started_at, eot, indexed, lora in requests:
            slot.restore_request(rid, prompt, started_at, eot)
            if indexed:
                self._requests.set(rid, worker, lora)
        slot.prefill.restore(prefills, anchor_since)
        self._columns.changed.add(worker)

    # -- lifecycle -------------------------------------------------------------------------

    def add_on_rank(self, add: Add, prompt: list[int] | None, decay_now: int) -> None:
        """Add ``add``'s request on its rank, which must exist (else WorkerNotFound): the
        seeds' ``add_request`` on a registered rank. ``add`` is the command as the edge decoded
        it (or the selection service built it), read here and never kept; ``prompt`` is its
        prompt as block hashes (the service hashes token ids and enforces its limits).

        Prefill tokens (``new_isl_tokens``) are tracked when ``track_prefill_tokens`` says so,
        or, when it is None, when there are any; the prefill load hint, which replicates, is
        the tokens with ``expected_prefill_ms`` in nanoseconds, none when there are none."""
        worker = self._rank_keys.get((add.worker_id, add.dp_rank))
        if worker is None:
            raise WorkerNotFound(WorkerWithDpRank(add.worker_id, add.dp_rank))
        slot = self._slots[worker]
        tokens = add.new_isl_tokens
        track = add.track_prefill_tokens
        if track is None:
            track = tokens > 0
        if track and tokens > 0 and slot.prefill.full_sum + tokens > U64_MAX:
            raise PrefillTokensOverflow(worker)
        request_id = add.request_id
        requests = self._requests
        existing = requests.workers.get(request_id)
        if existing is not None:
            raise DuplicateRequest(request_id, existing)
        requests.add(request_id, worker, add.lora_name)
        ms = add.expected_prefill_ms
        duration_ns = round(ms * NS_PER_MS) if tokens > 0 and ms is not None else None
        if request_id in slot.requests:  # the slot logs and ignores it (``_add_to_slot``)
            slot.add_request_with_prefill_tracking(
                request_id,
                prompt,
                expected_output_tokens=add.expected_output_tokens,
                track_prefill_tokens=False,
                prefill_load_hint=None,
                decay_now=decay_now,
            )
        else:  # ``_add_to_slot`` written out: the call cost 0.5 % of a batch operation
            now = self.clock()
            if now >= slot.next_expiry_check:
                self._after_expiry(worker, slot.force_expiry())
            slot.admit(
                request_id,
                prompt=list(prompt) if prompt else [],
                expected_output_tokens=add.expected_output_tokens,
                prefill_tokens=tokens if track else 0,
                duration_ns=duration_ns,
                decay_now=decay_now,
                started_at=now,
            )
            self._columns.changed.add(worker)
        if self._loads_wanted:
            self.publisher.publish_load(self._load_of(worker, slot, decay_now))
        if self.replica_sync:
            self._enqueue(
                ActiveSequenceEvent(
                    request_id,
                    worker,
                    AddRequest(
                        list(prompt) if prompt is not None else None,
                        track,
                        add.expected_output_tokens,
                        PrefillLoadHint(tokens, duration_ns) if tokens > 0 else None,
                    ),
                    self.router_id,
                    add.lora_name,
                )
            )
        self.counts.added += 1

    def _add_to_slot(
        self,
        slot: ActiveSequences,
        worker: WorkerWithDpRank,
        rid: str,
        *,
        prompt: list[int] | None,
        expected_output_tokens: int | None,
        track: bool,
        hint: PrefillLoadHint | None,
        decay_now: int,
        started_at: int | None,
    ) -> None:
        """What ``add_request_with_prefill_tracking`` does (a replica's add), with
        ``force_expiry``'s rate check read before its call; ``add_on_rank`` writes it out."""
        self._columns.changed.add(worker)
        if rid in slot.requests:  # the slot logs and ignores it
            slot.add_request_with_prefill_tracking(
                rid,
                prompt,
                expected_output_tokens=expected_output_tokens,
                track_prefill_tokens=False,
                prefill_load_hint=None,
                decay_now=decay_now,
            )
            return
        tokens, duration_ns = 0, None
        if track and hint is not None:
            tokens = hint.initial_effective_prefill_tokens
            duration_ns = hint.expected_prefill_duration_ns
        now = self.clock()
        if now >= slot.next_expiry_check:
            self._after_expiry(worker, slot.force_expiry())
        slot.admit(
            rid,
            prompt=list(prompt) if prompt else [],
            expected_output_tokens=expected_output_tokens,
            prefill_tokens=tokens,
            duration_ns=duration_ns,
            decay_now=decay_now,
            started_at=now if started_at is None else started_at,
        )

    def _after_expiry(self, worker: WorkerWithDpRank, outcome: SequenceMutationOutcome) -> None:
        for rid in outcome.expired_prompts:
            if self._requests.worker(rid) == worker:
                self._requests.remove(rid)

    def free(self, request_id: str, decay_now: int) -> bool:
        """Free a request; unknown or already freed ids are a silent no-op (False)."""
        requests = self._requests
        lora = requests.loras.get(request_id) if self.replica_sync else None
        worker = requests.remove(request_id)
        if worker is None:
            return False
        self.counts.freed += 1
        slot = self._slots.get(worker)
        if slot is None:
            return True
        slot.release(request_id, decay_now)
        self._columns.changed.add(worker)
        if self._loads_wanted:
            self.publisher.publish_load(self._load_of(worker, slot, decay_now))
        if self.replica_sync:
            self._enqueue(ActiveSequenceEvent(request_id, worker, FREE, self.router_id, lora))
        return True

    def _resolve(self, request_id: str) -> tuple[WorkerWithDpRank, ActiveSequences]:
        worker = self._requests.worker(request_id)
        if worker is None:
            raise RequestNotFound(request_id)
        slot = self._slots.get(worker)
        if slot is None:
            self._requests.remove(request_id)
            raise RequestNotFound(request_id)
        return worker, slot

    def mark_prefill_completed(self, request_id: str, decay_now: int) -> None:
        worker, slot = self._resolve(request_id)
        lora = self._requests.lora(request_id)
        slot.mark_prefill_completed(request_id, decay_now)
        self._columns.changed.add(worker)
        self._publish_worker_load(worker, slot, decay_now)
        if self.replica_sync:
            self._enqueue(
                ActiveSequenceEvent(
                    request_id, worker, MARK_PREFILL_COMPLETED, self.router_id, lora
                )
            )

    def add_output_block(self, request_id: str, decay_fraction: float | None = None) -> int:
        """Add a (local, never replicated) output block; returns its hash."""
        worker, slot = self._resolve(request_id)
        h = slot.add_output_block(request_id, decay_fraction)
        if h is None:
            raise RequestNotFound(request_id)
        self._columns.changed.add(worker)
        self._publish_worker_load(worker, slot, self.clock())
        return h

    def force_expire_requests_across_all_workers(self) -> list[str]:
        """Run every rank's (rate-limited) expiry check; returns the expired request ids."""
        now = self.clock()
        expired: list[str] = []
        for worker, slot in list(self._slots.items()):
            outcome = slot.force_expiry()
            if not outcome.expired_request_ids:
                continue
            self._after_expiry(worker, outcome)
            self._columns.changed.add(worker)
            self._publish_worker_load(worker, slot, now)
            expired.extend(outcome.expired_request_ids)
        self.counts.expired += len(expired)
        return expired

    # -- replica apply ---------------------------------------------------------------------
    # A peer's lifecycle event applied without publishing anything, and the effects of a batch
    # of them (their loads) flushed once per batch. It follows its own rules: the
    # producer's instants, and the replica worker policy for ranks this instance does not have.

    def apply_replica_event(
        self,
        event: ActiveSequenceEvent,
        effects: ReplicaEffects,
        decay_now: int | None = None,
        started_at: int | None = None,
    ) -> bool:
        """Apply a peer's event; returns whether it changed anything.

        ``decay_now`` defaults to the receive time (``clock()``); a transport that knows when the
        producer applied the event may pass that instant instead (and ``started_at`` for adds).
        """
        if event.router_id == self.router_id:
            return False
        if decay_now is None:
            decay_now = self.clock()
        data = event.data
        rid = event.request_id
        worker: WorkerWithDpRank | None
        if isinstance(data, AddRequest):
            worker = event.worker
            slot = self._slots.get(worker)
            if slot is None:
                if self.replica_worker_policy is ReplicaWorkerPolicy.REQUIRE_REGISTERED:
                    log.debug("Dropping replica AddRequest for unregistered worker %s", worker)
                    return False
                self._ensure_worker(worker)
                slot = self._slots[worker]
            self._requests.set(rid, worker, event.lora_name)
            self._add_to_slot(
                slot,
                worker,
                rid,
                prompt=data.token_sequence,
                expected_output_tokens=data.expected_output_tokens,
                track=data.track_prefill_tokens,
                hint=data.prefill_load_hint,
                decay_now=decay_now,
                started_at=started_at,
            )
            effects.record(worker, True)
            self.counts.added += 1
            return True
        if isinstance(data, Free):
            worker = self._requests.remove(rid)
            if worker is None:
                return False
            self.counts.freed += 1
            slot = self._slots.get(worker)
            if slot is None:
                return True
            slot.release(rid, decay_now)
            self._columns.changed.add(worker)
            effects.record(worker, True)
            return True
        worker = self._requests.worker(rid)
        if worker is None:
            return False
        slot = self._slots.get(worker)
        if slot is None:
            return False
        slot.mark_prefill_completed(rid, decay_now)
        self._columns.changed.add(worker)
        effects.record(worker, False)
        return True

    def flush_replica_effects(self, effects: ReplicaEffects) -> None:
        """Publish one load batch for a replica batch."""
        now = self.clock()
        loads = [
            self._load_of(w, self._slots[w], now)
            for w, publish in effects.workers.items()
            if publish and w in self._slots and self._loads_wanted
        ]
        effects.workers.clear()
        if loads:
            self.publisher.publish_load_batch(loads)

    # -- publication -----------------------------------------------------------------------

    def _load_of(self, worker: WorkerWithDpRank, slot: ActiveSequences, now: int) -> ActiveLoad:
        blocks = slot.blocks.active_blocks()
        tokens = slot.active_tokens(now)
        self.publisher.observe_load(worker, self._worker_type, blocks, tokens)
        return ActiveLoad(worker.worker_id, worker.dp_rank, blocks, tokens, None)

    def _publish_worker_load(
        self, worker: WorkerWithDpRank, slot: ActiveSequences, now: int
    ) -> None:
        if self._loads_wanted:
            self.publisher.publish_load(self._load_of(worker, slot, now))

    def _enqueue(self, event: ActiveSequenceEvent) -> None:
        try:
            self.publisher.enqueue_event(event)
        except PublishRejected as e:
            if e.during_shutdown:
                log.debug("%s", e)
            else:
                log.error("Failed to publish replica-sync event: %s", e)

    # -- queries ---------------------------------------------------------------------------

    def active_blocks(self) -> dict[WorkerWithDpRank, int]:
        return {w: s.blocks.active_blocks() for w, s in self._slots.items()}

    def active_tokens(self, decay_now: int) -> dict[WorkerWithDpRank, int]:
        return {w: s.prefill.active_tokens(decay_now) for w, s in self._slots.items()}

    def get_active_lora_counts(self) -> dict[str, int]:
        return dict(self._requests.lora_counts)

    def overlaps(self, token_sequence: list[int] | None) -> dict[WorkerWithDpRank, int]:
        """Prefix overlap (in blocks) of the query with each rank's active prompts (non-zero only)."""
        if not token_sequence:
            return {}
        return self._trie.overlaps(token_sequence)

    def potential_columns(
        self,
        token_sequence: list[int] | None,
        deltas: PrefillTokenDeltas | int | None,
        decay_now: int,
    ) -> Columns:
        """Per rank, sorted, as parallel lists: the ranks, and each one's prefill tokens,
        KV blocks and active requests if a prompt of ``token_sequence`` went there (its blocks
        not already active there by the prefix rule are added; prefill tokens saturate at
        2^64-1). ``deltas``: the prompt's tokens per rank, or one count for every rank."""
        if deltas is None or isinstance(deltas, int):
            by_worker, default = None, deltas or 0
        else:
            by_worker, default = deltas.by_worker, deltas.default_tokens
        columns = self.load_columns(token_sequence, decay_now, default)
        prefill = columns.prefill  # a copy of the kept columns: changed in place
        if by_worker:
            index = self._columns.index
            for w, tokens in by_worker.items():
                i = index.get(w)
                if i is not None:
                    prefill[i] += tokens - default
        if prefill and max(prefill) > U64_MAX:
            prefill[:] = [t if t <= U64_MAX else U64_MAX for t in prefill]
        return columns

    def potential_loads(
        self,
        token_sequence: list[int] | None,
        deltas: PrefillTokenDeltas | int | None,
        decay_now: int,
    ) -> list[PotentialLoadRow]:
        """``potential_columns`` as rows ``(worker_id, dp_rank, potential_prefill_tokens,
        potential_decode_blocks, active_requests)``."""
        c = self.potential_columns(token_sequence, deltas, decay_now)
        return [
            (w[0], w[1], p, d, r)
            for w, p, d, r in zip(c.ranks, c.prefill, c.decode, c.requests, strict=True)
        ]

    def load_columns(
        self, token_sequence: list[int] | None, decay_now: int, extra_tokens: int = 0
    ) -> Columns:
        """The sorted ranks and, as parallel lists, each one's prefill tokens plus
        ``extra_tokens`` (not saturated), its KV blocks with the prompt's blocks not active
        there (prefix rule) and its active requests (``loads.LoadColumns``): what a selection
        over all ranks reads, and the base of ``potential_columns``."""
        q_len = len(token_sequence) if token_sequence else 0
        over = self.overlaps(token_sequence)
        columns = self._columns
        if columns.changed:
            columns.refresh(self._slots)
        return columns.columns(over, q_len, extra_tokens, decay_now)

    def rank_loads(self, now: int) -> list[RankLoadRow]:
        """Per rank, sorted: its load now (``loads.rank_rows``)."""
        return rank_rows(self.workers(), self._slots, now)

    def project_worker_loads(
        self, token_sequence: list[int] | None, decay_now: int
    ) -> dict[WorkerWithDpRank, WorkerLoadProjection]:
        q_len = len(token_sequence) if token_sequence else 0
        over = self.overlaps(token_sequence)
        return {
            w: WorkerLoadProjection(
                s.prefill.active_tokens(decay_now),
                s.blocks.active_blocks(),
                q_len - over.get(w, 0),
            )
            for w, s in self._slots.items()
        }

    # -- invariants ------------------------------------------------------------------------

    def assert_consistent(self) -> None:
        """Every derived structure equals what its source implies (``invariants``)."""
        invariants.assert_consistent(
            self._slots, self._table, self._trie, self._columns, self._requests
        )
