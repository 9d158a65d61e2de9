"""The service: executes commands against the tracker of their ``(model_name, routing_group)``.

Every method is synchronous and runs to completion without awaiting, so two calls never
interleave: no locks are needed on one event loop. Errors are domain errors (``kv_slot_tracker.core.errors``
and ``kv_slot_tracker.service.errors``); the service knows nothing of HTTP. Replica records for other
instances leave through ``kv_slot_tracker.service.replica``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from msgspec import UNSET, UnsetType

from kv_slot_tracker.core.hashing import sequence_hashes_for_tokens
from kv_slot_tracker.core.limits import DEFAULT_MAX_TRACKERS
from kv_slot_tracker.core.loads import Columns, RankLoadRow
from kv_slot_tracker.core.selection.errors import ReservationReleased
from kv_slot_tracker.core.sequences import CHECK_EXPIRY_FREQUENCY_NS, EXPIRY_DURATION_NS
from kv_slot_tracker.core.topology import TopologyChange
from kv_slot_tracker.core.tracker import ActiveSequencesMultiWorker
from kv_slot_tracker.core.types import (
    NS_PER_S,
    LifecycleCounts,
)
from kv_slot_tracker.replication.port import Batch
from kv_slot_tracker.service import commands
from kv_slot_tracker.service.errors import (
    BlockSizeMismatch,
    NoTracker,
    TooManyHashes,
    UnknownWorker,
    WorkerExists,
)
from kv_slot_tracker.service.leases import Leases, renew_listed
from kv_slot_tracker.service.registry import TrackerRegistry
from kv_slot_tracker.service.replica import RecordSink, ReplicaRecords
from kv_slot_tracker.service.topology_rules import (
    check_capacity,
    check_range,
    check_reconcile,
    check_upsert,
)

Key = commands.Key
OutcomeSink = Callable[[Key, str, int, bool], None]
"""``(key, request_id, cached_tokens, freed)``: a lifecycle call's reported cached tokens."""


