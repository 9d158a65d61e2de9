"""The selection API's operations: body bytes and path parameters in, ``(status, JSON)`` out.

Each operation validates its body (``kv_slot_tracker.http.body`` with the models of
``kv_slot_tracker.http.selection.schemas``), builds the service's command (``kv_slot_tracker.service.selection.commands``),
runs it on ``SelectionService`` and encodes the answer in the reference's field order. The GET
routes are ``SelectionQueries`` methods. Expected errors become their status through the one
error table (``kv_slot_tracker.http.errors``), whichever path (lean or FastAPI) serves the route.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import Response
from fastapi.responses import StreamingResponse
from starlette.datastructures import QueryParams

from kv_slot_tracker.core.hashing import to_unsigned
from kv_slot_tracker.core.selection import RouterConfigOverride
from kv_slot_tracker.core.selection.catalog import (
    KV_TRANSFER_ENFORCEMENTS,
    WorkerRecord,
    WorkerSpec,
)
from kv_slot_tracker.core.types import U32_MAX, WorkerWithDpRank
from kv_slot_tracker.http.answers import Result
from kv_slot_tracker.http.body import parse_json
from kv_slot_tracker.http.errors import EXPECTED, JSON_PARSE, JSON_SHAPE, HttpError, error_result
from kv_slot_tracker.http.queries import PROBE, paged, paged_response, query_value
from kv_slot_tracker.http.responses import json_response, load_rows_json
from kv_slot_tracker.http.selection import schemas
from kv_slot_tracker.http.selection.outcome import reported_cached_tokens
from kv_slot_tracker.ingest.peers import MEDIA_TYPE, IndexPeers
from kv_slot_tracker.service.selection import commands
from kv_slot_tracker.service.selection.service import SelectionService
from kv_slot_tracker.service.selection.types import OverlapScores, SelectOutcome

OK = b'{"status":"ok"}'
_SHARED_CACHE_OFF = {"enabled": False, "total_hit_blocks": 0, "ranges": [], "error": None}
_ENFORCEMENTS = KV_TRANSFER_ENFORCEMENTS
_U32_KEY = re.compile(r"\+?[0-9]+")
_F32 = struct.Struct("<f")
_F32_MAX = 3.4028234663852886e38


def f32(value: float) -> float | None:
    """``value`` as the reference stores it (f32) and prints it (shortest digits); an f32
    overflow is infinite, which the reference's JSON writes as ``null``."""
    if abs(value) > _F32_MAX:
        return None
    single: float = _F32.unpack(_F32.pack(value))[0]
    for digits in range(1, 10):
        text = f"{single:.{digits}g}"
        if _F32.unpack(_F32.pack(float(text)))[0] == single:
            return float(text)
    return single  # pragma: no cover - 9 significant digits always round-trip an f32


def _rank_keys(endpoints: dict[str, str] | None) -> dict[str, str] | None:
    """``kv_events_endpoints`` keyed by dp rank: keys must be u32 numbers in quotes."""
    if endpoints is None:
        return None
    out: dict[int, str] = {}
    for key, value in endpoints.items():
        if not (key.isascii() and _U32_KEY.fullmatch(key) and int(key) <= U32_MAX):
            raise HttpError(
                400,
                JSON_PARSE + "kv_events_endpoints.?: invalid value: expected key to be a number "
                "in quotes",
            )
        out[int(key)] = value
    return {str(k): v for k, v in sorted(out.items())}


def _worker_fields(b: schemas.WorkerBody | schemas.WorkerPatchBody) -> dict[str, Any]:
    enforcement = b.kv_transfer_enforcement
    if enforcement is not None and enforcement not in _ENFORCEMENTS:
        raise HttpError(
            422,
            JSON_SHAPE + f"kv_transfer_enforcement: unknown variant `{enforcement}`, expected "
            "`required` or `preferred`",
        )
    weight = b.kv_transfer_preferred_weight
    return {
        "endpoint": b.endpoint,
        "kv_events_endpoint": b.kv_events_endpoint,
        "kv_events_endpoints": _rank_keys(b.kv_events_endpoints),
        "replay_endpoint": b.replay_endpoint,
        "replay_endpoints": None if b.replay_endpoints is None else tuple(b.replay_endpoints),
        "block_size": b.block_size,
        "data_parallel_start_rank": b.data_parallel_start_rank,
        "data_parallel_size": b.data_parallel_size,
        "max_num_batched_tokens": b.max_num_batched_tokens,
        "total_kv_blocks": b.total_kv_blocks,
        "stable_routing_id": b.stable_routing_id,
        "is_eagle": b.is_eagle,
        "kv_transfer_domain": b.kv_transfer_domain,
        "kv_transfer_enforcement": enforcement,
        "kv_transfer_preferred_weight": None if weight is None else f32(float(weight)),
    }


