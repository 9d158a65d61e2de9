"""Trackers keyed by ``(model_name, routing_group)``: the one place where API-level calls become
core calls, and where replica events are wrapped for (and unwrapped from) other instances.

Every method is synchronous and runs to completion without awaiting, so two calls never
interleave: no locks are needed on one event loop. Errors are ``ServiceError``s carrying the
HTTP status and the exact message the API answers with.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.core import errors as core_errors
from app.core.events import ActiveSequenceEvent, event_from_wire, event_to_wire
from app.core.hashing import sequence_hashes_for_tokens
from app.core.snapshot import export_tracker, restore_tracker, wall_mapping
from app.core.tracker import (
    ActiveSequencesMultiWorker,
    ReplicaEffects,
    ReplicaWorkerPolicy,
    SequencePublisher,
)
from app.core.types import (
    NS_PER_MS,
    NS_PER_S,
    U32_MAX,
    U64_MAX,
    PrefillLoadHint,
    SequenceRequest,
    WorkerDpRange,
    WorkerWithDpRank,
)

log = logging.getLogger(__name__)

DEFAULT_ROUTING_GROUP = "default"
WORKER_TYPE = "standalone"
# Most worker ranks one tracker may hold: every rank costs memory, so a single registration with
# a huge ``dp_size`` (the anchor accepts up to 2^32 - 1) must not exhaust the process.
MAX_RANKS_PER_TRACKER = 16_384

# Most data-parallel ranks one worker may register (the reference's limit).
MAX_DP_SIZE = 4096

Key = tuple[str, str]
SHAPE_PREFIX = "Failed to deserialize the JSON body into the target type: "


class ServiceError(Exception):
    """An error the API answers with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def no_tracker(key: Key) -> ServiceError:
    return ServiceError(404, f"no slot tracker for model={key[0]} routing_group={key[1]}")


class Replicator(Protocol):
    """Where a service sends its replica records. ``publish`` must never block."""

    def publish(self, record: dict[str, Any]) -> None: ...


@dataclass(slots=True)
class KeyCounters:
    added: int = 0
    freed: int = 0
    expired: int = 0


class _TrackerPublisher(SequencePublisher):
    """Forwards one tracker's lifecycle events to the service's replicator."""

    __slots__ = ("service", "key")

    def __init__(self, service: SlotTrackerService, key: Key) -> None:
        self.service = service
        self.key = key

    def enqueue_event(self, event: ActiveSequenceEvent) -> None:
        self.service._emit_lifecycle(self.key, event)


@dataclass(slots=True)
class AddCall:
    """One ``/add`` after parsing (hashes already reinterpreted as unsigned)."""

    model_name: str
    routing_group: str
    request_id: str
    worker_id: int
    dp_rank: int
    sequence_hashes: list[int] | None = None
    token_ids: list[int] | None = None
    new_isl_tokens: int = 0
    expected_prefill_ms: float | None = None
    track_prefill_tokens: bool | None = None
    expected_output_tokens: int | None = None
    lora_name: str | None = None


@dataclass(slots=True)
class ServiceStats:
    remote_dropped: int = 0
    remote_applied: int = 0
    counters: dict[Key, KeyCounters] = field(default_factory=dict)


