"""The selection service: Dynamo's worker selection on top of the slot trackers.

``SelectionService`` owns the worker catalog, one approximate cache per partition
``(model_name, routing_group)`` and the pending-selection cache; the load of every rank
(prefill tokens, active blocks, active requests) lives in the SAME ``TrackerRegistry`` the
slot-tracker routes use. A schedulable worker's ranks are registered in its partition's tracker
and a reservation is a request of that tracker (its id is the selection id), so ``/loads``,
``/metrics`` and the live page show reservations like any other request.

Every public method first decides (checks in the reference's order, the random pick, a generated
id) and raises domain errors (``kv_slot_tracker.core.selection.errors``, ``kv_slot_tracker.service.errors``) without
changing anything; then it changes state only through ``commit`` with one record of
``kv_slot_tracker.service.selection.mutations`` (a reservation id found holding no request any more
is dropped by ``reservations`` on the way: derived state, shared by no record). ``commit`` is also the one place selection state is
published to the other instances from: the catalog, reservations, approximate caches and pending
selections are shared like the trackers.

Its collaborators, each holding a part and working on the service through its public API:
``placement`` (``WorkerPlacement``: the catalog's changes and where its workers' ranks sit),
``bookings`` (``Bookings``: a reservation booked, then its calls to its release),
``reservations`` (``Reservations``: the reservation ids), ``replica`` (``SelectionReplica``: the
records shared with the other instances and the snapshots), ``kv_events`` (``KvEvents``: the
KV-event ingest's sink, into the partitions' indexes) and ``receipt_keeper`` (``ReceiptKeeper``:
the routing receipts, when they are on). The catalog's and the reservations' calls are the
service's methods handing them to the placement and the bookings: their callers (the HTTP
edge, discovery) know the service only.

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

from kv_slot_tracker.core.selection import (
    Prompt,
    RouterConfig,
    effective_prefill_tokens,
    normalize_prompt,
)
from kv_slot_tracker.core.selection.approx_cache import StoredRun, cache_chain
from kv_slot_tracker.core.selection.catalog import WorkerRecord
from kv_slot_tracker.core.selection.errors import (
    NoSchedulableWorkers,
    NoSchedulableWorkersAvailable,
    SessionBoundElsewhere,
)
from kv_slot_tracker.core.selection.kv_blocks import LOWER_TIERS, TIER_NAMES
from kv_slot_tracker.core.selection.pending import DEFAULT_MAX_BYTES as PENDING_MAX_BYTES
from kv_slot_tracker.core.selection.pending import PendingSelections
from kv_slot_tracker.core.selection.receipt_ring import ReceiptRing
from kv_slot_tracker.core.selection.receipts import Receipt
from kv_slot_tracker.core.selection.selector import Selection, select_columns
from kv_slot_tracker.core.selection.sessions import SessionAffinity
from kv_slot_tracker.core.sequences import EXPIRY_DURATION_NS
from kv_slot_tracker.core.types import WorkerWithDpRank
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.errors import TooManyHashes
from kv_slot_tracker.service.registry import TrackerRegistry
from kv_slot_tracker.service.selection import commands, mutations
from kv_slot_tracker.service.selection.bookings import Bookings
from kv_slot_tracker.service.selection.kv_events import KvEvents
from kv_slot_tracker.service.selection.placement import WorkerPlacement
from kv_slot_tracker.service.selection.receipt_keeper import ReceiptKeeper, decision_receipt
from kv_slot_tracker.service.selection.replica import SelectionReplica
from kv_slot_tracker.service.selection.reservations import Reservations
from kv_slot_tracker.service.selection.tombstones import DEFAULT_CAPACITY as TOMBSTONE_CAPACITY
from kv_slot_tracker.service.selection.tombstones import DEFAULT_MAX_BYTES as TOMBSTONE_MAX_BYTES
from kv_slot_tracker.service.selection.tombstones import ReservationTombstones
from kv_slot_tracker.service.selection.types import (
    Booked,
    Candidates,
    LoadRow,
    OverlapScores,
    Partition,
    SelectionCounters,
    SelectOutcome,
    WorkerLoad,
)

log = logging.getLogger(__name__)

# What the reference reports as a rank's prefill capacity when the worker declared none.
DEFAULT_PREFILL_TOKEN_CAPACITY = 10_000_000


class SelectionService:
    def __init__(
        self,
        registry: TrackerRegistry,
        *,
        config: RouterConfig | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        rng: random.Random | None = None,
        pending_max_entries: int = 100_000,
        pending_ttl_ns: int = 120_000_000_000,
        pending_max_bytes: int = PENDING_MAX_BYTES,
        max_hashes_per_request: int = 1_048_576,
        session_affinity_ttl_ns: int = 0,
        session_affinity_max_entries: int = 100_000,
        tombstone_ttl_ns: int = EXPIRY_DURATION_NS,
        tombstone_capacity: int = TOMBSTONE_CAPACITY,
        tombstone_max_bytes: int = TOMBSTONE_MAX_BYTES,
        receipts: ReceiptRing | None = None,
        wall_clock: Callable[[], float] = time.time,
        instance: str = "",
    ) -> None:
        self.registry = registry
        registry.catalog_size = lambda: len(self.catalog)
        self.config = config or RouterConfig()
        self.clock = clock
        self.rng = rng or random.Random()
        self.max_hashes = max_hashes_per_request
        self.pending = PendingSelections(pending_max_entries, pending_ttl_ns, pending_max_bytes)
        self.partitions: dict[Key, Partition] = {}
        self.catalog: dict[int, WorkerRecord] = {}
        self.placement = WorkerPlacement(self)
        """Checks and applies the catalog's changes, and places its workers' ranks."""
        self.reservations = Reservations(
            registry,
            ReservationTombstones(tombstone_ttl_ns, tombstone_capacity, tombstone_max_bytes),
        )
        self.bookings = Bookings(self)
        """Books reservations and takes their calls, to their release (``bookings``)."""
        self._evictions_logged = 0
        self.counters = SelectionCounters()
        self.sessions = (
            SessionAffinity(session_affinity_ttl_ns, session_affinity_max_entries)
            if session_affinity_ttl_ns > 0
            else None
        )
        """Sessions bound to workers (off when the TTL is 0); kept per instance."""
        self.replica = SelectionReplica(self)
        self.kv_events = KvEvents(self, enabled=self.config.use_kv_events)
        self.receipts = receipts
        """Routing receipts of this instance's own selections (None: off); not replicated."""
        self.wall_clock = wall_clock
        self.instance = instance
        """This instance's name in a receipt (receipts stay on the instance that decided)."""
        self.receipt_keeper = (
            ReceiptKeeper(receipts, self.config, clock, wall_clock)
            if receipts is not None
            else None
        )
        """Keeps and follows the receipts (``receipt_keeper``): None when they are off."""
        self._explain_rng = random.Random()
        if self.receipt_keeper is not None and self.config.use_kv_events:
            self.kv_events.storing_hook = self.receipt_keeper.kv_storing

    # -- the one mutation entry point ------------------------------------------------------

    def commit(self, mutation: mutations.Mutation) -> None:
        """Apply one change to the selection state, then publish it to the other instances."""
        self.apply(mutation, self.clock())
        self.replica.send(mutation)

    def apply(self, mutation: mutations.Mutation, now: int) -> None:
        """Apply one change at ``now``, publishing nothing (``commit`` publishes it; the
        replica applies a peer's change through here): a reservation's by ``bookings``, the
        catalog's by ``placement``."""
        if isinstance(mutation, mutations.Book):
            self.bookings.apply_book(mutation, now)
        elif isinstance(mutation, mutations.Release):
            self.bookings.apply_release(mutation, now)
        elif isinstance(mutation, mutations.CacheSelection):
            self.pending.put(mutation.selection_id, mutation.entry, now)
        elif isinstance(mutation, mutations.CompletePrefill):
            self.bookings.apply_prefill_complete(mutation, now)
        elif isinstance(mutation, mutations.AddOutputBlock):
            self.bookings.apply_output_block(mutation)
        elif isinstance(mutation, mutations.PutWorker):
            self.placement.put(mutation.spec)
        elif isinstance(mutation, mutations.RemoveWorker):
            self.placement.remove(mutation.worker_id)
        else:  # pragma: no cover - the union is closed
            raise TypeError(f"unknown mutation {mutation!r}")

    # -- the worker catalog and reservations (``placement``, ``bookings``) ----------------

    def upsert_worker(self, cmd: commands.UpsertWorker) -> WorkerRecord:
        return self.placement.upsert(cmd)

    def patch_worker(self, cmd: commands.PatchWorker) -> WorkerRecord:
        return self.placement.patch(cmd)

    def delete_worker(self, cmd: commands.DeleteWorker) -> WorkerRecord:
        return self.placement.delete(cmd)

    def workers(self, model_name: str | None, routing_group: str | None) -> list[WorkerRecord]:
        return self.placement.records_of(model_name, routing_group)

    def replace_catalog(
        self, catalog: dict[int, WorkerRecord], partitions: dict[Key, Partition]
    ) -> None:
        self.placement.replace(catalog, partitions)

    def replay(self, cmd: commands.ReplaySelection) -> Booked:
        return self.bookings.replay(cmd)

    def book(self, cmd: commands.BookExplicit) -> Booked:
        return self.bookings.book(cmd)

    def prefill_complete(self, cmd: commands.ReservationCall) -> None:
        self.bookings.prefill_complete(cmd)

    def output_block(self, cmd: commands.ReservationOutputBlock) -> None:
        self.bookings.output_block(cmd)

    def release(self, cmd: commands.ReservationCall) -> None:
        self.bookings.release(cmd)

    def request_outcome(self, key: Key, request_id: str, cached_tokens: int, freed: bool) -> None:
        self.bookings.request_outcome(key, request_id, cached_tokens, freed)

    # -- prompts and candidates ------------------------------------------------------------

    def _config_for(self, cmd: commands.PromptCommand) -> RouterConfig:
        """The knobs for one request: as in the reference (1.6.1), a request's override is
        validated but only its ``track_prefill_tokens`` takes effect."""
        override = cmd.router_config_override
        track = override.track_prefill_tokens if override is not None else None
        if track is None or track == self.config.track_prefill_tokens:
            return self.config
        return replace(self.config, track_prefill_tokens=track)

    def partition(self, key: Key) -> Partition:
        """The partition ``key`` while it has a schedulable worker (the reference's 503
        otherwise)."""
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

    def prompt_of(
        self,
        cmd: commands.PromptCommand,
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
            cache_salt=cmd.cache_salt,
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
            keys = chain or prompt.precomputed_chain
            found = part.index.overlaps(keys, blocks) if keys else {}
            over = {w: o.device for w, o in found.items()}
            tiers = {
                w: (o.host_extension, o.disk_extension)
                for w, o in found.items()
                if o.host_extension or o.disk_extension
            }
        else:
            over = part.cache.overlaps(blocks, now, chain=chain or prompt.precomputed_chain)
        known = part.workers
        if not t.registered_worker_ids() <= known.keys():
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

    def select(self, cmd: commands.Select) -> SelectOutcome:
        """``/select`` and ``/select_and_reserve``: pick a rank (and book it when reserving)."""
        key = cmd.key
        part = self.partition(key)
        sid = cmd.selection_id
        if cmd.reserve:
            if sid is None:
                sid = self.new_selection_id()
            self.reservations.check_free(sid, key, self.clock())
        prompt, config, now, chain, candidates, session, bound, by_session, chosen = self._decide(
            cmd, part, self.rng
        )
        track = config.track_prefill_tokens
        worker = chosen.worker
        if cmd.reserve and bound is not None and worker.worker_id != bound:
            assert session is not None
            raise SessionBoundElsewhere(session, bound, worker.worker_id)
        spec = part.workers[worker.worker_id]
        ept = chosen.effective_prefill_tokens
        if cmd.reserve:
            assert sid is not None
            self.bookings.book_prompt(
                sid,
                key,
                worker,
                prompt,
                prefill_tokens=ept if track else 0,
                expected_output_tokens=cmd.expected_output_tokens,
                lora_name=cmd.lora_name,
                cache_chain=chain,
                consumes_pending=False,
                session_id=session,
            )
        elif sid is not None:
            self.bookings.cache_selection(cmd, sid, worker, prompt, ept, track)
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
        keeper = self.receipt_keeper
        if keeper is not None:
            keeper.selected(
                cmd, part, prompt, config, now, candidates, chosen, sid, session, bound,
                by_session, chain,
            )  # fmt: skip
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

    def _decide(self, cmd: commands.Select, part: Partition, rng: random.Random) -> tuple[
        Prompt, RouterConfig, int, tuple[int, ...] | None, Candidates, str | None, int | None,
        bool, Selection,
    ]:  # fmt: skip
        """The decision of ``select`` (nothing changed): the prompt, knobs, instant, cache
        keys, candidates, the session, the worker it is bound to, whether that restricted the
        candidates, and the selection."""
        key = cmd.key
        prompt = self.prompt_of(cmd, part.block_size, for_booking=False)
        config = self._config_for(cmd)
        now = self.clock()
        chain = cache_chain(prompt)
        candidates = self._candidates(part, prompt, now, chain)
        if not candidates.workers:
            raise self._no_workers(key)
        session = cmd.session_id if self.sessions is not None else None
        bound = None
        by_session = False
        allowed = cmd.allowed_worker_ids
        if session is not None and cmd.pinned_worker is None:
            assert self.sessions is not None
            bound = self.sessions.bound(session, now)
            if bound is not None and bound not in part.workers:
                bound = None  # its worker left the partition: chosen as without a session
            if bound is not None and (allowed is None or bound in allowed):
                allowed = [bound]
                by_session = True
        chosen = select_columns(
            *candidates[:5],
            lower=candidates.lower,
            isl_tokens=prompt.isl_tokens,
            block_size=part.block_size,
            num_sequence_hashes=len(prompt.sequence_hashes),
            config=config,
            rng=rng,
            pinned_worker=cmd.pinned_worker,
            allowed_worker_ids=allowed,
            grouped=True,  # the tracker lists ranks sorted
        )
        return prompt, config, now, chain, candidates, session, bound, by_session, chosen

    def explain(self, cmd: commands.Select) -> Receipt:
        """The receipt ``cmd`` would get, changing nothing: no booking, no pending selection,
        no session binding, no receipt kept, no counter, and the service's random stream is
        left alone (ties and temperature draw from a generator of their own)."""
        part = self.partition(cmd.key)
        prompt, config, now, _, candidates, session, bound, by_session, chosen = self._decide(
            cmd, part, self._explain_rng
        )
        return decision_receipt(
            self.wall_clock(), cmd, part, prompt, config, now, candidates, chosen,
            cmd.selection_id or "explain",
            "explain", session, bound, by_session,
        )  # fmt: skip

    def potential_loads(self, cmd: commands.PotentialLoads) -> list[LoadRow]:
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

    def overlap_scores(self, cmd: commands.OverlapScores) -> OverlapScores:
        """Every candidate rank's cached prefix of the prompt, and also any other rank the
        approximate cache still holds it on (a rank removed from a worker keeps its blocks until
        they expire), sorted: the reference lists both."""
        part, prompt, candidates = self._query(cmd)
        blocks = prompt.block_hashes or ()
        rows = dict(zip(candidates.workers, candidates.overlap, strict=True))
        extensions: dict[tuple[int, int], tuple[int, int]] = {}
        if blocks and self.config.use_kv_events:
            keys = prompt.precomputed_chain
            # the index's ranks outside the candidates too (a batch may name a rank the worker
            # did not declare: the reference indexes and lists it)
            for w, o in (part.index.overlaps(keys, blocks) if keys else {}).items():
                rows[w] = o.device
                if o.host_extension or o.disk_extension:
                    extensions[w.worker_id, w.dp_rank] = (o.host_extension, o.disk_extension)
        elif blocks:
            now = self.clock()
            for w, k in part.cache.overlaps(blocks, now, chain=prompt.precomputed_chain).items():
                rows.setdefault(w, k)
        return OverlapScores(
            part.block_size,
            len(blocks),
            [(w.worker_id, w.dp_rank, k) for w, k in sorted(rows.items())],
            extensions,
        )

    def _query(self, cmd: commands.PromptCommand) -> tuple[Partition, Prompt, Candidates]:
        part = self.partition(cmd.key)
        prompt = self.prompt_of(cmd, part.block_size, for_booking=False)
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
        the index as the reference dumps it: the device tree's chains, then each host, disk and
        external block as a run of its own under its engine parent, with its tier."""
        now = self.clock()
        if self.config.use_kv_events:
            out = []
            for key, part in sorted(self.partitions.items()):
                index = part.index
                runs = [
                    StoredRun(c.worker, c.parent_hash, c.blocks, TIER_NAMES[c.tier])
                    for c in index.device_runs()
                ]
                for tier in LOWER_TIERS:
                    runs += [
                        StoredRun(c.worker, c.parent_hash, c.blocks, TIER_NAMES[c.tier])
                        for c in index.lower_blocks(tier)
                    ]
                out.append((key, part.block_size, runs))
            return out
        return [
            (key, part.block_size, list(part.cache.stored_runs(now)))
            for key, part in sorted(self.partitions.items())
        ]

    def schedulable_count(self) -> int:
        """Schedulable workers in the catalog, all partitions."""
        return self.placement.schedulable

    def placed_partition(self, worker_id: int) -> Partition | None:
        """The partition ``worker_id`` is a schedulable worker of, if any."""
        record = self.catalog.get(worker_id)
        if record is None or not record.schedulable:
            return None
        part = self.partitions.get(record.spec.key)
        if part is None or worker_id not in part.workers:
            return None
        return part

    # -- background ------------------------------------------------------------------------

    def sweep(self) -> int:
        """Expire pending selections and cached blocks, and drop reservation ids that hold no
        request any more; returns how many entries went. Runs with the expiry sweep."""
        now = self.clock()
        n = self.pending.expire(now)
        for part in self.partitions.values():
            n += part.cache.expire(now)
        n += self.reservations.sweep(now)
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