def worker_json(r: WorkerRecord) -> dict[str, Any]:
    """A catalog record in the reference's field order."""
    s = r.spec
    out: dict[str, Any] = {
        "worker_id": s.worker_id,
        "model_name": s.model_name,
        "routing_group": s.routing_group,
        "lifecycle": r.lifecycle,
        "endpoint": s.endpoint,
        "kv_events_endpoint": s.kv_events_endpoint,
    }
    if s.kv_events_endpoints:  # the reference leaves an empty map out, as it leaves out none
        out["kv_events_endpoints"] = s.kv_events_endpoints
    out["replay_endpoint"] = s.replay_endpoint
    if s.replay_endpoints:  # an extension: absent unless given (as an empty map above)
        out["replay_endpoints"] = list(s.replay_endpoints)
    out.update(
        block_size=s.block_size,
        data_parallel_start_rank=s.data_parallel_start_rank,
        data_parallel_size=s.data_parallel_size,
        max_num_batched_tokens=s.max_num_batched_tokens,
        total_kv_blocks=s.total_kv_blocks,
        stable_routing_id=s.stable_routing_id,
        is_eagle=s.is_eagle,
        taints=list(s.taints),
        topology_domains=s.topology_domains or {},
        kv_transfer_domain=s.kv_transfer_domain,
        kv_transfer_enforcement=s.kv_transfer_enforcement,
        kv_transfer_preferred_weight=s.kv_transfer_preferred_weight,
    )
    if r.reasons:
        out["not_schedulable_reasons"] = list(r.reasons)
    return out


def _prompt_fields(b: schemas.PromptBody) -> dict[str, Any]:
    return {
        "model_name": b.model_name,
        "routing_group": b.routing_group,
        "token_ids": b.token_ids,
        "block_hashes": b.block_hashes,
        "sequence_hashes": b.sequence_hashes,
        "isl_tokens": b.isl_tokens,
        "lora_name": b.lora_name,
        "cache_salt": b.cache_salt,
        "router_config_override": RouterConfigOverride.from_json(b.router_config_override),
    }


def select_command(b: schemas.SelectBody, *, reserve: bool) -> commands.Select:
    pinned = b.pinned_worker
    return commands.Select(
        **_prompt_fields(b),
        selection_id=b.selection_id,
        pinned_worker=None
        if pinned is None
        else WorkerWithDpRank(pinned.worker_id, pinned.dp_rank),
        allowed_worker_ids=b.allowed_worker_ids,
        advisory=b.advisory,
        expected_output_tokens=b.expected_output_tokens,
        session_id=b.session_id,
        reserve=reserve,
    )


def select_json(o: SelectOutcome, *, reserve: bool) -> dict[str, Any]:
    sel = o.selection
    out: dict[str, Any] = {}
    if o.selection_id is not None:
        out["selection_id"] = o.selection_id
    if reserve:
        out["sequence_hashes"] = list(o.prompt.sequence_hashes)
        out["isl_tokens"] = o.prompt.isl_tokens
        out["track_prefill_tokens"] = o.track_prefill_tokens
    overlap = sel.overlap.max_tokens
    cpu = overlap if sel.overlap.cpu_tokens is None else sel.overlap.cpu_tokens
    disk = overlap if sel.overlap.disk_tokens is None else sel.overlap.disk_tokens
    out.update(
        model_name=o.model_name,
        routing_group=o.routing_group,
        worker_id=sel.worker.worker_id,
        dp_rank=sel.worker.dp_rank,
        endpoint=o.endpoint,
        block_size=o.block_size,
        overlap={
            "longest_matched": disk,
            "gpu": overlap,
            "dp": {str(rank): tokens for rank, tokens in sel.overlap.dp_tokens.items()},
            "cpu": cpu,
            "disk": disk,
        },
        effective_prefill_tokens=sel.effective_prefill_tokens,
        potential_decode_blocks=sel.potential_decode_blocks,
    )
    load = o.worker_load
    if load is not None:
        wl: dict[str, int] = {
            "active_prefill_tokens": load.active_prefill_tokens,
            "prefill_token_capacity": load.prefill_token_capacity,
        }
        if load.total_kv_blocks is not None:
            wl["total_kv_blocks"] = load.total_kv_blocks
        out["worker_load"] = wl
    return out


_NO_EXTENSION = (0, 0)