class SlotTrackerService:
    def __init__(
        self,
        *,
        clock: Callable[[], int] = time.monotonic_ns,
        wall_clock: Callable[[], int] = time.time_ns,
        expiry_seconds: int = 300,
        expiry_check_seconds: int = 30,
        instance_id: int = 0,
        max_hashes_per_request: int = 1_048_576,
        replicator: Replicator | None = None,
    ) -> None:
        self.clock = clock
        self.wall_clock = wall_clock
        self.expiry_ns = expiry_seconds * NS_PER_S
        self.check_interval_ns = expiry_check_seconds * NS_PER_S
        self.instance_id = instance_id
        self.max_hashes = max_hashes_per_request
        self.replicator = replicator
        self.trackers: dict[Key, ActiveSequencesMultiWorker] = {}
        self.stats = ServiceStats()

    # -- trackers --------------------------------------------------------------------------

    def _new_tracker(self, key: Key, block_size: int) -> ActiveSequencesMultiWorker:
        tracker = ActiveSequencesMultiWorker(
            _TrackerPublisher(self, key),
            block_size,
            {},
            self.replicator is not None,
            self.instance_id,
            WORKER_TYPE,
            clock=self.clock,
            expiry_ns=self.expiry_ns,
            check_interval_ns=self.check_interval_ns,
            replica_worker_policy=ReplicaWorkerPolicy.REQUIRE_REGISTERED,
        )
        self.trackers[key] = tracker
        self.stats.counters.setdefault(key, KeyCounters())
        return tracker

    def tracker(self, key: Key) -> ActiveSequencesMultiWorker:
        t = self.trackers.get(key)
        if t is None:
            raise no_tracker(key)
        return t

    def _drop_if_empty(self, key: Key) -> None:
        t = self.trackers.get(key)
        if t is not None and not t.has_registered_workers():
            del self.trackers[key]

    def counters(self, key: Key) -> KeyCounters:
        c = self.stats.counters.get(key)
        if c is None:
            c = self.stats.counters[key] = KeyCounters()
        return c

    # -- topology --------------------------------------------------------------------------

    @staticmethod
    def _check_range(block_size: int, dp_start: int, dp_size: int) -> None:
        if block_size == 0:
            raise ServiceError(400, "block_size must be greater than 0")
        if dp_size == 0:
            raise ServiceError(400, "dp_size must be greater than 0")
        if dp_size > MAX_DP_SIZE:
            raise ServiceError(400, f"dp_size {dp_size} exceeds the maximum {MAX_DP_SIZE}")
        if dp_start + dp_size > U32_MAX:
            raise ServiceError(400, f"dp range overflows u32: start={dp_start} size={dp_size}")

    def _tracker_for_topology(self, key: Key, block_size: int) -> ActiveSequencesMultiWorker | None:
        t = self.trackers.get(key)
        if t is not None and t.block_size != block_size:
            raise ServiceError(
                409,
                f"block_size mismatch for model={key[0]} routing_group={key[1]}: "
                f"existing={t.block_size}, requested={block_size}",
            )
        return t

    @staticmethod
    def _check_capacity(key: Key, ranks: int) -> None:
        if ranks > MAX_RANKS_PER_TRACKER:
            raise ServiceError(
                400,
                f"too many ranks for model={key[0]} routing_group={key[1]}: "
                f"{ranks} > {MAX_RANKS_PER_TRACKER}",
            )

    def register(
        self, key: Key, worker_id: int, block_size: int, dp_start: int, dp_size: int
    ) -> None:
        self._check_range(block_size, dp_start, dp_size)
        t = self._tracker_for_topology(key, block_size)
        if t is not None and worker_id in t.table.ranges:
            raise ServiceError(
                409,
                f"worker {worker_id} already registered for model={key[0]} routing_group={key[1]}",
            )
        self._check_capacity(key, (len(t.slots) if t is not None else 0) + dp_size)
        if t is None:
            t = self._new_tracker(key, block_size)
        t.register_worker(WorkerDpRange(worker_id, dp_start, dp_size))
        self._emit_topology(
            key,
            block_size,
            {"op": "upsert", "worker_id": worker_id, "dp_start": dp_start, "dp_size": dp_size},
        )

    def upsert(
        self, key: Key, worker_id: int, block_size: int, dp_start: int, dp_size: int
    ) -> bool:
        """Register or replace one worker's ranks; True when the worker id was new."""
        self._check_range(block_size, dp_start, dp_size)
        t = self._tracker_for_topology(key, block_size)
        old = t.table.ranges.get(worker_id) if t is not None else None
        kept = (len(t.slots) if t is not None else 0) - (old.dp_size if old is not None else 0)
        self._check_capacity(key, kept + dp_size)
        if t is None:
            t = self._new_tracker(key, block_size)
        created = worker_id not in t.table.ranges
        change = t.upsert_worker(WorkerDpRange(worker_id, dp_start, dp_size))
        if not change.is_empty() or created:
            self._emit_topology(
                key,
                block_size,
                {"op": "upsert", "worker_id": worker_id, "dp_start": dp_start, "dp_size": dp_size},
            )
        return created

    def unregister(self, key: Key, worker_id: int) -> None:
        t = self.trackers.get(key)
        if t is None or worker_id not in t.table.ranges:
            raise ServiceError(
                404, f"worker {worker_id} not found for model={key[0]} routing_group={key[1]}"
            )
        t.unregister_worker(worker_id)
        self._drop_if_empty(key)
        self._emit_topology(key, t.block_size, {"op": "unregister", "worker_id": worker_id})

    def reconcile(
        self, key: Key, block_size: int, workers: list[tuple[int, int, int]]
    ) -> tuple[list[WorkerWithDpRank], list[WorkerWithDpRank]]:
        """Make ``workers`` the whole topology of the key; returns (added, removed) ranks."""
        if block_size == 0:
            raise ServiceError(400, "block_size must be greater than 0")
        seen: set[int] = set()
        for wid, start, size in workers:
            if wid in seen:
                raise ServiceError(400, f"worker {wid} is listed more than once")
            seen.add(wid)
            self._check_range(block_size, start, size)
        self._check_capacity(key, sum(size for _, _, size in workers))
        t = self._tracker_for_topology(key, block_size)
        if t is None:
            if not workers:
                return [], []
            t = self._new_tracker(key, block_size)
        change = t.reconcile_workers([WorkerDpRange(*w) for w in workers])
        self._drop_if_empty(key)
        self._emit_topology(
            key, block_size, {"op": "reconcile", "workers": [list(w) for w in workers]}
        )
        return change.added, change.removed

    def workers(self, model_name: str | None, routing_group: str | None) -> list[dict[str, Any]]:
        rows = []
        for key in sorted(self._matching(model_name, routing_group)):
            t = self.trackers[key]
            for r in t.worker_ranges():
                rows.append(
                    {
                        "worker_id": r.worker_id,
                        "model_name": key[0],
                        "routing_group": key[1],
                        "block_size": t.block_size,
                        "dp_start": r.dp_start,
                        "dp_size": r.dp_size,
                    }
                )
        return rows

    def _matching(self, model_name: str | None, routing_group: str | None) -> Iterable[Key]:
        if model_name is not None and routing_group is not None:
            key = (model_name, routing_group)
            return [key] if key in self.trackers else []
        return [
            k
            for k in self.trackers
            if (model_name is None or k[0] == model_name)
            and (routing_group is None or k[1] == routing_group)
        ]

    # -- lifecycle -------------------------------------------------------------------------

    def prompt_hashes(
        self,
        key: Key,
        sequence_hashes: list[int] | None,
        token_ids: list[int] | None,
        lora_name: str | None,
    ) -> tuple[ActiveSequencesMultiWorker, list[int]]:
        """The tracker of ``key`` and the prompt's hashes (shape errors before a missing tracker,
        as the reference validates the body before looking the tracker up)."""
        if sequence_hashes is None and token_ids is None:
            raise ServiceError(422, SHAPE_PREFIX + "missing field `sequence_hashes`")
        if sequence_hashes is not None and token_ids is not None:
            raise ServiceError(
                422, SHAPE_PREFIX + "give either `sequence_hashes` or `token_ids`, not both"
            )
        t = self.tracker(key)
        if token_ids is not None:
            hashes = sequence_hashes_for_tokens(token_ids, t.block_size, lora_name)
        else:
            hashes = sequence_hashes  # type: ignore[assignment]
        if len(hashes) > self.max_hashes:
            raise ServiceError(
                422,
                f"too many block hashes: {len(hashes)} > max_hashes_per_request "
                f"({self.max_hashes})",
            )
        return t, hashes

    def add(self, call: AddCall) -> None:
        key = (call.model_name, call.routing_group)
        t, hashes = self.prompt_hashes(key, call.sequence_hashes, call.token_ids, call.lora_name)
        tokens = call.new_isl_tokens
        track = tokens > 0 if call.track_prefill_tokens is None else call.track_prefill_tokens
        duration_ns = None
        if call.expected_prefill_ms is not None:
            duration_ns = round(call.expected_prefill_ms * NS_PER_MS)
        hint = PrefillLoadHint(tokens, duration_ns) if tokens > 0 else None
        worker = WorkerWithDpRank(call.worker_id, call.dp_rank)
        slot = t.slots.get(worker)
        if track and slot is not None and slot.prefill.full_sum + tokens > U64_MAX:
            raise ServiceError(
                422, f"new_isl_tokens would overflow the prefill token sum of {worker.debug()}"
            )
        try:
            t.add_request_if_registered(
                SequenceRequest(
                    call.request_id,
                    worker,
                    hashes,
                    track,
                    call.expected_output_tokens,
                    hint,
                    call.lora_name,
                ),
                self.clock(),
            )
        except core_errors.WorkerNotFound as e:
            raise ServiceError(404, str(e)) from None
        except core_errors.DuplicateRequest as e:
            raise ServiceError(409, str(e)) from None
        self.counters(key).added += 1

    def prefill_complete(self, key: Key, request_id: str) -> None:
        t = self.tracker(key)
        try:
            t.mark_prefill_completed(request_id, self.clock())
        except core_errors.RequestNotFound as e:
            raise ServiceError(404, str(e)) from None

    def free(self, key: Key, request_id: str) -> None:
        t = self.tracker(key)
        if request_id in t.request_worker:
            t.free(request_id, self.clock())
            self.counters(key).freed += 1

    def output_block(self, key: Key, request_id: str, decay_fraction: float | None) -> None:
        t = self.tracker(key)
        try:
            t.add_output_block(request_id, decay_fraction)
        except core_errors.RequestNotFound as e:
            raise ServiceError(404, str(e)) from None

    def expire(self) -> int:
        """One forced-expiry sweep over every tracker; returns how many requests expired."""
        total = 0
        for key, t in list(self.trackers.items()):
            n = len(t.force_expire_requests_across_all_workers())
            if n:
                self.counters(key).expired += n
                total += n
        return total

    # -- reads -----------------------------------------------------------------------------

    def loads(self, model_name: str | None, routing_group: str | None) -> list[dict[str, Any]]:
        now = self.clock()
        rows = []
        for key in sorted(self._matching(model_name, routing_group)):
            t = self.trackers[key]
            blocks = t.blocks
            for w in t.workers():
                s = t.slots[w]
                try:
                    modeled: int | None = s.prefill.modeled_remaining_prefill_time_ms(now)
                except core_errors.MissingExpectedDuration:
                    modeled = None
                rows.append(
                    {
                        "model_name": key[0],
                        "routing_group": key[1],
                        "worker_id": w.worker_id,
                        "dp_rank": w.dp_rank,
                        "active_prefill_tokens": s.prefill.active_tokens(now),
                        "active_decode_blocks": blocks[w],
                        "active_requests": len(s.requests),
                        "modeled_remaining_prefill_ms": modeled,
                    }
                )
        return rows

    def potential_loads(
        self,
        key: Key,
        sequence_hashes: list[int] | None,
        token_ids: list[int] | None,
        lora_name: str | None,
        new_isl_tokens: int,
    ) -> list[tuple[int, int, int, int, int]]:
        """Per rank, sorted: ``(worker_id, dp_rank, potential_prefill_tokens,
        potential_decode_blocks, active_requests)``; tuples, as this answers every routing
        decision and the API encodes them directly."""
        t, hashes = self.prompt_hashes(key, sequence_hashes, token_ids, lora_name)
        now = self.clock()
        # the core's potential_blocks_and_tokens, fused into one pass that builds the rows
        over = t.overlaps(hashes)
        q_len = len(hashes)
        blocks, slots = t.blocks, t.slots
        rows = []
        for w in t.workers():
            s = slots[w]
            tokens = s.prefill.active_tokens(now) + new_isl_tokens
            rows.append(
                (
                    w.worker_id,
                    w.dp_rank,
                    tokens if tokens <= U64_MAX else U64_MAX,
                    blocks[w] + q_len - over.get(w, 0),
                    len(s.requests),
                )
            )
        return rows

    def project_loads(
        self,
        key: Key,
        sequence_hashes: list[int] | None,
        token_ids: list[int] | None,
        lora_name: str | None,
    ) -> list[dict[str, Any]]:
        t, hashes = self.prompt_hashes(key, sequence_hashes, token_ids, lora_name)
        proj = t.project_worker_loads(hashes, self.clock())
        return [
            {
                "worker_id": w.worker_id,
                "dp_rank": w.dp_rank,
                "active_prefill_tokens": p.active_prefill_tokens,
                "active_decode_blocks": p.active_decode_blocks,
                "additional_active_blocks": p.additional_active_blocks,
                "potential_decode_blocks": p.potential_decode_blocks(),
            }
            for w, p in sorted(proj.items())
        ]

    def lora_counts(self, key: Key) -> dict[str, int]:
        return dict(sorted(self.tracker(key).get_active_lora_counts().items()))

    # -- replication -----------------------------------------------------------------------

    def _envelope(self, key: Key, block_size: int) -> dict[str, Any]:
        return {
            "model_name": key[0],
            "routing_group": key[1],
            "block_size": block_size,
            "origin": self.instance_id,
            "ts": self.wall_clock(),
        }

    def _emit_lifecycle(self, key: Key, event: ActiveSequenceEvent) -> None:
        if self.replicator is None:
            return
        t = self.trackers.get(key)
        record = self._envelope(key, t.block_size if t is not None else 0)
        record["event"] = event_to_wire(event)
        self.replicator.publish(record)

    def _emit_topology(self, key: Key, block_size: int, op: dict[str, Any]) -> None:
        if self.replicator is None:
            return
        record = self._envelope(key, block_size)
        record["topology"] = op
        self.replicator.publish(record)

    def producer_instant(self, wall_ts: int) -> int:
        """The local monotonic instant matching a producer's wall-clock time (skew clamped)."""
        age = self.wall_clock() - wall_ts
        return self.clock() - (age if age > 0 else 0)

    def apply_remote(self, records: list[dict[str, Any]]) -> int:
        """Apply other instances' records in order; returns how many changed state.

        Lifecycle events keep the producer's time: a replicated request ages from its producer's
        add time and its prefill decays from the producer's instant. Effects (loads, wake-ups)
        are flushed once per tracker for the whole batch.
        """
        applied = 0
        effects: dict[Key, ReplicaEffects] = {}
        for rec in records:
            try:
                if self._apply_one(rec, effects):
                    applied += 1
                    self.stats.remote_applied += 1
            except (KeyError, TypeError, ValueError) as e:
                self.stats.remote_dropped += 1
                log.warning("dropping malformed replica record: %s", e)
        for key, eff in effects.items():
            t = self.trackers.get(key)
            if t is not None:
                t.flush_replica_effects(eff)
        return applied

    def _apply_one(self, rec: dict[str, Any], effects: dict[Key, ReplicaEffects]) -> bool:
        if rec.get("origin") == self.instance_id:
            return False
        key = (rec["model_name"], rec["routing_group"])
        block_size = rec["block_size"]
        if "topology" in rec:
            return self._apply_topology(key, block_size, rec["topology"])
        t = self.trackers.get(key)
        if t is None or t.block_size != block_size:
            self.stats.remote_dropped += 1
            log.debug(
                "dropping replica event for %s: no tracker with block size %s", key, block_size
            )
            return False
        event = event_from_wire(rec["event"])
        instant = self.producer_instant(rec["ts"])
        eff = effects.get(key)
        if eff is None:
            eff = effects[key] = ReplicaEffects()
        changed = t.apply_replica_event(event, eff, decay_now=instant, started_at=instant)
        if changed:
            c = self.counters(key)
            kind = type(event.data).__name__
            if kind == "AddRequest":
                c.added += 1
            elif kind == "Free":
                c.freed += 1
        return changed

    def _apply_topology(self, key: Key, block_size: int, op: dict[str, Any]) -> bool:
        kind = op["op"]
        t = self.trackers.get(key)
        if t is not None and t.block_size != block_size:
            log.warning(
                "replica topology for %s has block size %s, local %s; dropped",
                key,
                block_size,
                t.block_size,
            )
            self.stats.remote_dropped += 1
            return False
        if kind == "upsert":
            if t is None:
                t = self._new_tracker(key, block_size)
            t.upsert_worker(WorkerDpRange(op["worker_id"], op["dp_start"], op["dp_size"]))
            return True
        if kind == "unregister":
            if t is None or op["worker_id"] not in t.table.ranges:
                return False
            t.unregister_worker(op["worker_id"])
            self._drop_if_empty(key)
            return True
        if kind == "reconcile":
            ranges = [WorkerDpRange(*w) for w in op["workers"]]
            if t is None:
                if not ranges:
                    return False
                t = self._new_tracker(key, block_size)
            t.reconcile_workers(ranges)
            self._drop_if_empty(key)
            return True
        raise ValueError(f"unknown topology op {kind!r}")

    # -- snapshots -------------------------------------------------------------------------

    def export_state(self) -> list[dict[str, Any]]:
        """Every tracker's replicated state (``app.core.snapshot``), instants as wall time."""
        to_wall, _ = wall_mapping(self.clock(), self.wall_clock())
        return [
            {"model_name": key[0], "routing_group": key[1], "tracker": export_tracker(t, to_wall)}
            for key, t in sorted(self.trackers.items())
        ]

    def restore_state(self, trackers: list[dict[str, Any]]) -> None:
        """Replace every tracker by those of an ``export_state`` (counters are kept).

        All or nothing: on malformed data the previous trackers stay in place.
        """
        _, from_wall = wall_mapping(self.clock(), self.wall_clock())
        previous, self.trackers = self.trackers, {}
        try:
            for entry in trackers:
                key = (entry["model_name"], entry["routing_group"])
                data = entry["tracker"]
                restore_tracker(self._new_tracker(key, data["block_size"]), data, from_wall)
        except Exception:
            self.trackers = previous
            raise
