"""Every route of the selection API (``/selection``), described once, as ``Routes`` does for the
slot tracker's.

The selection API re-creates Dynamo's standalone worker-selection service: workers are posted
with an endpoint and a block size, the service chooses a rank for each prompt (``select``) and
books it there (``select_and_reserve``, or ``reserve_pending`` / ``reserve`` after a ``select``),
and a reservation lives until ``free``. The arguments are the reference's JSON fields, with its
defaults (``model_name`` and ``routing_group`` ``"default"``); unset optional fields are not sent.
``client.selection`` (``SelectionClient`` / ``AsyncSelectionClient``) sends these calls.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping
from typing import Any, Protocol
from urllib.parse import quote

import httpx
from pydantic import TypeAdapter

from kv_slot_tracker_client import _call as c
from kv_slot_tracker_client._call import Call
from kv_slot_tracker_client._routes import _hashes, _tokens, _without_none
from kv_slot_tracker_client.models import (
    OverlapScoresResponse,
    PartitionDump,
    PartitionLoads,
    RankLoad,
    ReservationResponse,
    SelectAndReserveResponse,
    SelectionReady,
    SelectResponse,
    WorkerRecord,
)

DEFAULT_MODEL = "default"
DEFAULT_GROUP = "default"
SEL = "/selection"


class RankRef(Protocol):
    """Anything with ``worker_id`` and ``dp_rank``, such as a ``SelectResponse`` or a
    ``RankLoad``."""

    @property
    def worker_id(self) -> int: ...

    @property
    def dp_rank(self) -> int: ...


# -- building bodies ---------------------------------------------------------------------------


def _id_path(selection_id: str, tail: str = "") -> str:
    """The path of a reservation, its id percent-encoded (any character may be in an id)."""
    return f"{SEL}/reservations/{quote(selection_id, safe='')}{tail}"


def _rank(rank: RankRef | tuple[int, int] | None) -> dict[str, int] | None:
    if rank is None:
        return None
    if isinstance(rank, tuple):
        worker_id, dp_rank = rank
    else:
        worker_id, dp_rank = rank.worker_id, rank.dp_rank
    return {"worker_id": worker_id, "dp_rank": dp_rank}


def _prompt(
    model_name: str,
    routing_group: str,
    token_ids: Iterable[int] | None,
    block_hashes: Iterable[int] | None,
    sequence_hashes: Iterable[int] | None,
    isl_tokens: int | None,
    lora_name: str | None,
    cache_salt: str | None,
) -> dict[str, Any]:
    return {
        "model_name": model_name,
        "routing_group": routing_group,
        "token_ids": _tokens(token_ids),
        "block_hashes": _hashes(block_hashes),
        "sequence_hashes": _hashes(sequence_hashes),
        "isl_tokens": isl_tokens,
        "lora_name": lora_name,
        "cache_salt": cache_salt,
    }


def _worker_fields(
    endpoint: str | None,
    block_size: int | None,
    data_parallel_start_rank: int | None,
    data_parallel_size: int | None,
    max_num_batched_tokens: int | None,
    total_kv_blocks: int | None,
    kv_events_endpoint: str | None,
    kv_events_endpoints: Mapping[int | str, str] | None,
    replay_endpoint: str | None,
    stable_routing_id: str | None,
    is_eagle: bool | None,
    taints: Iterable[str] | None,
    topology_domains: Mapping[str, str] | None,
    kv_transfer_domain: str | None,
    kv_transfer_enforcement: str | None,
    kv_transfer_preferred_weight: float | None,
) -> dict[str, Any]:
    return {
        "endpoint": endpoint,
        "block_size": block_size,
        "data_parallel_start_rank": data_parallel_start_rank,
        "data_parallel_size": data_parallel_size,
        "max_num_batched_tokens": max_num_batched_tokens,
        "total_kv_blocks": total_kv_blocks,
        "kv_events_endpoint": kv_events_endpoint,
        "kv_events_endpoints": None
        if kv_events_endpoints is None
        else {str(k): v for k, v in kv_events_endpoints.items()},
        "replay_endpoint": replay_endpoint,
        "stable_routing_id": stable_routing_id,
        "is_eagle": is_eagle,
        "taints": None if taints is None else list(taints),
        "topology_domains": None if topology_domains is None else dict(topology_domains),
        "kv_transfer_domain": kv_transfer_domain,
        "kv_transfer_enforcement": kv_transfer_enforcement,
        "kv_transfer_preferred_weight": kv_transfer_preferred_weight,
    }


def _filters(model_name: str | None, routing_group: str | None) -> dict[str, str]:
    return _without_none({"model_name": model_name, "routing_group": routing_group})


# -- reading answers ---------------------------------------------------------------------------

_RECORD = c.reader(WorkerRecord)
_RECORDS = c.reader(list[WorkerRecord])
_SELECT = c.reader(SelectResponse)
_SELECT_AND_RESERVE = c.reader(SelectAndReserveResponse)
_RESERVATION = c.reader(ReservationResponse)
_LOADS = c.reader(list[PartitionLoads])
_POTENTIAL = c.reader(list[RankLoad])
_OVERLAP = c.reader(OverlapScoresResponse)
_DUMP = c.reader(dict[str, PartitionDump])
_RECEIPTS = c.reader(dict[str, Any])
_READY = TypeAdapter(SelectionReady)


def _ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    c.raise_for_status(response)
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


def _readiness(response: httpx.Response) -> SelectionReady:
    if response.status_code != 503:  # no schedulable worker is a valid answer, not an error
        c.raise_for_status(response)
    return c.validated(_READY, response)


# -- the routes --------------------------------------------------------------------------------


class SelectionRoutes:
    """One method per selection route (two for ``POST /selection/reservations``: its replay and
    explicit forms), returning the request to send. Stateless: ``SELECTION_ROUTES`` serves
    all."""

    # -- probes

    def health(self) -> Call[bool]:
        """``GET /selection/health``: True when the selection API answers; False rather than
        raising when the service is unreachable or failing."""
        return Call("GET", SEL + "/health", c.probe, unreachable=c.unreachable_is_no)

    def ready(self) -> Call[bool]:
        """``GET /selection/ready``: True while some worker (of any model) is schedulable;
        False when none is, or the service is unreachable."""
        return Call("GET", SEL + "/ready", c.probe, unreachable=c.unreachable_is_no)

    def readiness(self) -> Call[SelectionReady]:
        """``GET /selection/ready`` in full: ``ready``, the number of schedulable workers and
        the whole catalog (a 503, no schedulable worker, does not raise)."""
        return c.get(SEL + "/ready", _readiness)

    # -- workers

    def upsert_worker(
        self,
        worker_id: int,
        model_name: str = DEFAULT_MODEL,
        *,
        routing_group: str = DEFAULT_GROUP,
        endpoint: str | None = None,
        block_size: int | None = None,
        data_parallel_start_rank: int | None = None,
        data_parallel_size: int | None = None,
        max_num_batched_tokens: int | None = None,
        total_kv_blocks: int | None = None,
        kv_events_endpoint: str | None = None,
        kv_events_endpoints: Mapping[int | str, str] | None = None,
        replay_endpoint: str | None = None,
        stable_routing_id: str | None = None,
        is_eagle: bool | None = None,
        taints: Iterable[str] | None = None,
        topology_domains: Mapping[str, str] | None = None,
        kv_transfer_domain: str | None = None,
        kv_transfer_enforcement: str | None = None,
        kv_transfer_preferred_weight: float | None = None,
    ) -> Call[WorkerRecord]:
        """``POST /selection/workers``: register a worker or replace it (possibly moving it to
        another partition, ``(model_name, routing_group)``).

        A worker is schedulable with an ``endpoint`` and a ``block_size`` (the first schedulable
        worker of a partition fixes it); its ranks are ``data_parallel_start_rank`` (default 0)
        to ``+ data_parallel_size - 1`` (default 1 rank). An incomplete worker is stored too:
        the record's ``lifecycle`` and ``not_schedulable_reasons`` say why it is not
        schedulable. The other fields are echoed.
        """
        body = {
            "worker_id": worker_id,
            "model_name": model_name,
            "routing_group": routing_group,
            **_worker_fields(
                endpoint,
                block_size,
                data_parallel_start_rank,
                data_parallel_size,
                max_num_batched_tokens,
                total_kv_blocks,
                kv_events_endpoint,
                kv_events_endpoints,
                replay_endpoint,
                stable_routing_id,
                is_eagle,
                taints,
                topology_domains,
                kv_transfer_domain,
                kv_transfer_enforcement,
                kv_transfer_preferred_weight,
            ),
        }
        return c.post(SEL + "/workers", _without_none(body), _RECORD)

    def workers(
        self, model_name: str | None = None, routing_group: str | None = None
    ) -> Call[list[WorkerRecord]]:
        """``GET /selection/workers``: the catalog; a ``None`` filter matches everything."""
        filters = _filters(model_name, routing_group)
        return c.listing(SEL + "/workers", _RECORDS, operator.add, filters)

    def patch_worker(
        self,
        worker_id: int,
        *,
        endpoint: str | None = None,
        block_size: int | None = None,
        data_parallel_start_rank: int | None = None,
        data_parallel_size: int | None = None,
        max_num_batched_tokens: int | None = None,
        total_kv_blocks: int | None = None,
        kv_events_endpoint: str | None = None,
        kv_events_endpoints: Mapping[int | str, str] | None = None,
        replay_endpoint: str | None = None,
        stable_routing_id: str | None = None,
        is_eagle: bool | None = None,
        taints: Iterable[str] | None = None,
        topology_domains: Mapping[str, str] | None = None,
        kv_transfer_domain: str | None = None,
        kv_transfer_enforcement: str | None = None,
        kv_transfer_preferred_weight: float | None = None,
    ) -> Call[WorkerRecord]:
        """``PATCH /selection/workers/{worker_id}``: change the given fields only (not the
        partition: move a worker with ``upsert_worker``). Changing ``data_parallel_size`` adds
        or removes ranks at once. ``NotFound`` for an unknown worker."""
        body = _worker_fields(
            endpoint,
            block_size,
            data_parallel_start_rank,
            data_parallel_size,
            max_num_batched_tokens,
            total_kv_blocks,
            kv_events_endpoint,
            kv_events_endpoints,
            replay_endpoint,
            stable_routing_id,
            is_eagle,
            taints,
            topology_domains,
            kv_transfer_domain,
            kv_transfer_enforcement,
            kv_transfer_preferred_weight,
        )
        path = f"{SEL}/workers/{int(worker_id)}"
        return Call("PATCH", path, _RECORD, json=_without_none(body))

    def delete_worker(self, worker_id: int) -> Call[WorkerRecord]:
        """``DELETE /selection/workers/{worker_id}``: remove a worker; its reservations are
        freed, but their ids stay taken until a call on them answers ``NotFound``. Returns the
        record (``lifecycle`` ``unschedulable``); ``NotFound`` for an unknown worker."""
        return Call("DELETE", f"{SEL}/workers/{int(worker_id)}", _RECORD)

    # -- selection

    def select(
        self,
        model_name: str = DEFAULT_MODEL,
        *,
        routing_group: str = DEFAULT_GROUP,
        token_ids: Iterable[int] | None = None,
        block_hashes: Iterable[int] | None = None,
        sequence_hashes: Iterable[int] | None = None,
        isl_tokens: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        selection_id: str | None = None,
        session_id: str | None = None,
        expected_output_tokens: int | None = None,
        router_config_override: Mapping[str, Any] | None = None,
        pinned_worker: RankRef | tuple[int, int] | None = None,
        allowed_worker_ids: Iterable[int] | None = None,
        advisory: bool = False,
    ) -> Call[SelectResponse]:
        """``POST /selection/select``: choose the cheapest rank for a prompt; books nothing.

        Give the prompt as ``token_ids`` (hashed with the partition's block size and
        ``lora_name``), or as ``block_hashes`` (they feed the approximate cache),
        ``sequence_hashes`` (the chained hashes, which drive active-block accounting; same
        length) and ``isl_tokens`` (> 0); hashes may be u64 or i64. With a ``selection_id`` the
        pick is kept for ``reserve_pending``. ``pinned_worker`` (``(worker_id, dp_rank)``)
        forces a rank, ``allowed_worker_ids`` restricts the candidates, ``advisory`` adds the
        chosen worker's load. Raises ``Unavailable`` when no worker of the partition is
        schedulable, ``BadRequest`` for an incomplete prompt.
        """
        body = {
            **_prompt(
                model_name,
                routing_group,
                token_ids,
                block_hashes,
                sequence_hashes,
                isl_tokens,
                lora_name,
                cache_salt,
            ),
            "selection_id": selection_id,
            "session_id": session_id,
            "expected_output_tokens": expected_output_tokens,
            "router_config_override": None
            if router_config_override is None
            else dict(router_config_override),
            "pinned_worker": _rank(pinned_worker),
            "allowed_worker_ids": None if allowed_worker_ids is None else list(allowed_worker_ids),
            "advisory": advisory or None,
        }
        return c.post(SEL + "/select", _without_none(body), _SELECT)

    def select_and_reserve(
        self,
        model_name: str = DEFAULT_MODEL,
        *,
        routing_group: str = DEFAULT_GROUP,
        token_ids: Iterable[int] | None = None,
        block_hashes: Iterable[int] | None = None,
        sequence_hashes: Iterable[int] | None = None,
        isl_tokens: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        selection_id: str | None = None,
        session_id: str | None = None,
        expected_output_tokens: int | None = None,
        router_config_override: Mapping[str, Any] | None = None,
        pinned_worker: RankRef | tuple[int, int] | None = None,
        allowed_worker_ids: Iterable[int] | None = None,
        advisory: bool = False,
    ) -> Call[SelectAndReserveResponse]:
        """``POST /selection/select_and_reserve``: choose a rank as ``select`` does and book the
        prompt there, as reservation ``selection_id`` (a UUID when ``None``, returned).

        The booking adds the ``effective_prefill_tokens`` (the prompt's tokens not cached on the
        rank), the prompt's blocks and one request to the rank's load, and records the
        ``block_hashes`` in the approximate cache. ``Conflict`` when the id is already
        reserved; otherwise the errors of ``select``.
        """
        call = self.select(
            model_name,
            routing_group=routing_group,
            token_ids=token_ids,
            block_hashes=block_hashes,
            sequence_hashes=sequence_hashes,
            isl_tokens=isl_tokens,
            lora_name=lora_name,
            cache_salt=cache_salt,
            selection_id=selection_id,
            session_id=session_id,
            expected_output_tokens=expected_output_tokens,
            router_config_override=router_config_override,
            pinned_worker=pinned_worker,
            allowed_worker_ids=allowed_worker_ids,
            advisory=advisory,
        )
        return c.post(SEL + "/select_and_reserve", call.json, _SELECT_AND_RESERVE)

    # -- reservations

    def reserve_pending(
        self,
        selection_id: str,
        model_name: str = DEFAULT_MODEL,
        *,
        routing_group: str = DEFAULT_GROUP,
    ) -> Call[ReservationResponse]:
        """``POST /selection/reservations``, replay form: book exactly the pick that
        ``select(..., selection_id=...)`` kept (once). ``NotFound`` when there is none for this
        id and partition (expired, already used or never selected), ``Conflict`` when the id is
        already reserved."""
        body = {
            "selection_id": selection_id,
            "model_name": model_name,
            "routing_group": routing_group,
        }
        return c.post(SEL + "/reservations", body, _RESERVATION)

    def reserve(
        self,
        selection_id: str,
        worker_id: int,
        dp_rank: int = 0,
        *,
        model_name: str = DEFAULT_MODEL,
        routing_group: str = DEFAULT_GROUP,
        token_ids: Iterable[int] | None = None,
        block_hashes: Iterable[int] | None = None,
        sequence_hashes: Iterable[int] | None = None,
        isl_tokens: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        effective_prefill_tokens: int | None = None,
        track_prefill_tokens: bool | None = None,
        expected_output_tokens: int | None = None,
    ) -> Call[ReservationResponse]:
        """``POST /selection/reservations``, explicit form: book a prompt on ``(worker_id,
        dp_rank)`` chosen by the caller.

        The prompt is ``token_ids``, or ``sequence_hashes`` and ``isl_tokens`` with optional
        ``block_hashes`` (recorded in the approximate cache when given). The rank's prefill
        tokens grow by ``effective_prefill_tokens`` (at most ``isl_tokens``) only when it is
        given and ``track_prefill_tokens`` is not False. ``NotFound`` for a worker or rank not
        in the partition, ``Unavailable`` for a partition without schedulable workers,
        ``Conflict`` when the id is already reserved.
        """
        body = {
            "selection_id": selection_id,
            "worker_id": worker_id,
            "dp_rank": dp_rank,
            **_prompt(
                model_name,
                routing_group,
                token_ids,
                block_hashes,
                sequence_hashes,
                isl_tokens,
                lora_name,
                cache_salt,
            ),
            "effective_prefill_tokens": effective_prefill_tokens,
            "track_prefill_tokens": track_prefill_tokens,
            "expected_output_tokens": expected_output_tokens,
        }
        return c.post(SEL + "/reservations", _without_none(body), _RESERVATION)

    def prefill_complete(
        self, selection_id: str, *, cached_tokens: int | None = None
    ) -> Call[None]:
        """``POST /selection/reservations/{id}/prefill_complete``: the reservation's prefill is
        done; its prefill tokens stop counting (repeatable). ``NotFound`` for an unknown id.
        ``cached_tokens``: the prompt tokens the engine found cached (its
        ``usage.prompt_tokens_details.cached_tokens``), for the selection's routing receipt;
        ``None`` sends no body."""
        return Call(
            "POST",
            _id_path(selection_id, "/prefill_complete"),
            c.no_content,
            json=_cached(cached_tokens),
        )

    def output_block(self, selection_id: str, decay_fraction: float | None = None) -> Call[None]:
        """``POST /selection/reservations/{id}/output_block``: the request generated another
        block. ``decay_fraction`` (0..1) weights the blocks held only by this reservation;
        ``None`` counts them fully. ``NotFound`` for an unknown id."""
        body = _without_none({"decay_fraction": decay_fraction})
        return c.post(_id_path(selection_id, "/output_block"), body, c.no_content)

    def free(self, selection_id: str, *, cached_tokens: int | None = None) -> Call[None]:
        """``DELETE /selection/reservations/{id}``: the request finished; its tokens, blocks and
        request count leave the rank's load. ``NotFound`` for an unknown or already freed id.
        ``cached_tokens`` as for ``prefill_complete``."""
        return Call("DELETE", _id_path(selection_id), c.no_content, json=_cached(cached_tokens))

    # -- reads

    def loads(
        self, model_name: str | None = None, routing_group: str | None = None
    ) -> Call[list[PartitionLoads]]:
        """``GET /selection/loads``: per partition, every rank's prefill tokens, active blocks
        and requests (ranks in no particular order), and the pending selections."""
        return c.get(SEL + "/loads", _LOADS, _filters(model_name, routing_group))

    def potential_loads(
        self,
        model_name: str = DEFAULT_MODEL,
        *,
        routing_group: str = DEFAULT_GROUP,
        token_ids: Iterable[int] | None = None,
        block_hashes: Iterable[int] | None = None,
        sequence_hashes: Iterable[int] | None = None,
        isl_tokens: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> Call[list[RankLoad]]:
        """``POST /selection/potential_loads``: every rank's load if this prompt went there
        (its uncached tokens added to the prefill tokens, its blocks not yet active there to
        the blocks). The prompt as for ``select``; ``Unavailable`` without schedulable
        workers."""
        body = _prompt(
            model_name,
            routing_group,
            token_ids,
            block_hashes,
            sequence_hashes,
            isl_tokens,
            lora_name,
            cache_salt,
        )
        return c.post(SEL + "/potential_loads", _without_none(body), _POTENTIAL)

    def overlap_scores(
        self,
        model_name: str = DEFAULT_MODEL,
        *,
        routing_group: str = DEFAULT_GROUP,
        token_ids: Iterable[int] | None = None,
        block_hashes: Iterable[int] | None = None,
        sequence_hashes: Iterable[int] | None = None,
        isl_tokens: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> Call[OverlapScoresResponse]:
        """``POST /selection/overlap_scores``: the prompt's leading blocks each rank recently
        received (the approximate cache). The prompt as for ``select``; ``Unavailable``
        without schedulable workers."""
        body = _prompt(
            model_name,
            routing_group,
            token_ids,
            block_hashes,
            sequence_hashes,
            isl_tokens,
            lora_name,
            cache_salt,
        )
        return c.post(SEL + "/overlap_scores", _without_none(body), _OVERLAP)

    def dump(self) -> Call[dict[str, PartitionDump]]:
        """``GET /selection/dump``: every partition's approximate cache as stored events, keyed
        ``"model:routing_group"``."""
        return c.get(SEL + "/dump", _DUMP)

    def kv_index(self) -> Call[list[dict[str, Any]]]:
        """``GET /selection/kv_index``: the KV-event index as another instance recovers it
        (the NDJSON lines, each decoded: a header, per partition its ranks with their blocks
        and last sequence number, and an end line)."""
        return c.get(SEL + "/kv_index", _ndjson)

    # -- routing receipts (kept by the instance that decided)

    def receipt(self, selection_id: str) -> Call[dict[str, Any]]:
        """``GET /selection/receipts/{id}``: the routing receipt of one selection (every
        candidate's cost terms, the rank chosen, what decided, the outcome), if the instance
        asked made it and still keeps it; ``NotFound`` otherwise."""
        return c.get(f"{SEL}/receipts/{quote(selection_id, safe='')}", _RECEIPTS)

    def receipts(
        self,
        model_name: str | None = None,
        routing_group: str | None = None,
        *,
        worker_id: int | None = None,
        since: float | None = None,
        until: float | None = None,
        non_optimal: bool | None = None,
        limit: int | None = None,
    ) -> Call[dict[str, Any]]:
        """``GET /selection/receipts``: the newest receipts of the instance asked (``instance``,
        per-partition ``partitions`` summaries, ``receipts``), filtered by partition, chosen
        worker, decision time (Unix seconds) and ``non_optimal`` decisions."""
        params = {
            **_filters(model_name, routing_group),
            **_without_none(
                {
                    "worker_id": None if worker_id is None else str(int(worker_id)),
                    "since": None if since is None else repr(float(since)),
                    "until": None if until is None else repr(float(until)),
                    "non_optimal": None if non_optimal is None else str(bool(non_optimal)).lower(),
                    "limit": None if limit is None else str(int(limit)),
                }
            ),
        }
        return c.get(SEL + "/receipts", _RECEIPTS, params)

    def explain(self, model_name: str = DEFAULT_MODEL, **select: Any) -> Call[dict[str, Any]]:
        """``POST /selection/explain``: the receipt a ``select`` with these arguments would get
        (same keywords as ``select``); books nothing and changes nothing."""
        body = self.select(model_name, **select).json
        return c.post(SEL + "/explain", body, _RECEIPTS)


SELECTION_ROUTES = SelectionRoutes()


def _cached(cached_tokens: int | None) -> dict[str, int] | None:
    """The optional outcome body of a reservation's ``prefill_complete`` and ``DELETE``."""
    return None if cached_tokens is None else {"cached_tokens": cached_tokens}