def overlap_json(o: OverlapScores) -> dict[str, Any]:
    return {
        "block_size": o.block_size,
        "num_blocks": o.num_blocks,
        "workers": [
            {
                "worker_id": wid,
                "dp_rank": rank,
                "device_blocks": k,
                "host_pinned_blocks": k + h,
                "disk_blocks": k + h + d,
                "host_pinned_extension_blocks": h,
                "disk_extension_blocks": d,
                "shared_beyond_device_blocks": None,
            }
            for wid, rank, k in o.rows
            for h, d in (o.extensions.get((wid, rank), _NO_EXTENSION),)
        ],
        "shared_cache": _SHARED_CACHE_OFF,
    }


def _booked_json(b: Any) -> bytes:
    return orjson.dumps(
        {
            "selection_id": b.selection_id,
            "model_name": b.model_name,
            "routing_group": b.routing_group,
            "worker_id": b.worker.worker_id,
            "dp_rank": b.worker.dp_rank,
            "endpoint": b.endpoint,
        }
    )


class SelectionOperations:
    """Every call route of the selection API, by name (the route table names them)."""

    def __init__(self, service: SelectionService) -> None:
        self.service = service

    def get(self, name: str) -> Callable[..., Result]:
        op: Callable[..., Result] = getattr(self, name)

        def run(raw: bytes, *args: Any) -> Result:
            try:
                return op(raw, *args)
            except EXPECTED as e:
                return error_result(e)

        return run

    # -- workers ---------------------------------------------------------------------------

    def upsert_worker(self, raw: bytes) -> Result:
        b = parse_json(raw, schemas.WorkerBody, schemas.SERDE)
        spec = WorkerSpec(
            worker_id=b.worker_id,
            model_name=b.model_name,
            routing_group=b.routing_group,
            taints=tuple(b.taints),
            topology_domains=dict(b.topology_domains),
            **_worker_fields(b),
        )
        record = self.service.upsert_worker(commands.UpsertWorker(spec=spec))
        return 201, orjson.dumps(worker_json(record))

    def patch_worker(self, raw: bytes, worker_id: int) -> Result:
        b = parse_json(raw, schemas.WorkerPatchBody, schemas.SERDE)
        changes = _worker_fields(b)
        if b.taints is not None:
            changes["taints"] = tuple(b.taints)
        if b.topology_domains is not None:
            changes["topology_domains"] = dict(b.topology_domains)
        record = self.service.patch_worker(
            commands.PatchWorker(worker_id=worker_id, changes=changes)
        )
        return 200, orjson.dumps(worker_json(record))

    def delete_worker(self, raw: bytes, worker_id: int) -> Result:
        record = self.service.delete_worker(commands.DeleteWorker(worker_id=worker_id))
        return 200, orjson.dumps(worker_json(record))

    # -- selection -------------------------------------------------------------------------

    def select(self, raw: bytes) -> Result:
        cmd = select_command(parse_json(raw, schemas.SelectBody, schemas.SERDE), reserve=False)
        return 200, orjson.dumps(select_json(self.service.select(cmd), reserve=False))

    def select_and_reserve(self, raw: bytes) -> Result:
        b = parse_json(raw, schemas.SelectBody, schemas.SERDE, "SelectAndReserveRequest")
        cmd = select_command(b, reserve=True)
        return 200, orjson.dumps(select_json(self.service.select(cmd), reserve=True))

    def potential_loads(self, raw: bytes) -> Result:
        b = parse_json(raw, schemas.PromptBody, schemas.SERDE, "PotentialLoadsRequest")
        rows = self.service.potential_loads(commands.PotentialLoads(**_prompt_fields(b)))
        return 200, load_rows_json(rows)

    def overlap_scores(self, raw: bytes) -> Result:
        b = parse_json(raw, schemas.PromptBody, schemas.SERDE, "OverlapScoresRequest")
        scores = self.service.overlap_scores(commands.OverlapScores(**_prompt_fields(b)))
        return 200, orjson.dumps(overlap_json(scores))

    # -- reservations ----------------------------------------------------------------------

    def reserve(self, raw: bytes) -> Result:
        b = parse_json(raw, schemas.ReservationBody, schemas.SERDE, "ReservationRequest")
        if b.worker_id is None:
            booked = self.service.replay(
                commands.ReplaySelection(
                    model_name=b.model_name,
                    routing_group=b.routing_group,
                    selection_id=b.selection_id,
                )
            )
        else:
            booked = self.service.book(
                commands.BookExplicit(
                    **_prompt_fields(b),
                    selection_id=b.selection_id,
                    worker_id=b.worker_id,
                    dp_rank=b.dp_rank if b.dp_rank is not None else 0,
                    effective_prefill_tokens=b.effective_prefill_tokens,
                    track_prefill_tokens=b.track_prefill_tokens,
                    expected_output_tokens=b.expected_output_tokens,
                )
            )
        return 201, _booked_json(booked)

    def reservation_prefill_complete(self, raw: bytes, selection_id: str) -> Result:
        cached = reported_cached_tokens(raw)
        self.service.prefill_complete(
            commands.ReservationCall(selection_id=selection_id, cached_tokens=cached)
        )
        return 200, OK

    def reservation_output_block(self, raw: bytes, selection_id: str) -> Result:
        b = parse_json(raw, schemas.ReservationOutputBlockBody, schemas.SERDE)
        f = None if b.decay_fraction is None else float(b.decay_fraction)
        self.service.output_block(
            commands.ReservationOutputBlock(selection_id=selection_id, decay_fraction=f)
        )
        return 200, OK

    def delete_reservation(self, raw: bytes, selection_id: str) -> Result:
        cached = reported_cached_tokens(raw)
        self.service.release(
            commands.ReservationCall(selection_id=selection_id, cached_tokens=cached)
        )
        return 200, OK