class SlotTrackerService:
    def __init__(
        self,
        *,
        clock: Callable[[], int] = time.monotonic_ns,
        wall_clock: Callable[[], int] = time.time_ns,
        expiry_seconds: int = EXPIRY_DURATION_NS // NS_PER_S,
        expiry_check_seconds: int = CHECK_EXPIRY_FREQUENCY_NS // NS_PER_S,
        instance_id: int = 0,
        max_hashes_per_request: int = 1_048_576,
        max_trackers: int = DEFAULT_MAX_TRACKERS,
        worker_ttl_seconds: int = 0,
        replicator: RecordSink | None = None,
    ) -> None:
        self.clock = clock
        self.instance_id = instance_id
        self.max_hashes = max_hashes_per_request
        self.replica = ReplicaRecords(instance_id, clock, wall_clock, replicator)
        self.replica.max_hashes = max_hashes_per_request
        self.registry = TrackerRegistry(
            clock=clock,
            expiry_ns=expiry_seconds * NS_PER_S,
            check_interval_ns=expiry_check_seconds * NS_PER_S,
            instance_id=instance_id,
            replicated=replicator is not None,
            publisher_for=self.replica.publisher_for,
        )
        self.registry.max_trackers = max_trackers
        self.registry.leases = Leases(worker_ttl_seconds * NS_PER_S)
        self.replica.bind(self.registry)
        self.outcome_sink: OutcomeSink | None = None
        """Where a ``/prefill_complete`` or ``/free`` carrying ``cached_tokens`` reports it
        (the selection's routing receipts: ``report_outcomes_to``); None: nowhere."""

    def report_outcomes_to(self, sink: OutcomeSink | None) -> None:
        """Report the ``cached_tokens`` of lifecycle calls to ``sink``: ``(key, request_id,
        cached_tokens, freed)``, after the call succeeded."""
        self.outcome_sink = sink

    # -- the registry ----------------------------------------------------------------------

    @property
    def trackers(self) -> dict[Key, ActiveSequencesMultiWorker]:
        return self.registry.trackers

    def tracker(self, key: Key) -> ActiveSequencesMultiWorker:
        return self.registry.get(key)

    @property
    def replicator(self) -> RecordSink | None:
        return self.replica.replicator

    def counters(self) -> list[tuple[Key, LifecycleCounts]]:
        """Added/freed/expired counts per live tracker, sorted (they go with the tracker)."""
        return sorted(self.registry.counters.items())

    # -- topology --------------------------------------------------------------------------

    def _tracker_for_topology(self, key: Key, block_size: int) -> ActiveSequencesMultiWorker | None:
        t = self.registry.find(key)
        if t is not None and t.block_size != block_size:
            raise BlockSizeMismatch(key, t.block_size, block_size)
        return t

    def register(self, cmd: commands.Register) -> None:
        key = cmd.key
        check_range(cmd.block_size, cmd.dp_start, cmd.dp_size)
        t = self._tracker_for_topology(key, cmd.block_size)
        if t is not None and t.has_worker(cmd.worker_id):
            raise WorkerExists(key, cmd.worker_id)
        check_capacity(key, (t.num_ranks() if t is not None else 0) + cmd.dp_size)
        self.registry.admit_ranks(cmd.dp_size)
        if t is None:
            t = self.registry.create(key, cmd.block_size)
        r = cmd.ranks
        t.register_worker(r)
        self.registry.leases.renew(key, cmd.worker_id, self.clock())
        self.replica.emit_upsert(key, cmd.block_size, r)

    def upsert(self, cmd: commands.Upsert) -> bool:
        """Register or replace one worker's ranks; True when the worker id was new."""
        key = cmd.key
        check_range(cmd.block_size, cmd.dp_start, cmd.dp_size)
        t = self._tracker_for_topology(key, cmd.block_size)
        check_upsert(key, t, cmd.worker_id, cmd.dp_size)
        created = t is None or not t.has_worker(cmd.worker_id)
        held = None if created or t is None else t.worker_range(cmd.worker_id)
        self.registry.admit_ranks(cmd.dp_size - (held.dp_size if held is not None else 0))
        if t is None:
            t = self.registry.create(key, cmd.block_size)
        r = cmd.ranks
        change = t.upsert_worker(r)
        leases = self.registry.leases
        leases.renew(key, cmd.worker_id, self.clock())
        if not change.is_empty() or created:
            self.replica.emit_upsert(key, cmd.block_size, r)
        elif leases.enabled:  # nothing changed but the lease: peers renew it too
            self.replica.emit_renew(key, cmd.block_size, cmd.worker_id)
        return created

    def heartbeat(self, cmd: commands.Heartbeat) -> None:
        """Renew a worker's lease (``worker_ttl_seconds``); accepted, changing nothing, when
        leases are off."""
        key = cmd.key
        t = self.registry.find(key)
        if t is None or not t.has_worker(cmd.worker_id):
            raise UnknownWorker(key, cmd.worker_id)
        leases = self.registry.leases
        if leases.enabled:
            leases.renew(key, cmd.worker_id, self.clock())
            self.replica.emit_renew(key, t.block_size, cmd.worker_id)

    def expire_leases(self) -> list[tuple[Key, int]]:
        """Unregister every worker whose lease ran out (each a replicated unregister); returns
        them. Cost: the workers that expired, not the workers registered."""
        expired = []
        for key, worker_id in self.registry.leases.due(self.clock()):
            t = self.registry.find(key)
            if t is None or not t.has_worker(worker_id):
                continue
            self.unregister(
                commands.Unregister(model_name=key[0], routing_group=key[1], worker_id=worker_id)
            )
            self.registry.workers_expired += 1
            expired.append((key, worker_id))
        return expired

    def unregister(self, cmd: commands.Unregister) -> None:
        key = cmd.key
        t = self.registry.find(key)
        if t is None or not t.has_worker(cmd.worker_id):
            raise UnknownWorker(key, cmd.worker_id)
        t.unregister_worker(cmd.worker_id)
        self.registry.leases.forget(key, cmd.worker_id)
        self.registry.drop_if_empty(key)
        self.replica.emit_unregister(key, t.block_size, cmd.worker_id)

    def reconcile(self, cmd: commands.Reconcile) -> TopologyChange:
        """Make the listed workers the whole topology of the key; returns the ranks added and
        removed."""
        key, block_size, workers = cmd.key, cmd.block_size, cmd.workers
        check_reconcile(key, block_size, workers)
        t = self._tracker_for_topology(key, block_size)
        self.registry.admit_ranks(
            sum(w.dp_size for w in workers) - (t.num_ranks() if t is not None else 0)
        )
        if t is None:
            if not workers:
                return TopologyChange()
            t = self.registry.create(key, block_size)
        change = t.reconcile_workers(workers)
        renew_listed(self.registry.leases, key, workers, change.removed, self.clock())
        self.registry.drop_if_empty(key)
        self.replica.emit_reconcile(key, block_size, workers)
        return change

    def workers(self, model_name: str | None, routing_group: str | None) -> list[dict[str, Any]]:
        rows = []
        for key in self.registry.matching(model_name, routing_group):
            t = self.registry.trackers[key]
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

    # -- lifecycle -------------------------------------------------------------------------

    def prompt_hashes(self, cmd: commands.Prompt) -> tuple[ActiveSequencesMultiWorker, list[int]]:
        """The tracker of the command's key and its prompt as block hashes."""
        t = self.registry.get((cmd.model_name, cmd.routing_group))
        return t, self._hashes(t, cmd.sequence_hashes, cmd.token_ids, cmd.lora_name)

    def _hashes(
        self,
        t: ActiveSequencesMultiWorker,
        sequence_hashes: list[int] | UnsetType | None,
        token_ids: list[int] | UnsetType | None,
        lora_name: str | None,
    ) -> list[int]:
        """The prompt as block hashes; a form not given is None or UNSET (a command built in
        process rather than by the edge)."""
        if token_ids is not None and token_ids is not UNSET:
            hashes = sequence_hashes_for_tokens(token_ids, t.block_size, lora_name)
        elif sequence_hashes is not None and sequence_hashes is not UNSET:
            hashes = sequence_hashes
        else:
            raise ValueError("a prompt needs sequence_hashes or token_ids")
        if len(hashes) > self.max_hashes:
            raise TooManyHashes(len(hashes), self.max_hashes)
        return hashes

    # The lifecycle commands arrive as the HTTP edge decoded them (``kv_slot_tracker.http.fast_bodies``)
    # or built them from the models, and go on to the tracker as they are: an add is the core's
    # struct (``kv_slot_tracker.core.commands.Add``), which ``add_on_rank`` reads itself.

    def add(self, cmd: commands.Add) -> None:
        key = (cmd.model_name, cmd.routing_group)
        registry = self.registry
        # ``registry.get`` written out, as in ``free``: the call cost 2 % of a batch operation
        t = registry.trackers.get(key)
        if t is None:
            raise NoTracker(key)
        selection = self.replica.selection
        if (
            selection is not None
            and selection.tombstones  # none: no call (it cost 0.8 % of a batch operation)
            and selection.released(cmd.request_id, key)
        ):
            # the peers drop this add's record (``released``): refuse it here too, so that
            # every instance agrees (O(1): no lookup while no reservation was released lately)
            raise ReservationReleased(cmd.request_id)
        hashes = cmd.sequence_hashes
        if cmd.token_ids is not None or hashes is None or len(hashes) > self.max_hashes:
            # token ids hashed, a command built in process (UNSET), or refused past the limit;
            # else the hashes are what ``_hashes`` returns for them, without the call
            hashes = self._hashes(t, hashes, cmd.token_ids, cmd.lora_name)
        n = len(hashes)
        now = self.clock()
        usage, budgets = registry.usage, registry.budgets
        if (  # ``registry.over_request_budgets`` written out (2 % of a batch operation)
            usage.requests >= budgets.active_requests
            or usage.hashes + n > budgets.block_hashes
            or now >= registry.memory_due
        ):
            registry.admit_request(n, now)
        t.add_on_rank(cmd, hashes, now)

    def prefill_complete(self, cmd: commands.PrefillComplete) -> None:
        t = self.registry.get((cmd.model_name, cmd.routing_group))
        t.mark_prefill_completed(cmd.request_id, self.clock())
        if cmd.cached_tokens is not None and self.outcome_sink is not None:
            self.outcome_sink(cmd.key, cmd.request_id, cmd.cached_tokens, False)

    def free(self, cmd: commands.Free) -> None:
        key = (cmd.model_name, cmd.routing_group)
        t = self.registry.trackers.get(key)  # ``registry.get`` written out (``add``)
        if t is None:
            raise NoTracker(key)
        t.free(cmd.request_id, self.clock())
        if cmd.cached_tokens is not None and self.outcome_sink is not None:
            self.outcome_sink(cmd.key, cmd.request_id, cmd.cached_tokens, True)

    def output_block(self, cmd: commands.OutputBlock) -> None:
        t = self.registry.get((cmd.model_name, cmd.routing_group))
        t.add_output_block(cmd.request_id, cmd.decay_fraction)

    def expire(self) -> int:
        """One forced-expiry sweep over every tracker; returns how many requests expired."""
        return sum(
            len(t.force_expire_requests_across_all_workers())
            for t in list(self.registry.trackers.values())
        )

    # -- reads -----------------------------------------------------------------------------

    def rank_loads(
        self, model_name: str | None, routing_group: str | None
    ) -> list[tuple[Key, list[RankLoadRow]]]:
        """Per matching key (sorted): the tracker's ``rank_loads`` rows."""
        now = self.clock()
        trackers = self.registry.trackers
        return [
            (key, trackers[key].rank_loads(now))
            for key in self.registry.matching(model_name, routing_group)
        ]

    def loads(self, model_name: str | None, routing_group: str | None) -> list[dict[str, Any]]:
        """Per rank of the matching keys: its key and its load, the ``RankLoadRow``'s fields."""
        return [
            {"model_name": key[0], "routing_group": key[1], **row._asdict()}
            for key, rows in self.rank_loads(model_name, routing_group)
            for row in rows
        ]

    def potential_loads(self, cmd: commands.PotentialLoads) -> Columns:
        """Per rank, sorted, as parallel lists: the ranks and their potential prefill tokens,
        potential decode blocks and active requests (``tracker.potential_columns``)."""
        t, hashes = self.prompt_hashes(cmd)
        return t.potential_columns(hashes, cmd.new_isl_tokens, self.clock())

    def project_loads(self, cmd: commands.ProjectLoads) -> list[dict[str, Any]]:
        t, hashes = self.prompt_hashes(cmd)
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
        return dict(sorted(self.registry.get(key).get_active_lora_counts().items()))

    # -- replication (the ``ReplicatedState`` of ``kv_slot_tracker.replication``) -------------------------

    def apply_remote(self, records: Batch) -> int:
        return self.replica.apply_remote(records)

    def export_state(self) -> list[dict[str, Any]]:
        return self.replica.export_state()

    def rejections(self) -> tuple[dict[str, int], int | None]:
        return dict(self.replica.rejected), self.replica.last_rejected_ns

    def export_early(self) -> list[list[Any]]:
        return self.replica.export_early()

    def export_selection(self) -> dict[str, Any] | None:
        return self.replica.export_selection()

    def restore_state(
        self,
        trackers: list[dict[str, Any]],
        early: list[list[Any]] | None = None,
        selection: dict[str, Any] | None = None,
    ) -> None:
        self.replica.restore_state(trackers, early, selection)
