"""All ranks of one model: the seeds' ``ActiveSequencesMultiWorker`` (SPEC §4-§6).

A synchronous state machine. Lifecycle calls take an explicit ``decay_now``; the injected
``clock`` stamps request start times and drives expiry. Loads and replica events leave through
a ``SequencePublisher``; the default publisher discards them.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .errors import (
    DuplicateRequest,
    MissingExpectedDuration,
    PublishRejected,
    RequestNotFound,
    WorkerNotFound,
)
from .events import FREE, MARK_PREFILL_COMPLETED, ActiveSequenceEvent, AddRequest, Free
from .overlap import PromptTrie
from .sequences import CHECK_EXPIRY_FREQUENCY_NS, EXPIRY_DURATION_NS, ActiveSequences, Clock
from .topology import TopologyChange, WorkerTable, validate_range
from .types import (
    ActiveLoad,
    PrefillTokenDeltas,
    SequenceMutationOutcome,
    SequenceRequest,
    WorkerDpRange,
    WorkerLoadProjection,
    WorkerWithDpRank,
)

log = logging.getLogger(__name__)

MAX_REPLICA_BATCH_EVENTS = 256
MAX_REPLICA_BATCH_DURATION_NS = 1_000_000


class ReplicaWorkerPolicy(enum.Enum):
    """What a replicated add does for a rank this tracker has no slot for."""

    LAZY_REGISTER = "lazy_register"
    REQUIRE_REGISTERED = "require_registered"


class SequencePublisher:
    """Where a tracker's loads, observations and replica events go. Every hook is optional.

    ``enqueue_event`` must not block; it may raise ``PublishRejected`` (the tracker logs it).
    The other hooks are fire-and-forget and must not raise.
    """

    def enqueue_event(self, event: ActiveSequenceEvent) -> None:
        pass

    def publish_load(self, load: ActiveLoad) -> None:
        pass

    def publish_load_batch(self, loads: list[ActiveLoad]) -> None:
        for load in loads:
            self.publish_load(load)

    def observe_load(
        self, worker: WorkerWithDpRank, worker_type: str, blocks: int, tokens: int
    ) -> None:
        pass

    def observe_worker_registered(self, worker: WorkerWithDpRank, worker_type: str) -> None:
        pass

    def observe_worker_removed(self, worker: WorkerWithDpRank, worker_type: str) -> None:
        pass


NoopSequencePublisher = SequencePublisher


@dataclass(slots=True)
class ModeledPrefillTimeLoad:
    worker: WorkerWithDpRank
    # whole milliseconds, or the MissingExpectedDuration error when some prefill is unmodeled
    modeled_remaining_prefill_time_ms: int | MissingExpectedDuration


@dataclass(slots=True)
class ReplicaEffects:
    """Side effects deferred to the end of one replica batch (one flush per batch)."""

    workers: dict[WorkerWithDpRank, bool] = field(default_factory=dict)  # worker -> publish
    wake: bool = False
    cleanup: bool = False

    def record(self, worker: WorkerWithDpRank, publish: bool) -> None:
        self.workers[worker] = self.workers.get(worker, False) or publish


PotentialLoads = tuple[
    dict[WorkerWithDpRank, int],
    dict[WorkerWithDpRank, int],
    dict[WorkerWithDpRank, int] | None,
]


class ActiveSequencesMultiWorker:
    def __init__(
        self,
        publisher: SequencePublisher | None,
        block_size: int,
        dp_range: dict[int, tuple[int, int]] | None = None,
        replica_sync: bool = False,
        router_id: int = 0,
        worker_type: str = "test",
        *,
        clock: Clock,
        expiry_ns: int | None = EXPIRY_DURATION_NS,
        check_interval_ns: int = CHECK_EXPIRY_FREQUENCY_NS,
        replica_worker_policy: ReplicaWorkerPolicy = ReplicaWorkerPolicy.LAZY_REGISTER,
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

        self.table = WorkerTable()
        self._sorted_workers: list[WorkerWithDpRank] | None = None
        self.slots: dict[WorkerWithDpRank, ActiveSequences] = {}
        self.blocks: dict[WorkerWithDpRank, int] = {}  # read model: active blocks per rank
        self.trie = PromptTrie()
        self.request_worker: dict[str, WorkerWithDpRank] = {}
        self.request_lora: dict[str, str] = {}
        self.lora_counts: dict[str, int] = {}
        self.remote_state_update_count = 0
        self.cleanup_attempts = 0
        self._remote_listeners: list[Callable[[], None]] = []

        ranges = [WorkerDpRange(wid, s, n) for wid, (s, n) in sorted((dp_range or {}).items())]
        for r in ranges:
            validate_range(r)
        self._apply_topology(self.table.reconcile(ranges))

    @classmethod
    def new_without_expiry(cls, *args, **kwargs) -> ActiveSequencesMultiWorker:
        return cls(*args, expiry_ns=None, **kwargs)

    # -- topology --------------------------------------------------------------------------

    def register_worker(self, r: WorkerDpRange) -> TopologyChange:
        return self._apply_topology(self.table.register(r))

    def upsert_worker(self, r: WorkerDpRange) -> TopologyChange:
        return self._apply_topology(self.table.upsert(r))

    def unregister_worker(self, worker_id: int) -> TopologyChange:
        return self._apply_topology(self.table.unregister(worker_id))

    def reconcile_workers(self, ranges: Iterable[WorkerDpRange]) -> TopologyChange:
        return self._apply_topology(self.table.reconcile(ranges))

    def worker_ranges(self) -> list[WorkerDpRange]:
        return self.table.worker_ranges()

    def has_registered_workers(self) -> bool:
        return self.table.has_registered_workers()

    def worker_type(self) -> str:
        return self._worker_type

    def num_workers(self) -> int:
        return len(self.slots)

    def workers(self) -> list[WorkerWithDpRank]:
        """Every tracked rank (registered or lazily created), sorted."""
        if self._sorted_workers is None:
            self._sorted_workers = sorted(self.slots)
        return self._sorted_workers

    def _apply_topology(self, change: TopologyChange) -> TopologyChange:
        wt = self._worker_type
        if not change.is_empty():
            self._sorted_workers = None
        if change.removed:
            removed = set(change.removed)
            for rid in [rid for rid, w in self.request_worker.items() if w in removed]:
                self._unindex(rid)
            for w in change.removed:
                self.publisher.observe_worker_removed(w, wt)
                slot = self.slots.pop(w)
                for st in slot.requests.values():
                    self.trie.remove(w, st.prompt_blocks)
                del self.blocks[w]
        for w in change.added:
            self.publisher.observe_worker_registered(w, wt)
            self.slots[w] = ActiveSequences(
                self.block_size,
                self.clock,
                expiry_ns=self.expiry_ns,
                check_interval_ns=self.check_interval_ns,
            )
            self.blocks[w] = 0
        return change

    def _ensure_worker(self, worker: WorkerWithDpRank) -> None:
        self._apply_topology(self.table.ensure(worker))

    # -- request index ---------------------------------------------------------------------

    def _index(self, rid: str, worker: WorkerWithDpRank, lora: str | None) -> None:
        """``set_request``: map the id to the worker, replacing any earlier mapping and LoRA."""
        self.request_worker[rid] = worker
        old = self.request_lora.pop(rid, None)
        if old is not None:
            self._lora_dec(old)
        if lora is not None:
            self.request_lora[rid] = lora
            self.lora_counts[lora] = self.lora_counts.get(lora, 0) + 1

    def _unindex(self, rid: str) -> WorkerWithDpRank | None:
        worker = self.request_worker.pop(rid, None)
        lora = self.request_lora.pop(rid, None)
        if lora is not None:
            self._lora_dec(lora)
        return worker

    def _lora_dec(self, lora: str) -> None:
        n = self.lora_counts[lora] - 1
        if n:
            self.lora_counts[lora] = n
        else:
            del self.lora_counts[lora]

    def worker_for(self, request_id: str) -> WorkerWithDpRank | None:
        return self.request_worker.get(request_id)

    # -- lifecycle -------------------------------------------------------------------------

    def add_request(self, req: SequenceRequest, decay_now: int) -> None:
        """Add a request, lazily creating a missing rank slot (LazyRegister semantics)."""
        self._add_request(req, decay_now, strict=False)

    def add_request_if_registered(self, req: SequenceRequest, decay_now: int) -> None:
        """Add a request only on an existing rank slot; WorkerNotFound otherwise."""
        self._add_request(req, decay_now, strict=True)

    def _add_request(self, req: SequenceRequest, decay_now: int, *, strict: bool) -> None:
        worker = req.worker
        slot = self.slots.get(worker)
        if slot is None:
            if strict:
                raise WorkerNotFound(worker)
            self._ensure_worker(worker)
            slot = self.slots[worker]
        existing = self.request_worker.get(req.request_id)
        if existing is not None:
            raise DuplicateRequest(req.request_id, existing)
        self._index(req.request_id, worker, req.lora_name)
        self._add_to_slot(
            slot,
            worker,
            req.request_id,
            req.token_sequence,
            req.expected_output_tokens,
            req.track_prefill_tokens,
            req.prefill_load_hint,
            decay_now,
            None,
        )
        self._publish_worker_load(worker, slot, decay_now)
        if self.replica_sync:
            self._enqueue(
                ActiveSequenceEvent(
                    req.request_id,
                    worker,
                    AddRequest(
                        list(req.token_sequence) if req.token_sequence is not None else None,
                        req.track_prefill_tokens,
                        req.expected_output_tokens,
                        req.prefill_load_hint,
                    ),
                    self.router_id,
                    req.lora_name,
                )
            )

    def _add_to_slot(self, slot, worker, rid, seq, eot, track, hint, decay_now, started_at):
        duplicate = rid in slot.requests  # the slot logs and ignores it; keep the index as is
        outcome = slot.add_request_with_prefill_tracking(
            rid, seq, eot, track, hint, decay_now, started_at
        )
        self._after_expiry(worker, outcome)
        if not duplicate:
            prompt = slot.requests[rid].prompt_blocks
            if prompt:
                self.trie.add(worker, prompt)
        self.blocks[worker] = slot.active_blocks()

    def _after_expiry(self, worker: WorkerWithDpRank, outcome: SequenceMutationOutcome) -> None:
        for rid, prompt in outcome.expired_prompts.items():
            if prompt:
                self.trie.remove(worker, prompt)
            if self.request_worker.get(rid) == worker:
                self._unindex(rid)

    def free(self, request_id: str, decay_now: int) -> None:
        """Free a request; unknown or already freed ids are a silent no-op."""
        worker = self.request_worker.get(request_id)
        if worker is None:
            return
        lora = self.request_lora.get(request_id)
        slot = self.slots.get(worker)
        if slot is None:
            self._unindex(request_id)
            return
        self._free_in_slot(slot, worker, request_id, decay_now)
        self._unindex(request_id)
        self._publish_worker_load(worker, slot, decay_now)
        if self.replica_sync:
            self._enqueue(ActiveSequenceEvent(request_id, worker, FREE, self.router_id, lora))

    def _free_in_slot(self, slot, worker, request_id: str, decay_now: int) -> None:
        st = slot.requests.get(request_id)
        if st is not None and st.prompt_blocks:
            self.trie.remove(worker, st.prompt_blocks)
        slot.free(request_id, decay_now)
        self.blocks[worker] = slot.active_blocks()

    def _resolve(self, request_id: str) -> tuple[WorkerWithDpRank, ActiveSequences]:
        worker = self.request_worker.get(request_id)
        if worker is None:
            raise RequestNotFound(request_id)
        slot = self.slots.get(worker)
        if slot is None:
            self._unindex(request_id)
            raise RequestNotFound(request_id)
        return worker, slot

    def mark_prefill_completed(self, request_id: str, decay_now: int) -> None:
        worker, slot = self._resolve(request_id)
        lora = self.request_lora.get(request_id)
        slot.mark_prefill_completed(request_id, decay_now)
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
        self.blocks[worker] = slot.active_blocks()
        self._publish_worker_load(worker, slot, self.clock())
        return h

    def force_expire_requests_across_all_workers(self) -> list[str]:
        """Run every rank's (rate-limited) expiry check; returns the expired request ids."""
        now = self.clock()
        expired: list[str] = []
        for worker, slot in list(self.slots.items()):
            outcome = slot.force_expiry()
            if not outcome.expired_request_ids:
                continue
            self._after_expiry(worker, outcome)
            self.blocks[worker] = slot.active_blocks()
            self._publish_worker_load(worker, slot, now)
            expired.extend(outcome.expired_request_ids)
        return expired

    # -- publication -----------------------------------------------------------------------

    def _load_of(self, worker: WorkerWithDpRank, slot: ActiveSequences, now: int) -> ActiveLoad:
        blocks = self.blocks[worker]
        tokens = slot.active_tokens(now)
        self.publisher.observe_load(worker, self._worker_type, blocks, tokens)
        return ActiveLoad(worker.worker_id, worker.dp_rank, blocks, tokens, None)

    def _publish_worker_load(self, worker: WorkerWithDpRank, slot: ActiveSequences, now: int):
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

    # -- replica apply path ----------------------------------------------------------------

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
        if isinstance(data, AddRequest):
            worker = event.worker
            slot = self.slots.get(worker)
            if slot is None:
                if self.replica_worker_policy is ReplicaWorkerPolicy.REQUIRE_REGISTERED:
                    log.debug("Dropping replica AddRequest for unregistered worker %s", worker)
                    return False
                self._ensure_worker(worker)
                slot = self.slots[worker]
            self._index(rid, worker, event.lora_name)
            self._add_to_slot(
                slot,
                worker,
                rid,
                data.token_sequence,
                data.expected_output_tokens,
                data.track_prefill_tokens,
                data.prefill_load_hint,
                decay_now,
                started_at,
            )
            effects.record(worker, True)
            effects.cleanup = True
            return True
        if isinstance(data, Free):
            worker = self._unindex(rid)
            if worker is None:
                return False
            slot = self.slots.get(worker)
            if slot is None:
                return True
            self._free_in_slot(slot, worker, rid, decay_now)
            effects.record(worker, True)
            effects.wake = True
            effects.cleanup = True
            return True
        worker = self.request_worker.get(rid)
        if worker is None:
            return False
        slot = self.slots.get(worker)
        if slot is None:
            return False
        slot.mark_prefill_completed(rid, decay_now)
        effects.record(worker, False)
        effects.wake = True
        return True

    def flush_replica_effects(self, effects: ReplicaEffects) -> None:
        """Publish one load batch, one wake-up and one cleanup attempt for a replica batch."""
        now = self.clock()
        loads = [
            self._load_of(w, self.slots[w], now)
            for w, publish in effects.workers.items()
            if publish and w in self.slots and self._loads_wanted
        ]
        effects.workers.clear()
        if loads:
            self.publisher.publish_load_batch(loads)
        if effects.wake:
            self.notify_remote_state_update()
        if effects.cleanup:
            self.cleanup_attempts += 1
        effects.wake = effects.cleanup = False

    def subscribe_remote_state_changes(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever a replica batch freed capacity or completed a prefill."""
        self._remote_listeners.append(listener)

    def notify_remote_state_update(self) -> None:
        self.remote_state_update_count += 1
        for listener in self._remote_listeners:
            listener()

    # -- queries ---------------------------------------------------------------------------

    def active_blocks(self) -> dict[WorkerWithDpRank, int]:
        return dict(self.blocks)

    def active_tokens(self, decay_now: int) -> dict[WorkerWithDpRank, int]:
        return {w: s.prefill.active_tokens(decay_now) for w, s in self.slots.items()}

    def active_request_counts(self) -> dict[WorkerWithDpRank, int]:
        return {w: len(s.requests) for w, s in self.slots.items()}

    def get_active_lora_counts(self) -> dict[str, int]:
        return dict(self.lora_counts)

    def any_worker_matches_active_tokens(
        self, decay_now: int, predicate: Callable[[WorkerWithDpRank, int], bool]
    ) -> bool:
        return any(predicate(w, s.prefill.active_tokens(decay_now)) for w, s in self.slots.items())

    def modeled_remaining_prefill_time_loads_at(self, now: int) -> list[ModeledPrefillTimeLoad]:
        out = []
        for w, s in self.slots.items():
            try:
                ms: int | MissingExpectedDuration = s.prefill.modeled_remaining_prefill_time_ms(now)
            except MissingExpectedDuration as e:
                ms = e
            out.append(ModeledPrefillTimeLoad(w, ms))
        return out

    def overlaps(self, token_sequence: list[int] | None) -> dict[WorkerWithDpRank, int]:
        """Prefix overlap (in blocks) of the query with each rank's active prompts (non-zero only)."""
        if not token_sequence:
            return {}
        return self.trie.overlaps(token_sequence)

    def potential_blocks_and_tokens(
        self,
        token_sequence: list[int] | None,
        deltas: PrefillTokenDeltas | None = None,
        decay_now: int | None = None,
        include_active_requests: bool = False,
    ) -> PotentialLoads:
        if decay_now is None:
            decay_now = self.clock()
        deltas = deltas or PrefillTokenDeltas.none()
        q_len = len(token_sequence) if token_sequence else 0
        over = self.overlaps(token_sequence)
        blocks_now = self.blocks
        blocks: dict[WorkerWithDpRank, int] = {}
        tokens: dict[WorkerWithDpRank, int] = {}
        by_worker, default = deltas.by_worker, deltas.default_tokens
        for w, s in self.slots.items():
            blocks[w] = blocks_now[w] + q_len - over.get(w, 0)
            tokens[w] = s.prefill.active_tokens(decay_now) + by_worker.get(w, default)
        requests = (
            {w: len(s.requests) for w, s in self.slots.items()} if include_active_requests else None
        )
        return blocks, tokens, requests

    def project_worker_loads(
        self, token_sequence: list[int] | None, decay_now: int
    ) -> dict[WorkerWithDpRank, WorkerLoadProjection]:
        q_len = len(token_sequence) if token_sequence else 0
        over = self.overlaps(token_sequence)
        return {
            w: WorkerLoadProjection(
                s.prefill.active_tokens(decay_now), self.blocks[w], q_len - over.get(w, 0)
            )
            for w, s in self.slots.items()
        }

    # -- invariants ------------------------------------------------------------------------

    def is_membership_empty(self) -> bool:
        return self.trie.is_empty()

    def assert_consistent(self) -> None:
        assert set(self.slots) == self.table.slots == set(self.blocks)
        fresh = PromptTrie()
        for w, s in self.slots.items():
            s.assert_consistent()
            assert self.blocks[w] == s.active_blocks(), f"stale block count for {w}"
            for st in s.requests.values():
                if st.prompt_blocks:
                    fresh.add(w, st.prompt_blocks)
        assert fresh.expanded() == self.trie.expanded(), "overlap index out of sync"
        for rid, w in self.request_worker.items():
            if w in self.slots:
                assert rid in self.slots[w].requests, f"{rid} mapped to {w} but not active there"
        counts: dict[str, int] = {}
        for lora in self.request_lora.values():
            counts[lora] = counts.get(lora, 0) + 1
        assert counts == self.lora_counts

    def assert_completely_drained(self, decay_now: int) -> None:
        blocks = self.active_blocks()
        assert all(v == 0 for v in blocks.values()), f"expected zero active blocks, got {blocks}"
        tokens = self.active_tokens(decay_now)
        assert all(v == 0 for v in tokens.values()), f"expected zero active tokens, got {tokens}"
        reqs = self.active_request_counts()
        assert all(v == 0 for v in reqs.values()), f"expected zero active requests, got {reqs}"
        assert not self.request_worker, f"expected no request mappings, got {self.request_worker}"
        assert not self.lora_counts, f"expected no LoRA counts, got {self.lora_counts}"
        assert self.trie.is_empty(), "expected the overlap index to be empty after drain"
        for w, s in self.slots.items():
            assert not s.blocks.refcount, f"{w} still references blocks"