class SelectionQueries:
    """The selection API's GET routes: query parameters in, ``Response`` out."""

    def __init__(
        self,
        service: SelectionService,
        peers: IndexPeers | None = None,
        silent_seconds: float = 60.0,
        list_max_items: int = 1000,
    ) -> None:
        self.service = service
        self.list_max_items = list_max_items
        self.peers = peers
        """KV events on: the listeners' state and the index shared with other instances."""
        self.silent_seconds = silent_seconds

    def health(self, params: QueryParams) -> Response:
        return json_response({"status": "ok"})

    def ready(self, params: QueryParams) -> Response:
        if params.get(PROBE):  # a caller without the key sees two fields: O(1), not the catalog
            count = self.service.schedulable_count()
            body: dict[str, Any] = {"ready": count > 0, "schedulable_workers": count}
        else:
            records = self.service.workers(None, None)
            count = sum(1 for r in records if r.schedulable)
            body = {
                "ready": count > 0,
                "schedulable_workers": count,
                "workers": [worker_json(r) for r in records],
            }
        ready = count > 0
        if self.peers is not None:
            body["kv_events"] = kv = self.peers.status(self.silent_seconds)
            body["ready"] = ready = ready and not kv["recovering"]
        return json_response(body, 200 if ready else 503)

    def kv_index(self, params: QueryParams) -> Response:
        if self.peers is None:
            return json_response({"error": "KV events are off on this instance"}, 404)
        if self.peers.recovering:
            return json_response({"error": "this instance is still loading its KV index"}, 503)
        return StreamingResponse(self.peers.dump(), media_type=MEDIA_TYPE)

    def workers(self, params: QueryParams) -> Response:
        m, g = query_value(params, "model_name"), query_value(params, "routing_group")
        records, cursor = paged(self.service.workers(m, g), params, self.list_max_items)
        return paged_response([worker_json(r) for r in records], cursor)

    def loads(self, params: QueryParams) -> Response:
        m, g = query_value(params, "model_name"), query_value(params, "routing_group")
        return json_response(
            [
                {
                    "model_name": key[0],
                    "routing_group": key[1],
                    "loads": orjson.Fragment(load_rows_json(rows)),
                    "pending_count": 0,
                    "pending_isl_tokens": 0,
                }
                for key, rows in self.service.loads(m, g)
            ]
        )

    def dump(self, params: QueryParams) -> Response:
        """The hashes as u64, as the reference shows them (the service keeps them signed);
        event ids count from 0 within each storage tier, as the reference numbers them."""
        u = to_unsigned
        out: dict[str, Any] = {}
        for key, block_size, runs in self.service.dump():
            ids: dict[str, int] = {}
            events = []
            for run in runs:
                i = ids.get(run.storage_tier, 0)
                ids[run.storage_tier] = i + 1
                events.append(
                    {
                        "worker_id": run.worker.worker_id,
                        "storage_tier": run.storage_tier,
                        "residency_domain": "worker",
                        "event": {
                            "event_id": i,
                            "data": {
                                "stored": {
                                    "parent_hash": None
                                    if run.parent_hash is None
                                    else u(run.parent_hash),
                                    "start_position": None,
                                    "blocks": [
                                        {
                                            "block_hash": u(block_hash),
                                            "tokens_hash": u(tokens_hash),
                                            "mm_extra_info": None,
                                        }
                                        for block_hash, tokens_hash in run.blocks
                                    ],
                                }
                            },
                            "dp_rank": run.worker.dp_rank,
                        },
                    }
                )
            out[f"{key[0]}:{key[1]}"] = {"block_size": block_size, "events": events}
        return json_response(out)
