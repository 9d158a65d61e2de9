"""Composition root: ``create_app(settings)`` builds a fresh application with its own service,
replication, metrics registry and background tasks. Nothing lives at module level.

The flow of data runs one way: the HTTP edge (``kv_slot_tracker.http``) turns requests into commands for the
service (``kv_slot_tracker.service``), which calls the pure core (``kv_slot_tracker.core``); the core's replica events
leave through the service to replication (``kv_slot_tracker.replication``), which applies other instances'
records through the service again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import platform
import random
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from kv_slot_tracker import __version__
from kv_slot_tracker.core.limits import Budgets
from kv_slot_tracker.core.selection import RouterConfig
from kv_slot_tracker.core.selection.receipt_ring import ReceiptRing
from kv_slot_tracker.core.types import NS_PER_S
from kv_slot_tracker.discovery.kubernetes import KubernetesDiscovery, require_client
from kv_slot_tracker.dynamo_flags import with_preset
from kv_slot_tracker.http.app import build_http_app
from kv_slot_tracker.ingest.peers import IndexPeers
from kv_slot_tracker.ingest.zmq import ZmqIngest
from kv_slot_tracker.observability.discovery import watch_discovery
from kv_slot_tracker.observability.kv_events import watch_ingest
from kv_slot_tracker.observability.process import MemoryLimitCollector, build_registry
from kv_slot_tracker.observability.selection import watch_selection
from kv_slot_tracker.observability.tracker import watch_consistency, watch_service, watch_status
from kv_slot_tracker.replication import Replication, make_replication
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service.consistency import Consistency
from kv_slot_tracker.service.memory import MemoryWatch, machine_memory_bytes
from kv_slot_tracker.service.selection.service import SelectionService
from kv_slot_tracker.settings import Settings, load_settings, peer_urls

log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None,
    *,
    clock: Callable[[], int] | None = None,
    replication: Replication | None = None,
    wait_ready_s: float = 0.0,
    hub_socket: str | None = None,
) -> FastAPI:
    """``wait_ready_s``: how long the start-up may wait for the replication to be ready (caught
    up with the peers), so that the server accepts connections only then; 0 = listen at once
    and answer 503 "not ready" meanwhile. ``hub_socket``: a ``--workers`` supervisor's hub,
    through which this process shares its state with its siblings (``replication.local``)."""
    settings = settings if settings is not None else load_settings()
    service_kwargs: dict[str, Any] = {}
    if clock is not None:
        service_kwargs["clock"] = clock
    registry = build_registry()
    if replication is None:
        replication = make_replication(settings, registry, hub_socket)
    service = SlotTrackerService(
        expiry_seconds=settings.expiry_seconds,
        expiry_check_seconds=settings.expiry_check_seconds,
        max_hashes_per_request=settings.max_hashes_per_request,
        max_trackers=settings.max_trackers,
        worker_ttl_seconds=settings.worker_ttl_seconds,
        instance_id=replication.instance_id,  # the replication owns the instance id
        replicator=None if replication.mode == "embedded" else replication,
        **service_kwargs,
    )
    service.registry.budgets = budgets_for(settings)
    service.registry.resident = MemoryWatch()
    selection = build_selection(settings, service)
    watch_service(
        registry, service, settings.metrics_max_label_chars, settings.metrics_max_rank_series
    )
    watch_status(registry, replication)
    watch_selection(registry, selection)
    ingest = index_peers = None
    if selection.config.use_kv_events:
        ingest = ZmqIngest(
            selection.kv_events,
            max_message_bytes=settings.kv_events_max_message_bytes,
            replay_timeout=settings.kv_events_replay_timeout_seconds,
            max_batch_blocks=settings.kv_events_max_batch_blocks,
            max_seq_jump=settings.kv_events_max_seq_jump,
            gap_policy=settings.kv_events_gap_policy,
        )
        index_peers = IndexPeers(
            selection.kv_events,
            ingest,
            peer_urls(settings.indexer_peers),
            api_key=settings.api_key.get_secret_value(),
            timeout_s=settings.indexer_peers_timeout_seconds,
        )
        watch_ingest(
            registry, ingest, selection.kv_events, index_peers, settings.kv_events_silent_seconds
        )
    discovery = None
    if settings.discovery_kubernetes_service:
        require_client()  # a clear start-up error when the [kubernetes] extra is missing
        discovery = KubernetesDiscovery.from_settings(settings, service, replication, selection)
        watch_discovery(registry, discovery)
    consistency = None
    if replication.mode != "embedded":
        consistency = make_consistency(settings, service, replication, registry)

    sweeps = SweepRuns()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweepers = [
            asyncio.create_task(
                _expiry_sweeper(service, selection, settings, sweeps), name="expiry-sweep"
            )
        ]
        if settings.worker_ttl_seconds:
            sweepers.append(
                asyncio.create_task(
                    _lease_sweeper(service, replication, settings, sweeps), name="leases"
                )
            )
        await replication.start(service)
        if index_peers is not None:  # loads the index from a peer (if any), then starts the ingest
            sweepers.append(
                asyncio.create_task(index_peers.run(replication.ready), name="kv-index-peers")
            )
        if discovery is not None:
            discovery.start()
        if wait_ready_s > 0:
            await _until_ready(replication, wait_ready_s)
        log.info("%s", startup_summary(settings, replication))
        try:
            yield
        finally:
            if discovery is not None:
                await discovery.stop()
            for sweeper in sweepers:  # before the ingest: the peer recovery would start it
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper
            if ingest is not None:
                await ingest.stop()
            await replication.stop()

    app = build_http_app(
        settings=settings,
        service=service,
        selection=selection,
        replication=replication,
        registry=registry,
        lifespan=lifespan,
        consistency=consistency,
        index_peers=index_peers,
    )
    app.state.settings = settings
    app.state.service = service
    app.state.selection = selection
    app.state.ingest = ingest
    app.state.index_peers = index_peers
    app.state.discovery = discovery
    app.state.replication = replication
    app.state.registry = registry
    app.state.sweeps = sweeps
    return app


@dataclasses.dataclass
class SweepRuns:
    """How many turns each background sweep has completed: what waits for a sweep (the tests)
    waits for the count to move instead of for a time."""

    expiry: int = 0
    leases: int = 0


def make_consistency(
    settings: Settings,
    service: SlotTrackerService,
    replication: Replication,
    registry: CollectorRegistry,
) -> Consistency:
    """Replicated mode: lifecycle calls for ids not known yet wait for their add, and those
    still unknown are kept as early calls (tombstones, pending marks) for every instance."""
    service.replica.use_early_calls(
        settings.tombstone_capacity,
        settings.tombstone_ttl_seconds * NS_PER_S,
        settings.tombstone_max_bytes,
    )
    consistency = Consistency(
        service,
        replication,
        wait_ms=settings.consistency_wait_ms,
        durable_acks=settings.replication_ack == "redis",
    )
    watch_consistency(registry, consistency.counters, service.replica)
    return consistency


def router_config(settings: Settings, env: Mapping[str, str]) -> RouterConfig:
    """The router knobs: the ``router_*`` settings, then Dynamo's ``DYN_ROUTER_*`` variables,
    then Dynamo's preset (``router_preset``, ``--agentic``, ``--load-aware``)."""
    config = RouterConfig(
        overlap_score_credit=settings.router_overlap_score_credit,
        overlap_score_credit_decay=settings.router_overlap_score_credit_decay,
        prefill_load_scale=settings.router_prefill_load_scale,
        decode_active_request_weight=settings.router_decode_active_request_weight,
        router_temperature=settings.router_temperature,
        track_prefill_tokens=settings.router_track_prefill_tokens,
        router_ttl_secs=settings.router_ttl_seconds,
        use_kv_events=settings.router_use_kv_events,
        assume_kv_reuse=settings.router_assume_kv_reuse,
    ).with_env(env)
    return with_preset(config, settings.router_preset, env)  # a preset wins, as in Dynamo


