"""The selection service: Dynamo's worker selection on top of the slot trackers.

``SelectionService`` owns the worker catalog, the reservation ids, one approximate cache per
partition ``(model_name, routing_group)`` and the pending-selection cache; the load of every rank
(prefill tokens, active blocks, active requests) lives in the SAME ``TrackerRegistry`` the
slot-tracker routes use. A schedulable worker's ranks are registered in its partition's tracker
and a reservation is a request of that tracker (its id is the selection id), so ``/loads``,
``/metrics`` and the live page show reservations like any other request.

Every public method first decides (checks in the reference's order, the random pick, a generated
id) and raises domain errors (``kv_slot_tracker.core.selection.errors``, ``kv_slot_tracker.service.errors``) without
changing anything; then it changes state only through ``commit`` with one record of
``kv_slot_tracker.service.selection.mutations``. ``commit`` is also the one place selection state is
published to the other instances from (``kv_slot_tracker.service.selection.replica``): the catalog,
reservations, approximate caches and pending selections are shared like the trackers.

Where the slot-tracker API and this one differ (SELECTION.md §2): a partition stays listed here,
with its block size, after its last worker goes, while the tracker itself is dropped as the
slot-tracker routes expect; the reservation index is global across partitions while tracker
request ids are per tracker; a worker removed through ``/unregister`` stops being a candidate
until it is upserted again through ``/selection/workers``.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from kv_slot_tracker.core.limits import MAX_RANKS_PER_TRACKER
from kv_slot_tracker.core.selection import (
    ApproximateCache,
    Prompt,
    RouterConfig,
    chain_keys,
    effective_prefill_tokens,
    normalize_prompt,
)
from kv_slot_tracker.core.selection.approx_cache import StoredRun
from kv_slot_tracker.core.selection.catalog import (
    INCOMPLETE,
    MAX_DP_SIZE,
    SCHEDULABLE,
    WorkerRecord,
    WorkerSpec,
    block_size_mismatch,
    intrinsic_reasons,
    patched,
)
from kv_slot_tracker.core.selection.errors import (
    CatalogWorkerNotFound,
    NoSchedulableWorkers,
    NoSchedulableWorkersAvailable,
    SessionBoundElsewhere,
)
from kv_slot_tracker.core.selection.kv_index import TIER_NAMES, local_hashes
from kv_slot_tracker.core.selection.pending import PendingSelection, PendingSelections
from kv_slot_tracker.core.selection.selector import select_columns
from kv_slot_tracker.core.selection.sessions import SessionAffinity
from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.ingest.port import IndexedPartition, RankKey, Subscription
from kv_slot_tracker.ingest.records import AllCleared, BlocksRemoved, BlocksStored, KvBatch
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.errors import TooManyHashes, TooManyTrackers
from kv_slot_tracker.service.registry import TrackerRegistry
from kv_slot_tracker.service.selection import commands as sc
from kv_slot_tracker.service.selection import mutations as m
from kv_slot_tracker.service.selection.replica import SelectionReplicaMixin
from kv_slot_tracker.service.selection.reservations import ReservationsMixin
from kv_slot_tracker.service.selection.types import (
    SELECTION_OUTCOMES,
    Candidates,
    LoadRow,
    OverlapScores,
    Partition,
    Reservation,
    SelectionCounters,
    SelectOutcome,
    WorkerLoad,
)

log = logging.getLogger(__name__)

# What the reference reports as a rank's prefill capacity when the worker declared none.
DEFAULT_PREFILL_TOKEN_CAPACITY = 10_000_000

# Most ranks one tracker may hold (the slot-tracker routes' limit).
MAX_RANKS_PER_PARTITION = MAX_RANKS_PER_TRACKER


class SelectionService(ReservationsMixin, SelectionReplicaMixin):
    def __init__(
        self,
        registry: TrackerRegistry,
        *,
        config: RouterConfig | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        rng: random.Random | None = None,
        pending_max_entries: int = 100_000,
        pending_ttl_ns: int = 120_000_000_000,
        max_hashes_per_request: int = 1_048_576,
        session_affinity_ttl_ns: int = 0,
        session_affinity_max_entries: int = 100_000,
    ) -> None:
        self.registry = registry
        self.config = config or RouterConfig()
        self.clock = clock
        self.rng = rng or random.Random()
        self.max_hashes = max_hashes_per_request
        self.pending = PendingSelections(pending_max_entries, pending_ttl_ns)
        self.partitions: dict[Key, Partition] = {}
        self.catalog: dict[int, WorkerRecord] = {}
        self.reservations: dict[str, Reservation] = {}
        self.held: dict[tuple[Key, bool], int] = {}
        """Reservation ids per ``(partition, lingering)``, kept as they change (for metrics)."""
        self._reservations_of: dict[int, set[str]] = {}
        self._schedulable = 0  # schedulable workers in the catalog
        self.lingering_dropped = 0
        """Lingering reservation ids dropped by the sweep after the request expiry (counted)."""
        self.stale_dropped = 0
        """Reservation ids whose request was freed elsewhere (slot routes, expiry), dropped."""
        self._evictions_logged = 0
        self.counters = SelectionCounters()
        self.sessions = (
            SessionAffinity(session_affinity_ttl_ns, session_affinity_max_entries)
            if session_affinity_ttl_ns > 0
            else None
        )
        """Sessions bound to workers (off when the TTL is 0); kept per instance."""
        self._kv_version = 0  # bumped whenever the wanted KV-event subscriptions may change
        self._kv_epochs: dict[int, int] = {}  # worker id -> times it left its partition
        self.kv_stores_refused = 0
        """KV-event stores skipped: parent unknown on the rank, or a hash repeated."""
        self.kv_events_unrouted = 0
        """KV events for a worker or rank that is not (or no longer) schedulable here."""

    # -- the one mutation entry point ------------------------------------------------------

    def commit(self, mutation: m.Mutation) -> None:
        """Apply one change to the selection state, then publish it to the other instances."""
        now = self.clock()
        if isinstance(mutation, m.Book):
            self._apply_book(mutation, now)
        elif isinstance(mutation, m.Release):
            self._apply_release(mutation, now)
        elif isinstance(mutation, m.CacheSelection):
            self.pending.put(mutation.selection_id, mutation.entry, now)
        elif isinstance(mutation, m.CompletePrefill):
            res = self.reservations[mutation.selection_id]
            self.registry.get(res.key).mark_prefill_completed(mutation.selection_id, now)
        elif isinstance(mutation, m.AddOutputBlock):
            res = self.reservations[mutation.selection_id]
            self.registry.get(res.key).add_output_block(
                mutation.selection_id, mutation.decay_fraction
            )
        elif isinstance(mutation, m.Forget):
            self._forget(mutation.selection_id)
        elif isinstance(mutation, m.PutWorker):
            self._apply_put_worker(mutation.spec)
        elif isinstance(mutation, m.RemoveWorker):
            self._apply_remove_worker(mutation.worker_id)
        else:  # pragma: no cover - the union is closed
            raise TypeError(f"unknown mutation {mutation!r}")
        self._publish(mutation)

    # -- the worker catalog ----------------------------------------------------------------

    def upsert_worker(self, cmd: sc.UpsertWorker) -> WorkerRecord:
        self.commit(m.PutWorker(cmd.spec))
        return self.catalog[cmd.spec.worker_id]

    def patch_worker(self, cmd: sc.PatchWorker) -> WorkerRecord:
        record = self.catalog.get(cmd.worker_id)
        if record is None:
            raise CatalogWorkerNotFound(cmd.worker_id)
        self.commit(m.PutWorker(patched(record.spec, cmd.changes)))
        return self.catalog[cmd.worker_id]

    def delete_worker(self, cmd: sc.DeleteWorker) -> WorkerRecord:
        record = self.catalog.get(cmd.worker_id)
        if record is None:
            raise CatalogWorkerNotFound(cmd.worker_id)
        self.commit(m.RemoveWorker(cmd.worker_id))
        return WorkerRecord(record.spec, "unschedulable")

    def workers(self, model_name: str | None, routing_group: str | None) -> list[WorkerRecord]:
        """Catalog records, sorted by partition then id, optionally filtered."""
        return [
            r
            for r in sorted(self.catalog.values(), key=_record_order)
            if (model_name is None or r.spec.model_name == model_name)
            and (routing_group is None or r.spec.routing_group == routing_group)
        ]

    def schedulable_count(self) -> int:
        return self._schedulable

    def _existing_block_size(self, key: Key) -> int | None:
        t = self.registry.find(key)
        if t is not None:
            return t.block_size
        part = self.partitions.get(key)
        return part.block_size if part is not None else None

    def _reasons(self, spec: WorkerSpec, placed_here: int) -> list[str]:
        """Why ``spec`` cannot be placed; ``placed_here`` = its ranks already in that tracker."""
        reasons = intrinsic_reasons(spec)
        if self.config.use_kv_events and spec.dp_size <= MAX_DP_SIZE:
            endpoints = kv_endpoints(spec)
            reasons += [
                f"kv_events endpoint is required for dp_rank {rank}"
                for rank in range(spec.dp_start, spec.dp_start + spec.dp_size)
                if not endpoints.get(rank)
            ]
        if reasons:
            return reasons
        assert spec.block_size is not None
        existing = self._existing_block_size(spec.key)
        if existing is not None and existing != spec.block_size:
            return [block_size_mismatch(spec.key, existing, spec.block_size)]
        t = self.registry.find(spec.key)
        if t is None:
            try:
                self.registry.check_room(spec.key)
            except TooManyTrackers as e:
                return [str(e)]
            if not self._room_for_partition(spec.key):
                return [
                    f"too many partitions: this instance already holds "
                    f"{self.registry.max_trackers} (max_trackers)"
                ]
        ranks = (t.num_workers() if t is not None else 0) - placed_here + spec.dp_size
        if ranks > MAX_RANKS_PER_PARTITION:
            return [
                f"reconciliation failed: too many ranks for model={spec.model_name} "
                f"routing_group={spec.routing_group}: {ranks} > {MAX_RANKS_PER_PARTITION}"
            ]
        return []

    def _set_record(self, worker_id: int, record: WorkerRecord | None) -> None:
        old = self.catalog.get(worker_id)
        self._schedulable -= old is not None and old.schedulable
        if record is None:
            self.catalog.pop(worker_id, None)
        else:
            self.catalog[worker_id] = record
            self._schedulable += record.schedulable

    def _apply_put_worker(self, spec: WorkerSpec) -> None:
        old = self.catalog.get(spec.worker_id)
        old_spec = old.spec if old is not None and old.schedulable else None
        same_place = old_spec is not None and old_spec.key == spec.key
        placed_here = old_spec.dp_size if same_place and old_spec is not None else 0
        reasons = self._reasons(spec, placed_here)
        if reasons:
            if old_spec is not None:
                self._unplace(old_spec)
            self._set_record(spec.worker_id, WorkerRecord(spec, INCOMPLETE, tuple(reasons)))
        else:
            if old_spec is not None and not same_place:
                self._unplace(old_spec)
            self._place(spec)
            self._set_record(spec.worker_id, WorkerRecord(spec, SCHEDULABLE))

    def _apply_remove_worker(self, worker_id: int) -> None:
        record = self.catalog[worker_id]
        self._set_record(worker_id, None)
        if record.schedulable:
            self._unplace(record.spec)

    def _unused_partition(self) -> Key | None:
        """A partition no catalog worker names and no reservation is held in, if any. Such a
        partition stays listed, as the reference lists it after its last worker goes, until
        its place is needed (``_room_for_partition``)."""
        named = {r.spec.key for r in self.catalog.values()}
        held = {key for key, _ in self.held}
        for key, part in self.partitions.items():  # oldest first
            if not part.workers and key not in named and key not in held:
                return key
        return None

    def _room_for_partition(self, key: Key) -> bool:
        """Whether a partition for ``key`` exists or may be made (an unused one is dropped,
        with its series, to make room beyond ``max_trackers``). O(catalog + partitions), only
        when a new partition meets the limit."""
        if key in self.partitions or len(self.partitions) < self.registry.max_trackers:
            return True
        unused = self._unused_partition()
        if unused is None:
            return False
        del self.partitions[unused]
        made = self.counters.made
        for outcome in SELECTION_OUTCOMES:
            made.pop((unused, outcome), None)
        return True

    def _place(self, spec: WorkerSpec) -> None:
        """Register (or re-range) a schedulable worker's ranks in its partition's tracker."""
        self._kv_version += 1
        key = spec.key
        assert spec.block_size is not None
        t = self.registry.find(key)
        if t is None:
            t = self.registry.create(key, spec.block_size)
        change = t.upsert_worker(spec.dp_range)
        part = self.partitions.get(key)
        if part is None:
            part = self.partitions[key] = Partition(
                key, t.block_size, ApproximateCache(self.config.router_ttl_ns)
            )
        part.block_size = t.block_size
        part.workers[spec.worker_id] = spec
        if change.removed:
            for w in change.removed:
                part.index.clear_rank(w)
            self._orphan(spec.worker_id, {w.dp_rank for w in change.removed})

    def _unplace(self, spec: WorkerSpec) -> None:
        """Take a worker off its partition: ranks, their requests and its cached blocks."""
        key = spec.key
        t = self.registry.find(key)
        if t is not None and t.has_worker(spec.worker_id):
            t.unregister_worker(spec.worker_id)
            self.registry.drop_if_empty(key)
        part = self.partitions.get(key)
        if part is not None:
            part.workers.pop(spec.worker_id, None)
            part.cache.remove_worker(spec.worker_id)
            part.index.remove_worker(spec.worker_id)
        self._kv_version += 1
        self._kv_epochs[spec.worker_id] = self._kv_epochs.get(spec.worker_id, 0) + 1
        self._orphan(spec.worker_id, None)

    def _orphan(self, worker_id: int, ranks: set[int] | None) -> None:
        """Mark the reservations of ``worker_id`` (on ``ranks``, or all) as lingering."""
        ids = self._reservations_of.get(worker_id)
        if not ids:
            return
        for sid in list(ids):
            res = self.reservations[sid]
            if ranks is None or res.worker.dp_rank in ranks:
                self._count(res, -1)
                res.lingering = True
                self._count(res, 1)
                ids.discard(sid)
        if not ids:
            del self._reservations_of[worker_id]

    # -- prompts and candidates ------------------------------------------------------------

    def _config_for(self, cmd: sc.PromptCommand) -> RouterConfig:
        """The knobs for one request: as in the reference (1.6.1), a request's override is
        validated but only its ``track_prefill_tokens`` takes effect."""
        override = cmd.router_config_override
        track = override.track_prefill_tokens if override is not None else None
        if track is None or track == self.config.track_prefill_tokens:
            return self.config
        return replace(self.config, track_prefill_tokens=track)

    def _partition(self, key: Key) -> Partition:
        part = self.partitions.get(key)
        if part is None or not part.workers:
            raise self._no_workers(key)
        return part

    def _no_workers(self, key: Key) -> Exception:
        """The reference's 503: its text names the partition only while some other partition
        has a schedulable worker."""
        if self.schedulable_count() == 0:
            return NoSchedulableWorkersAvailable()
        return NoSchedulableWorkers(*key)

    def _prompt(
        self,
        cmd: sc.PromptCommand,
        block_size: int,
        *,
        for_booking: bool,
        block_hashes: bool = True,
    ) -> Prompt:
        """The command's prompt (SELECTION.md §3); ``block_hashes=False`` ignores them."""
        prompt = normalize_prompt(
            block_size=block_size,
            token_ids=cmd.token_ids,
            block_hashes=cmd.block_hashes if block_hashes else None,
            sequence_hashes=cmd.sequence_hashes,
            isl_tokens=cmd.isl_tokens,
            lora_name=cmd.lora_name,
            for_booking=for_booking,
        )
        n = len(prompt.sequence_hashes)
        if n > self.max_hashes:
            raise TooManyHashes(n, self.max_hashes)
        return prompt

    def _candidates(
        self, part: Partition, prompt: Prompt, now: int, chain: tuple[int, ...] | None = None
    ) -> Candidates:
        """Every placed rank of the partition's schedulable workers, with its load and overlap,
        as columns (``chain``: the prompt's approximate-cache keys, when already known)."""
        t = self.registry.find(part.key)
        if t is None:
            return Candidates([], [], [], [], [])
        workers, prefill, decode, requests = t.load_columns(list(prompt.sequence_hashes), now)
        blocks = prompt.block_hashes
        tiers = None
        if not blocks:
            over: dict[WorkerWithDpRank, int] = {}
        elif self.config.use_kv_events:
            keys = chain or prompt.cache_chain
            found = part.index.overlaps(keys) if keys else {}
            over = {w: o.device for w, o in found.items()}
            tiers = {
                w: (o.host_extension, o.disk_extension)
                for w, o in found.items()
                if o.host_extension or o.disk_extension
            }
        else:
            over = part.cache.overlaps(blocks, now, chain=chain or prompt.cache_chain)
        known = part.workers
        if not t.table.ranges.keys() <= known.keys():
            # ranks the slot-tracker routes registered are not candidates of the selection API
            keep = [i for i, w in enumerate(workers) if w.worker_id in known]
            workers = [workers[i] for i in keep]
            prefill = [prefill[i] for i in keep]
            decode = [decode[i] for i in keep]
            requests = [requests[i] for i in keep]
        get = over.get
        lower = None
        if tiers:
            none = (0, 0)
            lower = [tiers.get(w, none) for w in workers]
        return Candidates(workers, prefill, decode, requests, [get(w, 0) for w in workers], lower)

    # -- selection -------------------------------------------------------------------------

    def new_selection_id(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    def select(self, cmd: sc.Select) -> SelectOutcome:
        """``/select`` and ``/select_and_reserve``: pick a rank (and book it when reserving)."""
        key = cmd.key
        part = self._partition(key)
        sid = cmd.selection_id
        if cmd.reserve:
            if sid is None:
                sid = self.new_selection_id()
            self._check_free(sid, key)
        prompt = self._prompt(cmd, part.block_size, for_booking=False)
        config = self._config_for(cmd)
        track = config.track_prefill_tokens
        now = self.clock()
        chain = cache_chain(prompt)
        candidates = self._candidates(part, prompt, now, chain)
        if not candidates.workers:
            raise self._no_workers(key)
        session = cmd.session_id if self.sessions is not None else None
        bound = None
        allowed = cmd.allowed_worker_ids
        if session is not None and cmd.pinned_worker is None:
            assert self.sessions is not None
            bound = self.sessions.bound(session, now)
            if bound is not None and bound not in part.workers:
                bound = None  # its worker left the partition: chosen as without a session
            if bound is not None and (allowed is None or bound in allowed):
                allowed = [bound]
        chosen = select_columns(
            *candidates[:5],
            lower=candidates.lower,
            isl_tokens=prompt.isl_tokens,
            block_size=part.block_size,
            num_sequence_hashes=len(prompt.sequence_hashes),
            config=config,
            rng=self.rng,
            pinned_worker=cmd.pinned_worker,
            allowed_worker_ids=allowed,
            grouped=True,  # the tracker lists ranks sorted
        )
        worker = chosen.worker
        if cmd.reserve and bound is not None and worker.worker_id != bound:
            assert session is not None
            raise SessionBoundElsewhere(session, bound, worker.worker_id)
        spec = part.workers[worker.worker_id]
        ept = chosen.effective_prefill_tokens
        if cmd.reserve:
            assert sid is not None
            self.commit(
                m.Book(
                    selection_id=sid,
                    model_name=key[0],
                    routing_group=key[1],
                    worker=worker,
                    sequence_hashes=prompt.sequence_hashes,
                    block_hashes=prompt.block_hashes,
                    cache_chain=chain,
                    isl_tokens=prompt.isl_tokens,
                    prefill_tokens=ept if track else 0,
                    expected_output_tokens=cmd.expected_output_tokens,
                    lora_name=cmd.lora_name,
                    consumes_pending=False,
                )
            )
        elif sid is not None:
            self.commit(
                m.CacheSelection(
                    sid,
                    PendingSelection(
                        model_name=key[0],
                        routing_group=key[1],
                        worker=worker,
                        sequence_hashes=prompt.sequence_hashes,
                        block_hashes=prompt.block_hashes,
                        isl_tokens=prompt.isl_tokens,
                        effective_prefill_tokens=ept,
                        track_prefill_tokens=track,
                        expected_output_tokens=cmd.expected_output_tokens,
                        lora_name=cmd.lora_name,
                        from_tokens=prompt.from_tokens,
                    ),
                )
            )
        load = None
        if cmd.advisory and not cmd.reserve:  # accepted, but not answered, when reserving
            load = WorkerLoad(
                candidates.prefill[candidates.workers.index(worker)],
                spec.max_num_batched_tokens
                if spec.max_num_batched_tokens is not None
                else DEFAULT_PREFILL_TOKEN_CAPACITY,
                spec.total_kv_blocks,
            )
        if session is not None:
            assert self.sessions is not None
            if cmd.reserve:
                self.sessions.bind(session, worker.worker_id, now)
            else:
                self.sessions.touch(session, now)
        self.counters.count(key, "select_and_reserve" if cmd.reserve else "select")
        return SelectOutcome(
            selection_id=sid,
            model_name=key[0],
            routing_group=key[1],
            endpoint=spec.endpoint or "",
            block_size=part.block_size,
            selection=chosen,
            prompt=prompt,
            track_prefill_tokens=track,
            worker_load=load,
        )

    def potential_loads(self, cmd: sc.PotentialLoads) -> list[LoadRow]:
        """Per candidate rank, sorted: its load if the prompt went there."""
        part, prompt, c = self._query(cmd)
        isl, bs = prompt.isl_tokens, part.block_size
        # without prefill tracking the prompt's own tokens are not added (as in the reference)
        config = self._config_for(cmd)
        track = config.track_prefill_tokens
        lower = c.lower or [(0, 0)] * len(c.workers)
        hw, dw = config.host_cache_hit_weight, config.disk_cache_hit_weight
        return [
            (
                w.worker_id,
                w.dp_rank,
                p
                + (
                    max(0, effective_prefill_tokens(isl, k, bs) - int((hw * h + dw * dd) * bs))
                    if track
                    else 0
                ),
                d,
                a,
            )
            for w, p, d, a, k, (h, dd) in zip(*c[:5], lower, strict=True)
        ]

    def overlap_scores(self, cmd: sc.OverlapScores) -> OverlapScores:
        """Every candidate rank's cached prefix of the prompt, and also any other rank the
        approximate cache still holds it on (a rank removed from a worker keeps its blocks until
        they expire), sorted: the reference lists both."""
        part, prompt, candidates = self._query(cmd)
        blocks = prompt.block_hashes or ()
        rows = dict(zip(candidates.workers, candidates.overlap, strict=True))
        extensions: dict[tuple[int, int], tuple[int, int]] = {}
        if blocks and self.config.use_kv_events:
            keys = prompt.cache_chain
            # the index's ranks outside the candidates too (a batch may name a rank the worker
            # did not declare: the reference indexes and lists it)
            for w, o in (part.index.overlaps(keys) if keys else {}).items():
                rows[w] = o.device
                if o.host_extension or o.disk_extension:
                    extensions[w.worker_id, w.dp_rank] = (o.host_extension, o.disk_extension)
        elif blocks:
            now = self.clock()
            for w, k in part.cache.overlaps(blocks, now, chain=prompt.cache_chain).items():
                rows.setdefault(w, k)
        return OverlapScores(
            part.block_size,
            len(blocks),
            [(w.worker_id, w.dp_rank, k) for w, k in sorted(rows.items())],
            extensions,
        )

    def _query(self, cmd: sc.PromptCommand) -> tuple[Partition, Prompt, Candidates]:
        part = self._partition(cmd.key)
        prompt = self._prompt(cmd, part.block_size, for_booking=False)
        candidates = self._candidates(part, prompt, self.clock())
        if not candidates.workers:
            raise self._no_workers(cmd.key)
        return part, prompt, candidates

    # -- reads -----------------------------------------------------------------------------

    def loads(
        self, model_name: str | None, routing_group: str | None
    ) -> list[tuple[Key, list[LoadRow]]]:
        """Per partition (sorted): the current load of each placed rank."""
        now = self.clock()
        out = []
        for key in sorted(self.partitions):
            if (model_name is not None and key[0] != model_name) or (
                routing_group is not None and key[1] != routing_group
            ):
                continue
            part = self.partitions[key]
            t = self.registry.find(key)
            rows: list[LoadRow] = []
            if t is not None:
                rows = [
                    (wid, rank, tokens, blocks, requests)
                    for wid, rank, tokens, blocks, requests, _ in t.rank_loads(now)
                    if wid in part.workers
                ]
            out.append((key, rows))
        return out

    def dump(self) -> list[tuple[Key, int, list[StoredRun]]]:
        """Every partition's live approximate-cache content, as stored runs; with KV events on,
        every indexed block as a one-block run under its engine parent, with its tier."""
        now = self.clock()
        if self.config.use_kv_events:
            return [
                (
                    key,
                    part.block_size,
                    [
                        StoredRun(
                            b.worker,
                            b.parent_hash,
                            ((b.block_hash, b.tokens_hash),),
                            TIER_NAMES[b.tier],
                        )  # fmt: skip
                        for b in part.index.blocks()
                    ],
                )
                for key, part in sorted(self.partitions.items())
            ]
        return [
            (key, part.block_size, list(part.cache.stored_runs(now)))
            for key, part in sorted(self.partitions.items())
        ]

    # -- KV events (the ingest's sink, kv_slot_tracker.ingest.port.KvEventSink) -------------------------

    @property
    def kv_subscriptions_version(self) -> int:
        return self._kv_version

    def kv_subscriptions(self) -> dict[RankKey, Subscription]:
        """Every rank of every schedulable worker and its engine's publisher (KV events on)."""
        if not self.config.use_kv_events:
            return {}
        out: dict[RankKey, Subscription] = {}
        for part in self.partitions.values():
            for wid, spec in part.workers.items():
                endpoints = kv_endpoints(spec)
                epoch = self._kv_epochs.get(wid, 0)
                for rank in range(spec.dp_start, spec.dp_start + spec.dp_size):
                    endpoint = endpoints.get(rank)
                    if endpoint:
                        out[wid, rank] = Subscription(endpoint, spec.replay_endpoint or None, epoch)
        return out

    def _kv_partition(self, worker_id: int) -> Partition | None:
        record = self.catalog.get(worker_id)
        if record is None or not record.schedulable:
            return None
        part = self.partitions.get(record.spec.key)
        if part is None or worker_id not in part.workers:
            return None
        return part

    def apply_kv_batch(self, worker_id: int, dp_rank: int, batch: KvBatch) -> None:
        """One engine batch into the worker's partition index, in one synchronous call. The
        batch's own ``data_parallel_rank`` wins over the socket's rank (as the reference)."""
        part = self._kv_partition(worker_id)
        if part is None:
            self.kv_events_unrouted += len(batch.events)
            return
        # the batch's rank is indexed even when the worker did not declare it (as the
        # reference); it is listed by /overlap_scores but is no candidate
        rank = WorkerWithDpRank(worker_id, dp_rank if batch.dp_rank is None else batch.dp_rank)
        index, bs = part.index, part.block_size
        for ev in batch.events:
            if isinstance(ev, BlocksStored):
                if ev.tier is None:
                    continue
                locals_ = local_hashes(
                    ev.token_ids, ev.block_size, len(ev.block_hashes), bs, ev.lora_name
                )
                blocks = list(zip(ev.block_hashes, locals_, strict=False))
                if not index.store(rank, ev.tier, ev.parent_hash, blocks):
                    self.kv_stores_refused += 1
            elif isinstance(ev, BlocksRemoved):
                if ev.tier is not None:
                    index.remove(rank, ev.tier, ev.block_hashes)
            elif isinstance(ev, AllCleared):
                index.clear_rank(rank)

    def clear_kv_rank(self, worker_id: int, dp_rank: int) -> None:
        part = self._kv_partition(worker_id)
        if part is not None:
            part.index.clear_rank(WorkerWithDpRank(worker_id, dp_rank))

    def kv_indexed_blocks(self) -> dict[Key, int]:
        return {key: len(part.index) for key, part in self.partitions.items()}

    def kv_partitions(self) -> dict[Key, IndexedPartition]:
        """Every partition's index and schedulable ranks (peer recovery: ``KvIndexHost``)."""
        return {
            key: IndexedPartition(
                part.block_size,
                part.index,
                {w: range(s.dp_start, s.dp_start + s.dp_size) for w, s in part.workers.items()},
            )
            for key, part in self.partitions.items()
        }

    # -- background ------------------------------------------------------------------------

    def sweep(self) -> int:
        """Expire pending selections and cached blocks, and drop reservation ids that hold no
        request any more; returns how many entries went. Runs with the expiry sweep."""
        now = self.clock()
        n = self.pending.expire(now)
        for part in self.partitions.values():
            n += part.cache.expire(now)
        horizon = now - (self.registry.expiry_ns or 0)
        for sid, res in list(self.reservations.items()):
            if res.lingering:
                if self.registry.expiry_ns and res.created_at < horizon:
                    self.lingering_dropped += 1
                    self.commit(m.Forget(sid))
                    n += 1
            elif self._live(sid) is None:
                n += 1
        evicted = self.pending.evicted
        if evicted > self._evictions_logged:
            log.warning(
                "%d pending selections evicted unclaimed since the last sweep (cache full at "
                "%d entries; %d in all)",
                evicted - self._evictions_logged,
                self.pending.max_entries,
                evicted,
            )
            self._evictions_logged = evicted
        return n


def cache_chain(prompt: Prompt) -> tuple[int, ...] | None:
    """The approximate-cache keys of a prompt's blocks: its sequence hashes for a token prompt,
    else the chained block hashes (computed once per request, used by lookup and write)."""
    if prompt.block_hashes is None:
        return None
    if prompt.from_tokens:
        return prompt.sequence_hashes
    return tuple(chain_keys(prompt.block_hashes))


def kv_endpoints(spec: WorkerSpec) -> dict[int, str]:
    """The rank -> publisher map of a worker, as the reference reads it: ``kv_events_endpoints``
    when non-empty (keys are ranks), else ``kv_events_endpoint`` for a worker of one rank."""
    if spec.kv_events_endpoints:
        out = {}
        for rank, endpoint in spec.kv_events_endpoints.items():
            try:
                out[int(rank)] = endpoint
            except ValueError:
                continue
        return out
    if spec.dp_size == 1 and spec.kv_events_endpoint is not None:
        return {spec.dp_start: spec.kv_events_endpoint}
    return {}


def _record_order(r: WorkerRecord) -> tuple[str, str, int]:
    return (r.spec.model_name, r.spec.routing_group, r.spec.worker_id)