def budgets_for(settings: Settings, memory_limit: int | None = None) -> Budgets:
    """The global budgets: the settings', those left 0 sized from the memory limit (the
    container's, else the machine's, shared by the ``workers`` processes)."""
    if memory_limit is None:
        # the processes of one instance (``workers``) share the container: each its part
        # ("auto": the cores this process may run on)
        workers = settings.workers
        count = len(os.sched_getaffinity(0)) if workers == "auto" else workers
        memory_limit = (MemoryLimitCollector().limit_bytes() or machine_memory_bytes()) // max(
            1, count
        )
    return Budgets.sized(
        memory_limit,
        memory_bytes=settings.memory_budget_bytes,
        active_requests=settings.max_active_requests,
        ranks=settings.max_ranks,
        block_hashes=settings.max_block_hashes,
        selection_workers=settings.max_selection_workers,
    )


def build_selection(
    settings: Settings, service: SlotTrackerService, env: Mapping[str, str] | None = None
) -> SelectionService:
    """The selection API's service, on the slot-tracker service's tracker registry, sharing
    its state with the other instances through the service's replica."""
    seed = settings.selection_seed
    rng = random.Random()
    if seed >= 0:  # instances sharing state must not generate the same selection ids
        rng = random.Random(seed if service.replicator is None else f"{seed}:{service.instance_id}")
    selection = SelectionService(
        service.registry,
        config=router_config(settings, os.environ if env is None else env),
        clock=service.clock,
        rng=rng,
        pending_max_entries=settings.selection_cache_max_entries,
        pending_ttl_ns=settings.selection_cache_ttl_seconds * NS_PER_S,
        pending_max_bytes=settings.selection_cache_max_bytes,
        session_affinity_ttl_ns=round(settings.session_affinity_ttl_seconds * NS_PER_S),
        max_hashes_per_request=settings.max_hashes_per_request,
        tombstone_ttl_ns=settings.reservation_tombstone_ttl_seconds * NS_PER_S,
        tombstone_capacity=settings.reservation_tombstone_capacity,
        tombstone_max_bytes=settings.reservation_tombstone_max_bytes,
        receipts=ReceiptRing(settings.selection_receipts_max, settings.selection_receipts_max_bytes)
        if settings.selection_receipts
        else None,
        instance=f"{platform.node()}/{service.instance_id}",
    )
    service.replica.bind_selection(selection.replica)
    if selection.receipts is not None:
        service.report_outcomes_to(selection.request_outcome)
    return selection


def startup_summary(settings: Settings, replication: Replication) -> str:
    """The one line that says what this instance is: address, docs, mode, key."""
    where = f"http://{settings.host}:{settings.port}"
    if replication.mode == "embedded":
        mode = "embedded mode (one instance, state in this process, no Redis)"
    else:
        status = replication.status()
        ack: str = settings.replication_ack
        if ack == "redis" and settings.replication_ack_replicas:
            ack += f" + {settings.replication_ack_replicas} replica(s)"
        via = (
            f"{status.redis}, namespace {status.namespace}"
            if status.redis
            else "the supervisor's hub of this host"
        )
        mode = f"replicated through {via}, instance {status.instance_id}, acknowledgements {ack}"
    key = "an API key is required" if settings.api_key.get_secret_value() else "no API key (open)"
    docs = f"docs {where}/docs"
    if settings.selection_port:
        docs += f"; selection API also at http://{settings.host}:{settings.selection_port}/"
    return f"kv-slot-tracker {__version__} on {where} ({docs}): {mode}; {key}"


async def _lease_sweeper(
    service: SlotTrackerService, replication: Replication, settings: Settings, runs: SweepRuns
) -> None:
    """Unregister the workers whose lease ran out, checked ten times per ttl (at least every
    second); not before the instance holds the shared state."""
    interval = min(1.0, settings.worker_ttl_seconds / 10)
    while True:
        await asyncio.sleep(interval)
        if not replication.ready():
            continue
        try:
            for key, worker_id in service.expire_leases():
                log.info(
                    "worker %d of model=%s routing_group=%s removed: its lease ran out",
                    worker_id,
                    *key,
                )
        except Exception:  # never let the sweeper die
            log.exception("lease sweep failed")
        runs.leases += 1


async def _until_ready(replication: Replication, timeout_s: float) -> None:
    """Until ``replication`` is ready, at most ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    await replication.settled(timeout_s)
    while not replication.ready() and loop.time() < deadline:
        await asyncio.sleep(0.02)
    if not replication.ready():
        log.warning("serving before the replication is ready: %s",
                    replication.status().not_ready_reason)  # fmt: skip


async def _expiry_sweeper(
    service: SlotTrackerService, selection: SelectionService, settings: Settings, runs: SweepRuns
) -> None:
    """Force expiry on every tracker now and then every interval; missed ticks are skipped."""
    interval = settings.force_expiry_interval_seconds
    while True:
        try:
            expired = service.expire()
            if expired:
                log.info("expired %d stale requests", expired)
            swept = selection.sweep()
            if swept:
                log.info("selection sweep dropped %d expired entries", swept)
        except Exception:  # never let the sweeper die
            log.exception("expiry sweep failed")
        runs.expiry += 1
        await asyncio.sleep(interval)
